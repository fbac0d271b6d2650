"""Sweeps and checkpoints (mixed into `Kernel`): thread GC, idle context GC, the
outbox cap and retention, periodic or on demand (`sweep`), and the WAL checkpoint
once the writer has been idle `checkpoint_idle_s` (on PostgreSQL: the database's
size, read then). All of it runs in the writer process, from the kernel's writer
task, between batches; retention goes in chunks and yields to waiting commits.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentd.kernel._batching import Queued, fail
from agentd.kernel._errors import KernelUnavailable
from agentd.kernel._lifecycle import Phase
from agentd.kernel._transaction import TxContext

log = logging.getLogger("agentd.kernel")

_OPEN = Phase.OPEN


@dataclass(frozen=True)
class SweepReport:
    journal_deleted: int
    threads_deleted: int
    buffers_deleted: int
    outbox_deleted: int = 0


class KernelSweeps:
    """What the kernel does while nothing is waiting to be written."""

    # Set by Kernel.__init__ (and `_queue` by KernelBatching).
    _loop: asyncio.AbstractEventLoop
    _phase: Phase
    _wake: asyncio.Event
    _clock: Callable[[], float]
    _ctx: TxContext
    _queue: deque[Queued]
    _sweep_waiters: list[asyncio.Future[SweepReport]]
    _retention_backlog: bool
    _next_sweep: float
    _sweep_interval: float
    _context_ttl: float
    _sweep_chunk: int
    _max_outbox: int
    _dirty: bool
    _last_write: float
    _db_bytes: int
    dsn: str | None
    _call: Callable[..., asyncio.Future[Any]]  # Kernel's: a call into the writer process

    async def sweep(self) -> SweepReport:
        """Run retention, thread GC and idle context GC now (normally periodic)."""
        if self._phase is not _OPEN:
            raise KernelUnavailable("kernel is closed")
        waiter: asyncio.Future[SweepReport] = self._loop.create_future()
        self._sweep_waiters.append(waiter)
        self._wake.set()
        return await waiter

    async def checkpoint(self) -> tuple[int, int, int]:
        """`PRAGMA wal_checkpoint(TRUNCATE)` now (normally done when idle)."""
        return await self._call("checkpoint", "TRUNCATE")

    async def _idle_checkpoint(self) -> None:
        try:
            if self.dsn:
                self._db_bytes = await self._call("size_bytes")
            busy, _, _ = await self._call("checkpoint", "TRUNCATE")
        except Exception as exc:
            log.warning("kernel: WAL checkpoint failed: %s", exc)
            busy = 1
        if busy:  # a reader held it; try again after the next idle period
            self._last_write = self._loop.time()
        else:
            self._dirty = False

    async def _sweep(self) -> None:
        """Thread GC, idle context GC, then retention in chunks of `sweep_chunk` rows
        (when not forced, stops between chunks if transactions are waiting)."""
        forced, self._sweep_waiters = self._sweep_waiters, []
        now = self._clock()
        journal_deleted = threads_deleted = buffers_deleted = outbox_deleted = 0
        try:
            if not self._retention_backlog or forced:
                cutoff = now - self._context_ttl
                idle = self._ctx.idle_buffers(cutoff)
                threads_deleted, buffers_deleted = await self._call("gc", cutoff, idle)
                outbox_deleted = await self._call("cap_outboxes", self._max_outbox)
                if outbox_deleted:
                    log.warning("kernel: %d outbox frames of long-absent clients dropped "
                                "(more than %d waiting for one client)", outbox_deleted,
                                self._max_outbox)
            self._retention_backlog = False
            while True:
                deleted, more = await self._call("sweep_retention", now, self._sweep_chunk)
                journal_deleted += deleted
                if not more:
                    break
                if not forced and self._queue:
                    self._retention_backlog = True
                    break
        except Exception as exc:
            log.warning("kernel: sweep failed: %s", exc)
            for waiter in forced:
                fail(waiter, KernelUnavailable(f"sweep failed: {exc}"))
            self._next_sweep = self._loop.time() + self._sweep_interval
            return
        if journal_deleted or threads_deleted or buffers_deleted:
            self._dirty = True
            log.info("kernel sweep: %d journal entries, %d threads, %d context buffers deleted",
                     journal_deleted, threads_deleted, buffers_deleted)
        self._next_sweep = self._loop.time() + self._sweep_interval
        report = SweepReport(journal_deleted, threads_deleted, buffers_deleted, outbox_deleted)
        for waiter in forced:
            if not waiter.done():
                waiter.set_result(report)
