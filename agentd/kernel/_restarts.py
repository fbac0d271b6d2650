"""When the writer process dies or the lease is lost (mixed into `Kernel`).

A writer that died (killed, out of memory) is noticed at once (`_writer_died`: the
kernel is unhealthy) and replaced by the writer task's health probe; the batches it
never answered are settled from what its successor reads on disk
(`_settle_orphans`): nothing is written twice, nothing acknowledged is lost. On the
postgres backend a lease is renewed every interval; a lost one stops all writing
for good (`_lose_lease`), and while a current one is held a writer that cannot be
replaced yet is tried again with what is queued kept (`_holding_on`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentd.kernel._batching import Queued, fail
from agentd.kernel._errors import KernelUnavailable, LeaseLost, TransactionRejected
from agentd.kernel._health import HealthEvent, WriteHealth
from agentd.kernel._lifecycle import Phase
from agentd.kernel._lock import StateDirLock
from agentd.kernel._transaction import TxContext
from agentd.kernel._writer import WriterProcess

log = logging.getLogger("agentd.kernel")

_OPEN = Phase.OPEN


class KernelRestarts:
    """The writer process's replacement, its orphans, and the lease."""

    # Set by Kernel.__init__ (and the queue's by KernelBatching).
    _loop: asyncio.AbstractEventLoop
    _phase: Phase
    _wake: asyncio.Event
    _ctx: TxContext
    _interval: float
    _queue: deque[Queued]
    _queued_ops: int
    _head_time: float
    _inflight: deque[asyncio.Task[None]]
    _orphans: list[tuple[int, list[Queued]]]
    _writer_proc: WriterProcess
    _lock: StateDirLock
    _health: WriteHealth
    _store_options: dict[str, Any]
    db_path: Path
    writer_restarts: int
    lease_lost: str | None
    lease_renewed: float
    _lease_interval: float
    _lease_timeout: float
    _lease_task: asyncio.Task[None] | None
    _lease_waiters: list[asyncio.Future[bool]]
    on_lease_lost: Callable[[str], None] | None
    # Kernel's: a call into the writer, health events, a batch's outcome.
    _call: Callable[..., asyncio.Future[Any]]
    _record: Callable[..., bool]
    _committed: Callable[[list[Queued], float, int], None]
    _storage_failed: Callable[[BaseException, list[Queued]], None]
    _fail_all: Callable[[KernelUnavailable], None]

    def _fail_orphans(self, exc: BaseException) -> None:
        """No writer can say what became of the orphans: fail them (not acknowledged;
        what committed of them is found again at the next start, like after a crash)."""
        orphans, self._orphans = self._orphans, []
        for _, batch in orphans:
            self._storage_failed(KernelUnavailable(f"kernel writer lost: {exc}"), batch)

    async def _probe(self) -> None:
        try:
            if not self._writer_proc.alive:
                await self._restart_writer()
            await self._call("probe")
        except Exception as exc:
            if isinstance(exc, LeaseLost):
                self._lose_lease(exc)
            self._record(HealthEvent.PROBE_FAILED, str(exc))
            if not self._holding_on(exc):
                self._fail_orphans(exc)
            return
        self._record(HealthEvent.PROBE_SUCCEEDED)
        log.warning("kernel: write probe succeeded after %.1f s; accepting",
                    self._loop.time() - self._health.since)

    def _holding_on(self, exc: BaseException) -> bool:
        """Whether what is queued and in flight waits for the next try to start a
        writer, rather than failing now: only for a lease holder (postgres) whose
        lease is current by its own clock. A server that ends the writer's session or
        refuses connections for a moment (a terminated backend, a restart) then loses
        no client's message; once the lease may be another daemon's they fail, and if
        another took over meanwhile the next writer's reclaim refuses them anyway."""
        return (self._lease_task is not None and self._phase is _OPEN
                and not isinstance(exc, LeaseLost) and not self.lease_expired)

    def _writer_died(self, message: str) -> None:
        """The writer process exited on its own: unhealthy now (not at the next
        failed commit), and the writer loop's health probe starts a new one."""
        if self._phase is not _OPEN:
            return
        self._record(HealthEvent.WRITER_EXITED, message)
        self._wake.set()

    async def _restart_writer(self) -> None:
        """The writer process died (killed, out of memory): start another, which reads
        the chain head back from the database, then settle the batches the dead one
        never answered (`_settle_orphans`)."""
        if self.lease_lost is not None:  # never another writer: see _lose_lease
            raise LeaseLost(self.lease_lost)
        old = self._writer_proc
        started = self._loop.time()
        with contextlib.suppress(Exception):
            await old.stop()
        while self._inflight:  # answered by now (the dead writer failed every call)
            await self._inflight.popleft()
        self._writer_proc, _ = await start_writer(self.db_path, self._lock,
                                                   self._store_options)
        self._writer_proc.on_exit = self._writer_died
        self.writer_restarts += 1
        if self._lease_task is not None:  # it reclaimed this daemon's epoch
            self._lease_kept(started)
        log.warning("kernel: writer process %d replaced by %d", old.pid,
                    self._writer_proc.pid)
        await self._settle_orphans()

    async def _settle_orphans(self) -> None:
        """Resolve each transaction of the batches a dead writer never answered, from
        what its successor reads on disk: committed (acknowledged now), rejected
        (failed alone), or never written (queued again, ahead of everything queued
        since, so commits keep their order). Nothing is written twice and nothing
        acknowledged is lost: a message whose handler's answer was in flight when the
        writer died is answered once the new writer has committed it."""
        if not self._orphans:
            return
        orphans = sorted(self._orphans, key=lambda orphan: orphan[0])
        last, rejected_txns = await self._call("outcomes", orphans[0][0])
        self._orphans = []
        rejected = set(rejected_txns)
        committed: list[Queued] = []
        again: list[Queued] = []
        refused = 0
        for first, batch in orphans:
            for txn, (tx, fut) in enumerate(batch, first):
                if txn > last:
                    again.append((tx, fut))
                elif txn in rejected:
                    refused += 1
                    self._ctx.release(tx.ops)
                    fail(fut, TransactionRejected("transaction rejected by the database"))
                else:
                    committed.append((tx, fut))
        self._committed(committed, 0.0, 0)
        self._queue.extendleft(reversed(again))
        self._queued_ops += sum(len(tx.rows) + len(tx.ops) for tx, _ in again)
        if again:
            self._head_time = self._loop.time() - self._interval  # overdue: send at once
            self._wake.set()
        log.warning("kernel: transactions in flight when the writer died: %d had "
                    "committed, %d were rejected, %d are sent again", len(committed),
                    refused, len(again))

    async def _renew_lease(self) -> None:
        """Renew the lease every interval (the fence, alone); a refusal loses it. A
        writer that died meanwhile is replaced by the health probe, which reclaims
        the lease only if nobody took it over."""
        while self.lease_lost is None:
            await asyncio.sleep(self._lease_interval)
            if not self._writer_proc.alive:
                continue
            sent = self._loop.time()
            try:
                renewal = self._call("renew")
                left = self.lease_renewed + self._lease_timeout - self._loop.time()
                done, _ = await asyncio.wait({renewal}, timeout=max(left, 0.0))
                if not done:  # stuck (a cut network, a stopped writer): say so once
                    log.warning("kernel: the lease was not renewed for %.1f s by this "
                                "daemon's clock (a standby may take over); no handler "
                                "starts until it is", self._loop.time() - self.lease_renewed)
                await renewal
            except LeaseLost as exc:
                self._lose_lease(exc)
                return
            except Exception:  # the writer died: the probe's restart decides
                continue
            self._lease_kept(sent)

    @property
    def lease_expired(self) -> bool:
        """By this daemon's own clock, a standby may have taken the lease over: no
        renewal sent in the last `LEASE_MISSED_RENEWALS` intervals succeeded (the
        writer is stuck on a cut network, the daemon was paused, the server
        restarts). Always False without a lease (SQLite)."""
        return self._lease_task is not None and (
            self.lease_lost is not None
            or self._loop.time() - self.lease_renewed >= self._lease_timeout)

    async def lease_current(self) -> bool:
        """True at once if the lease is not `lease_expired`; else wait until a renewal
        succeeds (True) or the lease is lost (False). The pump starts no handler
        while the lease may be another daemon's."""
        if not self.lease_expired:
            return True
        if self.lease_lost is not None:
            return False
        if not self._lease_waiters:
            log.warning("kernel: a handler waits for the lease to be renewed")
        waiter: asyncio.Future[bool] = self._loop.create_future()
        self._lease_waiters.append(waiter)
        return await waiter

    def _lease_kept(self, sent: float) -> None:
        """A renewal (or a reclaim by a new writer) sent at `sent` succeeded: the
        server stamped it later, so the lease lasts at least a timeout from `sent`."""
        self.lease_renewed = max(self.lease_renewed, sent)
        waiters, self._lease_waiters = self._lease_waiters, []
        if waiters:
            log.warning("kernel: lease renewed; handlers start again")
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(True)

    def _lose_lease(self, exc: BaseException) -> None:
        """Another daemon may be the writer now: this kernel writes nothing more.
        Its writer is killed (no batch in flight can commit: the fence refuses it
        anyway), everything queued fails unacknowledged, and `on_lease_lost` tells the
        daemon, which stops serving and exits non-zero."""
        if self.lease_lost is not None:
            return
        self.lease_lost = str(exc)
        log.error("kernel: %s; this daemon writes nothing more", exc)
        self._loop.create_task(self._writer_proc.kill())
        self._fail_all(LeaseLost(self.lease_lost))
        waiters, self._lease_waiters = self._lease_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(False)
        if self.on_lease_lost is not None:
            try:
                self.on_lease_lost(self.lease_lost)
            except Exception:
                log.exception("kernel: on_lease_lost hook failed")


async def start_writer(db: Path, lock: StateDirLock, store_options: dict[str, Any]
                        ) -> tuple[WriterProcess, tuple[int, int, int, int, dict,
                                                        tuple[int, float]]]:
    """Start a writer process and open the store in it: (writer, (seq, outbox_id, txn,
    migrated_from, context_counts, (lease epoch, since))). Stops the process again if
    the open fails."""
    writer = await WriterProcess.start(lock.fd)
    try:
        info = await writer.call("open", str(db), store_options)
    except BaseException:
        with contextlib.suppress(Exception):
            await writer.stop()
        raise
    return writer, info
