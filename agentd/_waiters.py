"""WaiterQueue: tasks parked until something frees up, woken first come, first served.

Used wherever the pump or routing parks a task: idle workers waiting for work, client
ingress waiting for room, callers of a busy listener waiting for a slot, and "run
until idle". It is a deque of futures rather than an `asyncio.Condition` or
`Semaphore`: the uncontended path (nobody waiting) is a plain truth test in C, and a
wake-up is one `set_result`, with no lock to acquire and no task step of its own.

Invariants: a waiter is woken at most once; a waiter that was cancelled while parked
is skipped, so a wake-up is never lost on it.
"""

from __future__ import annotations

import asyncio
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
