"""The frames of one authenticated link, and how they share WebSocket messages.

A frame is one JSON object (`call`, `accepted`, `reply`, `ack`, ...), encoded as
UTF-8 without a newline (JSON escapes the ones inside strings, and every other
control character; text is not escaped to `\\uXXXX`, so an envelope of non-ASCII
text is not six times its size on the link). The frames queued for a
link while its writer was busy leave together, as one WebSocket message of lines
of at most `COALESCE_BYTES` (a frame bigger than that goes alone): under load a
call's `accepted`, another's `reply` and a third's `ack` cost one TLS record and
one `write` instead of three. A lone frame is sent the moment the writer runs.

A receiver handles each line of a message as if it had come alone: the same
checks, rate limit and refusals. `max_frame_bytes` bounds each frame (a longer
line closes the link, as a longer message would); a message holding several is
accepted up to `message_limit`, at least `COALESCE_BYTES`, so a peer may coalesce
whatever frame limit this side set. Each side tells the other its frame limit in
the handshake; a frame over the peer's is never sent (`FrameTooLarge`: the caller
answers the call or reply it held some other way), since the peer would close the
link on it and the frame would be sent again on the next one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

import orjson

COALESCE_BYTES = 16384
# What one link may hold for a peer that does not read: beyond, the link is closed
# (durable replies stay in the outbox and go again on the next link).
SEND_QUEUE_BYTES = 16 * 1024 * 1024


class FrameTooLarge(Exception):
    """A frame over the limit the peer announced: not sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes > the peer's {limit}")
        self.size, self.limit = size, limit


def message_limit(max_frame_bytes: int) -> int:
    """The largest WebSocket message a link takes: one frame, or frames that share it."""
    return max(max_frame_bytes, COALESCE_BYTES)


def encode(frame: dict[str, object]) -> bytes:
    """Compact UTF-8 JSON. Raises `orjson.JSONEncodeError` (a TypeError) for a value
    JSON cannot carry: a string with a lone surrogate, an integer over 64 bits.

    Copied to bytes of its own size: orjson 3.x returns its working buffer, at least
    4 KiB whatever the frame's length, and frames wait in a link's queue (a 60-byte
    refusal held 4 KiB, so a queue of small frames took 60 times its byte count)."""
    return bytes(memoryview(orjson.dumps(frame)))


def encode_within(frame: dict[str, object], limit: int) -> bytes:
    """`encode`, or `FrameTooLarge` if the bytes are over `limit`."""
    data = encode(frame)
    if len(data) > limit:
        raise FrameTooLarge(len(data), limit)
    return data


def too_big(frame: str | bytes, max_frame_bytes: int) -> bool:
    """Whether one frame is over the limit (in UTF-8 bytes, as a message would be)."""
    if isinstance(frame, bytes):
        return len(frame) > max_frame_bytes
    return len(frame) * 4 > max_frame_bytes and len(frame.encode()) > max_frame_bytes


def lines(message: str | bytes) -> Iterator[str | bytes]:
    """The frames of one received message (a message without a newline is one)."""
    if isinstance(message, str):
        return iter(message.split("\n"))
    return iter(message.split(b"\n"))


class FrameQueue:
    """Frames for one link's writer, in order, at most `max_bytes` of them: a peer
    that stops reading cannot make the daemon hold what it sends it."""

    __slots__ = ("_bytes", "_frames", "_limit", "_max_bytes", "_ready", "overflowed")

    def __init__(self, limit: int = COALESCE_BYTES, max_bytes: int = SEND_QUEUE_BYTES
                 ) -> None:
        self._frames: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._limit = limit
        self._max_bytes = max_bytes
        self._bytes = 0
        self.overflowed = False  # once full, it takes nothing more

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def put(self, frame: bytes) -> bool:
        """Queue `frame`; False (and nothing queued, now or later) once the frames
        waiting would pass `max_bytes`."""
        if self.overflowed or self._bytes + len(frame) > self._max_bytes:
            self.overflowed = True
            self._frames.clear()
            self._bytes = 0
            return False
        self._frames.append(frame)
        self._bytes += len(frame)
        self._ready.set()
        return True

    async def message(self) -> bytes:
        """The next message: the oldest frame and those queued behind it that fit."""
        frames = self._frames
        while not frames:
            self._ready.clear()
            await self._ready.wait()
        first = frames.popleft()
        self._bytes -= len(first)
        if not frames:
            return first
        parts, size = [first], len(first)
        while frames and size + 1 + len(frames[0]) <= self._limit:
            frame = frames.popleft()
            self._bytes -= len(frame)
            parts.append(frame)
            size += 1 + len(frame)
        return b"\n".join(parts)
