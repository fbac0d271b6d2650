"""Timers and handler state through the whole pump and a real kernel: a timer is
a durable row answered later on the caller's own frame; state is scoped to
(listener, conversation), commits with the handler's output, and leaves with it."""

from __future__ import annotations

import heapq
from decimal import Decimal
from pathlib import Path

import pytest

from agentd.config import load_config
from agentd.durable import (
    Deadline,
    StateBook,
    StateLimitExceeded,
    StateView,
    Wait,
    is_late,
    sleep_for,
    take_due,
)
from agentd.durable.deadlines import MAX_SLEEP_S
from agentd.testing import Harness
from tests.organisms.durable import Count, Nap, Peek

ORGANISM = Path(__file__).parent / "organisms" / "durable.yaml"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def harness(clock: FakeClock, state_dir: Path | None = None) -> Harness:
    return Harness(load_config(ORGANISM), {"alice": "public", "bob": "public"},
                   clock=clock, state_dir=state_dir)


def tags(frames: list[bytes]) -> list[str]:
    from lxml import etree

    out = []
    for data in frames:
        root = etree.fromstring(data)
        out.append(etree.QName(root[1]).localname)
    return out


def text_of(frame: bytes, name: str) -> str:
    from lxml import etree

    root = etree.fromstring(frame)
    found = root[1].find(f"{{*}}{name}")
    assert found is not None, frame
    return found.text or ""


# ---- the pure decisions -----------------------------------------------------------


def test_take_due_pops_what_is_due_soonest_first_and_skips_cancelled() -> None:
    heap: list[Deadline] = []
    for due, ident in ((5.0, "c"), (1.0, "a"), (3.0, "b"), (9.0, "d")):
        heapq.heappush(heap, Deadline(due, "timer", ident))
    live = {("timer", "a"), ("timer", "c"), ("timer", "d")}  # b was cancelled
    assert [d.id for d in take_due(heap, 5.0, live)] == ["a", "c"]
    assert [d.id for d in heap] == ["d"]
    assert take_due(heap, 8.9, live) == []


def test_take_due_is_bounded_per_round() -> None:
    heap = [Deadline(float(i), "timer", str(i)) for i in range(10)]
    live = {("timer", str(i)) for i in range(10)}
    assert len(take_due(heap, 100.0, live, limit=4)) == 4
    assert len(heap) == 6


def test_sleep_for_waits_for_the_earliest_and_is_bounded() -> None:
    assert sleep_for([], 0.0) == MAX_SLEEP_S
    assert sleep_for([Deadline(12.5, "timer", "x")], 10.0) == 2.5
    assert sleep_for([Deadline(5.0, "timer", "x")], 10.0) == 0.0
    assert sleep_for([Deadline(1e9, "timer", "x")], 0.0) == MAX_SLEEP_S


def test_late_means_more_than_a_second_after_due() -> None:
    assert not is_late(10.0, 11.0)
    assert is_late(10.0, 11.01)


# ---- timers through the pump ------------------------------------------------------------


async def test_a_timer_wakes_its_caller_on_its_own_frame() -> None:
    clock = FakeClock()
    async with harness(clock) as h:
        frames = await h.send("alice", Nap(seconds=Decimal("2.5"), note="tea"))
        assert tags(frames) == ["accepted"]  # the handler returned; the call stays open
        assert [t.note for t in h.pump.waits.timers.values()] == ["tea"]
        assert await h.fire_due() == 0  # not yet due
        clock.now += 2.5
        assert await h.fire_due() == 1
        assert h.pump.waits.timers == {}
        (napped,) = [f for f in h.frames("alice", _thread(frames)) if b"napped" in f]
        assert text_of(napped, "note") == "tea"
        assert text_of(napped, "late") == "false"
        assert await h.kernel.timers() == []  # type: ignore[union-attr]


def _thread(frames: list[bytes]) -> str:
    return text_of(frames[0], "thread")


async def test_a_client_may_call_the_timer_directly() -> None:
    clock = FakeClock()
    async with harness(clock) as h:
        frames = await h.send("alice", Wait(seconds=Decimal("0"), note="now"))
        thread = _thread(frames)
        await h.fire_due()
        assert tags(h.frames("alice", thread)) == ["accepted", "woke"]


