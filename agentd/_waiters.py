"""WaiterQueue: tasks parked until something frees up, woken first come, first served.

Used wherever the pump or routing parks a task: idle workers waiting for work, client
ingress waiting for room, callers of a busy listener waiting for a slot, and "run
until idle"; through `TurnQueue`, callers of an isolated listener waiting for a
worker. It is a deque of futures rather than an `asyncio.Condition` or `Semaphore`:
the uncontended path (nobody waiting) is a plain truth test in C, and a wake-up is
one `set_result`, with no lock to acquire and no task step of its own.

Invariants: a waiter is woken at most once; a waiter that was cancelled while parked
is skipped, so a wake-up is never lost on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class WaiterQueue(deque["asyncio.Future[None]"]):
    """Parked futures, oldest first. True while anyone is parked (possibly a
    cancelled waiter not yet skipped: a wake-up then finds nobody, which is harmless)."""

    __slots__ = ()

    def park(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future to await until woken; the caller checks its condition again then."""
        fut = loop.create_future()
        self.append(fut)
        return fut

    def wake_one(self) -> bool:
        """Wake the oldest waiter still waiting; False if there was none."""
        while self:
            fut = self.popleft()
            if not fut.done():
                fut.set_result(None)
                return True
        return False

    def wake_all(self) -> None:
        while self.wake_one():
            pass


class TurnQueue:
    """Callers waiting in turn for room (an isolated listener's workers): a caller
    woken but not yet run keeps its turn, so one arriving meanwhile goes behind
    it (`behind`); without that, the woken caller could find its room taken and
    wait again, for ever under load. A woken caller cancelled before it ran hands
    its turn to the next."""

    __slots__ = ("_waiters", "_woken")

    def __init__(self) -> None:
        self._waiters = WaiterQueue()
        self._woken = 0  # woken by `wake`, not run yet

    def __len__(self) -> int:
        return len(self._waiters)

    @property
    def behind(self) -> bool:
        """Whether a caller arriving now must wait behind others."""
        return bool(self._waiters) or self._woken > 0

    async def wait(self) -> None:
        """Until woken (`wake`) or failed (`fail`); the caller checks for room again."""
        waiter = self._waiters.park(asyncio.get_running_loop())
        try:
            await waiter  # `wake` takes it out of the queue
        except BaseException:
            if waiter.cancelled():  # still queued: O(n), but only on cancellation
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            elif waiter.exception() is None:
                self._woken -= 1
                self.wake()  # woken, then cancelled: the room is the next caller's
            raise
        self._woken -= 1

    def wake(self) -> None:
        """Wake the oldest caller still waiting, if any."""
        if self._waiters.wake_one():
            self._woken += 1

    def fail(self, exc: BaseException) -> None:
        """Every waiting caller raises `exc` (the room is gone for good)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(exc)
