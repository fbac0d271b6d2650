"""The scheduler and its waiter queue, without a pump: per-frame order, round-robin
fairness between frames, backpressure, run until idle."""

from __future__ import annotations

import asyncio

from agentd._routing import Profile, build_table
from agentd._threads import Frame, new_uuid
from agentd._waiters import TurnQueue, WaiterQueue
from agentd.pump.message import Message, MsgKind
from agentd.pump.scheduler import Scheduler

PROFILE = Profile("p", build_table(1, []))


def frame() -> Frame:
    return Frame(new_uuid(), ("alice",), None, "alice", PROFILE)


def message(f: Frame, n: int) -> Message:
    return Message(MsgKind.REQUEST, "alice", f, None, (), None, str(n).encode())  # type: ignore[arg-type]


async def test_waiters_are_woken_oldest_first_and_once() -> None:
    loop = asyncio.get_running_loop()
    q = WaiterQueue()
    first, second = q.park(loop), q.park(loop)
    assert q.wake_one() and first.done() and not second.done()
    assert q.wake_one() and second.done()
    assert not q.wake_one() and not q


async def test_a_cancelled_waiter_does_not_swallow_a_wake_up() -> None:
    loop = asyncio.get_running_loop()
    q = WaiterQueue()
    gone, waiting = q.park(loop), q.park(loop)
    gone.cancel()
    assert q.wake_one() and waiting.done() and waiting.result() is None


async def test_a_woken_caller_keeps_its_turn_and_a_cancelled_one_hands_it_on() -> None:
    line = TurnQueue()
    assert not line.behind
    first = asyncio.ensure_future(line.wait())
    second = asyncio.ensure_future(line.wait())
    while len(line) < 2:
        await asyncio.sleep(0)
    line.wake()  # `first` woken, not run yet: a newcomer still goes behind
    assert line.behind and len(line) == 1
    first.cancel()  # cancelled before it ran: its turn goes to `second`
    await asyncio.gather(first, return_exceptions=True)
    await second
    assert not line.behind and not len(line)


async def test_a_failed_turn_queue_raises_in_every_waiting_caller() -> None:
    line = TurnQueue()
    waiting = [asyncio.ensure_future(line.wait()) for _ in range(2)]
    while len(line) < 2:
        await asyncio.sleep(0)
    line.fail(RuntimeError("stopped"))
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert [str(r) for r in results] == ["stopped", "stopped"]


async def test_wake_all_releases_everyone() -> None:
    loop = asyncio.get_running_loop()
    q = WaiterQueue()
    parked = [q.park(loop) for _ in range(3)]
    q.wake_all()
    assert all(f.done() for f in parked) and not q


async def test_one_frame_is_handled_in_order_one_at_a_time() -> None:
    handled: list[bytes] = []
    running = 0
    gate = asyncio.Event()

    async def handle(msg: Message) -> None:
        nonlocal running
        running += 1
        assert running == 1  # never two messages of one frame at once
        await gate.wait()
        handled.append(msg.envelope)
        running -= 1

    s = Scheduler(handle, workers=4, max_queue=100)
    f = frame()
    for n in range(5):
        s.put(message(f, n))
    s.start()
    gate.set()
    await s.join()
    await s.stop()
    assert handled == [b"0", b"1", b"2", b"3", b"4"]
    assert s.queued == 0 and s.running == 0 and not s.has_inbox(f.uuid)


def call(f: Frame, n: int) -> Message:
    """A call the holder of `f` (a frame below the conversation's root) sent."""
    return Message(MsgKind.REQUEST, "agent", f, None, (), None, str(n).encode())  # type: ignore[arg-type]


def for_holder(f: Frame, n: int) -> Message:
    return Message(MsgKind.TO_HOLDER, "tool", f, None, (), None, str(n).encode())  # type: ignore[arg-type]


async def test_a_handlers_calls_run_at_once_and_its_holders_messages_one_at_a_time() -> None:
    """The calls one handler sent start in order and run at once (each runs its
    callee in a frame of its own); the messages for that frame's holder, queued
    behind them, still run one at a time and in order. Before, the three calls ran
    one after the other, and the first waited for the others forever."""
    calls: list[bytes] = []
    holder: list[bytes] = []
    handled: list[bytes] = []
    all_calls = asyncio.Event()

    async def handle(msg: Message) -> None:
        if msg.kind is MsgKind.REQUEST:
            calls.append(msg.envelope)
            if len(calls) == 3:
                all_calls.set()
            await all_calls.wait()  # only if the three run at once
        else:
            holder.append(msg.envelope)
            assert len(holder) == 1  # never two of the holder's messages at once
            await all_calls.wait()
            holder.remove(msg.envelope)
        handled.append(msg.envelope)

    s = Scheduler(handle, workers=8, max_queue=100)
    agent = Frame(new_uuid(), ("alice", "agent"), frame(), "alice", PROFILE)
    for n in range(3):
        s.put(call(agent, n))
    for n in (5, 6, 7):
        s.put(for_holder(agent, n))
    s.start()
    async with asyncio.timeout(10):
        await s.join()
    await s.stop()
    assert calls == [b"0", b"1", b"2"]
    assert [m for m in handled if m >= b"5"] == [b"5", b"6", b"7"]
    assert s.queued == 0 and s.running == 0 and not s.has_inbox(agent.uuid)


async def test_frames_take_turns_so_a_busy_one_cannot_starve_the_others() -> None:
    order: list[str] = []

    async def handle(msg: Message) -> None:
        order.append(msg.envelope.decode())

    s = Scheduler(handle, workers=1, max_queue=100)
    busy, quiet = frame(), frame()
    for n in range(3):
        s.put(message(busy, n))
    s.put(message(quiet, 9))
    s.start()
    await s.join()
    await s.stop()
    assert order == ["0", "9", "1", "2"]


async def test_ingress_waits_for_room_and_is_woken_when_a_message_is_taken() -> None:
    async def handle(msg: Message) -> None:
        return None

    s = Scheduler(handle, workers=1, max_queue=2)
    f = frame()
    s.put(message(f, 0))
    s.put(message(f, 1))
    waiting = asyncio.ensure_future(s.wait_for_room(asyncio.get_running_loop()))
    await asyncio.sleep(0)  # one loop turn: it parks (nothing is running to free room)
    assert not waiting.done() and s.room_waiters
    s.start()
    await waiting
    assert s.queued < s.max_queue
    await s.join()
    await s.stop()


async def test_a_failing_handle_does_not_kill_the_worker() -> None:
    seen: list[bytes] = []

    async def handle(msg: Message) -> None:
        seen.append(msg.envelope)
        if msg.envelope == b"0":
            raise RuntimeError("pump bug")

    s = Scheduler(handle, workers=1, max_queue=10)
    s.put(message(frame(), 0))
    s.put(message(frame(), 1))
    s.start()
    await s.join()
    await s.stop()
    assert seen == [b"0", b"1"]