async def test_a_timer_over_max_delay_is_denied() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", Wait(seconds=Decimal("3601")))
        assert tags(frames) == ["accepted", "huh"]
        assert text_of(frames[1], "code") == "denied"
        assert h.pump.waits.timers == {}


async def test_a_negative_delay_is_denied() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", Wait(seconds=Decimal("-1")))
        assert text_of(frames[1], "code") == "denied"


async def test_pending_timers_per_thread_are_capped() -> None:
    async with harness(FakeClock()) as h:
        first = await h.send("alice", Wait(seconds=Decimal("10")))
        thread = _thread(first)
        for _ in range(2):
            await h.send("alice", Wait(seconds=Decimal("10")), thread=thread)
        frames = await h.send("alice", Wait(seconds=Decimal("10")), thread=thread)
        assert tags(frames) == ["accepted", "huh"]
        assert text_of(frames[1], "code") == "denied"
        assert len(h.pump.waits.timers) == 3


async def test_pending_timers_per_client_are_capped() -> None:
    """A client's calls on thousands of threads, each leaving a timer, could fill
    the daemon's timers for every other client; each client has its share
    (MAX_TIMERS_PER_CLIENT; 2 here)."""
    async with harness(FakeClock()) as h:
        h.pump.waits.max_timers_per_client = 2
        for _ in range(2):
            assert tags(await h.send("alice", Wait(seconds=Decimal("10")))) == ["accepted"]
        frames = await h.send("alice", Wait(seconds=Decimal("10")))
        assert tags(frames) == ["accepted", "huh"] and text_of(frames[1], "code") == "denied"
        assert tags(await h.send("bob", Wait(seconds=Decimal("10")))) == ["accepted"]
        first = next(iter(h.pump.waits.timers.values()))
        await h.end_conversation(first.conversation)  # its timer cancelled: room again
        assert tags(await h.send("alice", Wait(seconds=Decimal("10")))) == ["accepted"]
        # Counted again: alice is at her share, bob has room for one more.
        assert tags(await h.send("alice", Wait(seconds=Decimal("10")))) == ["accepted", "huh"]
        assert tags(await h.send("bob", Wait(seconds=Decimal("10")))) == ["accepted"]
        assert tags(await h.send("bob", Wait(seconds=Decimal("10")))) == ["accepted", "huh"]


async def test_a_timer_survives_a_restart_and_fires_late_exactly_once(tmp_path: Path) -> None:
    clock = FakeClock()
    async with harness(clock, tmp_path) as h:
        frames = await h.send("alice", Nap(seconds=Decimal("5"), note="later"))
        thread = _thread(frames)
    clock.now += 60  # the daemon was down past the due time
    async with harness(clock, tmp_path) as h:
        assert len(h.pump.waits.timers) == 1
        assert await h.fire_due() == 1
        assert await h.fire_due() == 0
        napped = [f for f in h.frames("alice", thread) if b"napped" in f]
        assert len(napped) == 1
        assert text_of(napped[0], "late") == "true"
    async with harness(clock, tmp_path) as h:  # and never again
        assert h.pump.waits.timers == {}
        assert await h.fire_due() == 0


async def test_a_timer_of_an_ended_conversation_is_cancelled() -> None:
    clock = FakeClock()
    async with harness(clock) as h:
        frames = await h.send("alice", Nap(seconds=Decimal("5"), note="x"))
        thread = _thread(frames)
        assert await h.end_conversation(thread)
        assert h.pump.waits.timers == {}
        assert await h.kernel.timers() == []  # type: ignore[union-attr]
        clock.now += 10
        assert await h.fire_due() == 0


async def test_ending_a_call_frame_instead_of_its_conversation_is_refused() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", Nap(seconds=Decimal("5"), note="x"))
        (timer,) = h.pump.waits.timers.values()
        assert timer.frame != _thread(frames)
        assert not await h.end_conversation(timer.frame)  # a call, not a conversation
        assert not await h.end_conversation("no-such-thread")
        assert list(h.pump.waits.timers.values()) == [timer]


