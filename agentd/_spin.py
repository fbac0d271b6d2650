"""Spinning briefly instead of sleeping, where a reply is due within microseconds.

On this kind of virtual machine, waking a process that sleeps costs 50-100 us on
each side of a pipe, about as much as the request itself. Both ends poll for a
moment instead:

- the child processes that serve the daemon one request at a time (the kernel's
  writer, isolation workers) poll their pipe before a blocking read
  (`wait_readable`), so a request that follows the last answer closely is read
  without the child first going to sleep;
- the daemon's event loop, once it has sent such a child a request, keeps polling
  its descriptors without a timeout for a moment (`LoopSpin`) instead of sleeping
  in the poller until the reply wakes it.

Both are bounded: at most `SPIN_S` of CPU per request, nothing while idle. Both
give the CPU away between polls (`sched_yield`): when more processes want to run
than there are cores, the one whose reply is awaited may be waiting for this core.
On an idle machine the yield returns at once.
Standard library only: the children import this early.
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from typing import Any

SPIN_S = 0.0002

_clock = time.perf_counter
_yield = os.sched_yield


def wait_readable(poller: select.poll, spin_s: float = SPIN_S) -> None:
    """Poll for up to `spin_s` before the caller's blocking read. Bounded: at most
    `spin_s` of CPU per call, nothing while idle."""
    deadline = _clock() + spin_s
    while _clock() < deadline:
        if poller.poll(0):
            return
        _yield()


class LoopSpin:
    """Keeps an event loop polling while a child's reply to one request is due.

    `until(fut)` schedules a callback (on `fut`'s loop) that schedules itself again
    until `fut` is done or `spin_s` has passed: while a callback is ready the loop
    polls its descriptors with a zero timeout (asyncio and uvloop alike), so the
    reply is read the moment it arrives instead of after the loop's process is
    woken. A busy loop pays one callback per iteration; an idle one at most `spin_s`
    of CPU per request. One chain at a time per instance: a later request takes it
    over."""

    __slots__ = ("_deadline", "_fut", "_spin_s")

    def __init__(self, spin_s: float = SPIN_S) -> None:
        self._spin_s = spin_s
        self._fut: asyncio.Future[Any] | None = None  # the reply awaited while spinning
        self._deadline = 0.0

    @property
    def spinning(self) -> bool:
        return self._fut is not None

    def until(self, fut: asyncio.Future[Any]) -> None:
        idle = self._fut is None
        self._fut = fut
        self._deadline = _clock() + self._spin_s
        if idle:
            fut.get_loop().call_soon(self._tick)

    def _tick(self) -> None:
        fut = self._fut
        assert fut is not None
        if fut.done() or _clock() >= self._deadline:
            self._fut = None
            return
        _yield()
        fut.get_loop().call_soon(self._tick)
