"""How a link's frames share WebSocket messages: what piled up while the writer
was busy leaves as one message of lines, in order, within the size cap."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd.federation._frames import (
    COALESCE_BYTES,
    FrameQueue,
    FrameTooLarge,
    encode,
    encode_within,
    lines,
    message_limit,
    too_big,
)


async def test_a_lone_frame_leaves_alone_and_the_writer_waits_for_the_next() -> None:
    queue = FrameQueue()
    queue.put(b'{"t":"ack","id":1}')
    assert await queue.message() == b'{"t":"ack","id":1}'
    waiting = asyncio.ensure_future(queue.message())
    await asyncio.sleep(0)
    assert not waiting.done()
    queue.put(b'{"t":"ack","id":2}')
    assert await asyncio.wait_for(waiting, 5) == b'{"t":"ack","id":2}'


async def test_queued_frames_share_a_message_in_order_within_the_cap() -> None:
    queue = FrameQueue(limit=40)
    for frame in (b"a" * 10, b"b" * 10, b"c" * 10, b"d" * 30, b"e" * 50, b"f"):
        queue.put(frame)
    got = [await queue.message() for _ in range(4)]
    assert got == [b"a" * 10 + b"\n" + b"b" * 10 + b"\n" + b"c" * 10,  # 32 bytes; +31 > 40
                   b"d" * 30,
                   b"e" * 50,  # bigger than the cap: alone, as before coalescing
                   b"f"]
    assert len(queue) == 0


async def test_a_queue_takes_at_most_its_bytes_then_nothing() -> None:
    queue = FrameQueue(max_bytes=100)
    assert all(queue.put(b"x" * 30) for _ in range(3)) and queue.queued_bytes == 90
    assert await queue.message() == b"\n".join([b"x" * 30] * 3)
    assert queue.queued_bytes == 0
    assert queue.put(b"y" * 60)
    assert not queue.put(b"z" * 60)  # 120 > 100: full
    assert not queue.put(b"z")  # and it stays closed: the link goes down
    assert len(queue) == 0 and queue.queued_bytes == 0 and queue.overflowed


def test_an_encoded_frame_holds_its_own_size_not_the_encoders_buffer() -> None:
    """orjson returns a buffer of at least 4 KiB; 10,000 queued refusals held 40 MiB."""
    tracemalloc.start()
    try:
        frames = [encode({"t": "refused", "id": str(i), "code": "malformed"})
                  for i in range(10_000)]
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(frames) == 10_000 and held < 2 * 1024 * 1024


@given(st.lists(st.dictionaries(st.sampled_from(["t", "id", "envelope", "thread"]),
                                st.one_of(st.text(), st.integers(-(2**63), 2**64 - 1)),
                                max_size=4),
                min_size=1, max_size=30),
       st.integers(min_value=1, max_value=COALESCE_BYTES))
def test_every_frame_comes_back_once_in_order(frames: list[dict[str, object]],
                                              limit: int) -> None:
    """JSON escapes a newline inside a string, so a line is always one whole frame."""
    async def drain() -> list[object]:
        queue = FrameQueue(limit)
        for frame in frames:
            queue.put(encode(frame))
        out: list[object] = []
        while len(queue):
            message = await queue.message()
            assert len(message) <= limit or b"\n" not in message
            out.extend(json.loads(line) for line in lines(message))
        return out

    assert asyncio.run(drain()) == frames


def test_a_frame_is_measured_in_utf8_bytes_and_a_message_takes_at_least_the_cap() -> None:
    assert not too_big(b"x" * 1024, 1024) and too_big(b"x" * 1025, 1024)
    assert not too_big("\u00e9" * 512, 1024) and too_big("\u00e9" * 513, 1024)
    assert not too_big("x" * 1024, 1024) and too_big("x" * 1025, 1024)
    assert message_limit(1024) == COALESCE_BYTES
    assert message_limit(1 << 20) == 1 << 20


def test_text_crosses_as_utf8_and_a_frame_over_a_limit_is_refused() -> None:
    frame = {"t": "call", "envelope": "\u00e9t\u00e9 \u2028 \n"}
    data = encode(frame)
    assert "\u00e9t\u00e9".encode() in data and b"\n" not in data  # one line
    assert json.loads(data) == frame
    assert encode_within(frame, len(data)) == data
    with pytest.raises(FrameTooLarge) as err:
        encode_within(frame, len(data) - 1)
    assert (err.value.size, err.value.limit) == (len(data), len(data) - 1)


@pytest.mark.parametrize("value", ["\ud800", 2**64])
def test_a_value_json_cannot_carry_is_never_encoded(value: object) -> None:
    """A lone surrogate is not UTF-8; an integer over 64 bits is not read back as one
    by every JSON reader. Either raises instead of sending what the peer refuses."""
    with pytest.raises(TypeError):
        encode({"t": "call", "id": value})