async def test_a_frame_holding_a_timer_is_not_collected_as_idle() -> None:
    clock = FakeClock()
    async with harness(clock) as h:
        frames = await h.send("alice", Nap(seconds=Decimal("100"), note="x"))
        assert h.pump.collect_idle(0.0, now=1e12) == 0
        clock.now += 100
        await h.fire_due()
        assert any(b"napped" in f for f in h.frames("alice", _thread(frames)))


# ---- handler state ------------------------------------------------------------------------


async def test_state_lives_as_long_as_the_conversation() -> None:
    async with harness(FakeClock()) as h:
        first = await h.send("alice", Count())
        thread = _thread(first)
        assert text_of(first[-1], "value") == "1"
        again = await h.send("alice", Count(by=2), thread=thread)
        assert text_of(again[-1], "value") == "3"


async def test_state_is_invisible_to_other_threads_and_listeners() -> None:
    async with harness(FakeClock()) as h:
        a = await h.send("alice", Count(by=5))
        b = await h.send("alice", Count())  # a new thread: its own slice
        assert text_of(b[-1], "value") == "1"
        other = await h.send("bob", Count())
        assert text_of(other[-1], "value") == "1"
        peek = await h.send("alice", Peek(), thread=_thread(a))  # same thread, other listener
        assert text_of(peek[-1], "value") == "0"


async def test_state_commits_with_the_output_or_not_at_all() -> None:
    async with harness(FakeClock()) as h:
        first = await h.send("alice", Count())
        thread = _thread(first)
        failed = await h.send("alice", Count(by=10, fail=True), thread=thread)
        assert text_of(failed[-1], "code") == "internal"
        after = await h.send("alice", Count(), thread=thread)
        assert text_of(after[-1], "value") == "2"
        rows = await h.kernel.handler_state()  # type: ignore[union-attr]
        assert rows == [("counter", thread, "n", "2")]


async def test_state_over_the_limit_is_refused_and_nothing_is_written() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", Count(by=10 ** 70))  # 71 digits > 64 bytes
        assert text_of(frames[-1], "code") == "internal"
        assert await h.kernel.handler_state() == []  # type: ignore[union-attr]


def test_calls_on_other_frames_cannot_together_pass_the_state_limit() -> None:
    """Two calls of one listener in one conversation (a relay's, an agent's parallel
    tool calls) each see the slice as it was when they started: each write fits
    alone, the second to finish is refused whole (before: both kept, 18 KB in a
    1,000-byte slice from 20 calls)."""
    book = StateBook(max_bytes=1000)
    first, second = StateView(book, "putter", "c1"), StateView(book, "putter", "c1")
    first.set("a", "x" * 900)
    second.set("b", "y" * 900)
    assert book.apply(first) == [("a", "x" * 900)]
    with pytest.raises(StateLimitExceeded):
        book.apply(second)
    assert book.size("putter", "c1") == 901 and book.slice("putter", "c1") == {"a": "x" * 900}
    third = StateView(book, "putter", "c1")
    third.delete("a")
    third.set("b", "y" * 900)  # a delete makes room within one call
    assert book.apply(third) == [("a", None), ("b", "y" * 900)]
    assert book.size("putter", "c1") == 901


async def test_state_survives_a_restart(tmp_path: Path) -> None:
    async with harness(FakeClock(), tmp_path) as h:
        first = await h.send("alice", Count(by=4))
        thread = _thread(first)
    async with harness(FakeClock(), tmp_path) as h:
        again = await h.send("alice", Count(), thread=thread)
        assert text_of(again[-1], "value") == "5"


async def test_state_is_removed_when_the_conversation_is_collected_as_idle() -> None:
    async with harness(FakeClock()) as h:
        first = await h.send("alice", Count())
        thread = _thread(first)
        assert h.pump.collect_idle(0.0, now=1e12) >= 1
        await h.run_until_idle()
        assert thread not in h.pump.waits.book
        assert await h.kernel.handler_state() == []  # type: ignore[union-attr]


def test_meta_state_without_a_daemon_is_a_private_scratch_book() -> None:
    from agentd import HandlerMetadata

    meta = HandlerMetadata("t", "f", "me")
    meta.state.set("k", "v")
    assert meta.state.get("k") == "v"
    meta.state.delete("k")
    assert meta.state.get("k", "d") == "d"
    with pytest.raises(TypeError):
        meta.state.set("k", 1)  # type: ignore[arg-type]
