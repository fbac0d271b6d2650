"""The daemon's one scheduler of deadlines: timers that fire and approvals that
expire are both woken here.

`DeadlineScheduler` owns one task and a heap of (due, kind, id). It sleeps until
the earliest due time (or until told of an earlier one), then hands everything due
to `fire` in one call, so a thousand timers due in the same second cost one batch.
The clock is injected (wall-clock seconds, since deadlines survive restarts);
tests move a fake clock and call `run_due()` instead of sleeping.

The decisions are pure functions: `take_due` (what is due now, soonest first,
skipping entries cancelled since they were scheduled) and `sleep_for` (how long to
wait). Invariant: an entry is handed to `fire` at most once per `schedule`.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable, Collection
from typing import NamedTuple

log = logging.getLogger("agentd.deadlines")

# How late a timer may fire and still be on time (later: its firing says `late`).
LATE_AFTER_S = 1.0
# Never sleep longer than this: a wall clock stepped forward is noticed within it.
MAX_SLEEP_S = 30.0


class Deadline(NamedTuple):
    due: float
    kind: str  # "timer" | "approval"
    id: str


def take_due(heap: list[Deadline], now: float, live: Collection[tuple[str, str]],
             limit: int = 10_000) -> list[Deadline]:
    """Pop the entries of `heap` due at `now` (soonest first, at most `limit`);
    entries whose (kind, id) is no longer in `live` were cancelled and are dropped."""
    due: list[Deadline] = []
    while heap and heap[0].due <= now and len(due) < limit:
        entry = heapq.heappop(heap)
        if (entry.kind, entry.id) in live:
            due.append(entry)
    return due


def sleep_for(heap: list[Deadline], now: float) -> float:
    """Seconds to wait before the next entry is due (bounded by MAX_SLEEP_S)."""
    if not heap:
        return MAX_SLEEP_S
    return min(MAX_SLEEP_S, max(0.0, heap[0].due - now))


def is_late(due: float, fired_at: float) -> bool:
    return fired_at - due > LATE_AFTER_S


FireFn = Callable[[list[Deadline], float], None]


class DeadlineScheduler:
    """Wakes `fire(entries, now)` for entries whose due time has come. `live` is the
    owner's set of (kind, id) still pending: cancelling is removing from it."""

    def __init__(self, fire: FireFn, live: Collection[tuple[str, str]],
                 clock: Callable[[], float] = time.time) -> None:
        self._fire = fire
        self._live = live
        self.clock = clock
        self._heap: list[Deadline] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def schedule(self, due: float, kind: str, ident: str) -> None:
        heap = self._heap
        earlier = not heap or due < heap[0].due
        heapq.heappush(heap, Deadline(due, kind, ident))
        if earlier and self._task is not None:
            self._wake.set()

    def run_due(self) -> int:
        """Fire everything due now; returns how many entries were fired."""
        now = self.clock()
        due = take_due(self._heap, now, self._live)
        if due:
            try:
                self._fire(due, now)
            except Exception:
                log.exception("deadlines: firing %d entries failed", len(due))
        return len(due)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="agentd-deadlines")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            self.run_due()
            delay = sleep_for(self._heap, self.clock())
            if delay <= 0:
                await asyncio.sleep(0)  # more were due than one round takes: let others run
                continue
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
