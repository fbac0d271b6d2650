"""The kernel: the one writer of durable state.

Everything durable (threads, journal, outboxes, context buffers, audit events) is
written here, by one writer process holding one SQLite connection in WAL mode, in a
state directory held by an exclusive lock. Callers build a `Transaction` (no I/O),
`commit` it and, when they must not acknowledge anything before it is durable, await
the returned future.

Invariants:
- Transactions commit in submission order; a batch is one SQLite transaction; a
  transaction is all-or-nothing, and a bad one is retried alone so it cannot take
  the others of its batch down with it.
- A future resolves successfully only after COMMIT returned; on failure nothing of
  that transaction is in the database.
- The journal is append-only: rows are never updated; retention deletes whole rows
  and leaves a verifiable gap record (see _chain).
- While writes fail, `healthy` is False (the state machine of _health); the writer
  retries with backoff (probing the disk when nothing is queued) and reports
  recovery.
- Open, closing, closed: the state machine of _lifecycle. Once closing, nothing new
  is accepted and everything already submitted is still committed.

How queued transactions become batches, the two-batch pipeline and folds live in
_batching; sweeps and checkpoints in _sweeps; replacing a dead writer, settling
what it never answered and the lease in _restarts; the reads in _reads (all mixed
in). This module keeps the lifecycle, the writer task's loop and health; what runs
without a kernel (verify-journal, the PostgreSQL checks) is in _offline.

Why the writer is a child process (`_writer.WriterProcess`) running the stdlib sqlite3
module, not aiosqlite on a thread: aiosqlite hops to its thread and back once per call
and a batch is ~5 calls (10-entry batches cost 478 us with aiosqlite, 202 us in one
hop); and any writer thread shares the GIL with the event loop, which sqlite3 and lxml
both release so often that each side keeps waiting for the other (see _writer's
docstring: 6.7x slower writes). One message per batch crosses to the process; the
chain hashing and statement planning run there too, on the other core. Reads use
aiosqlite on a second, read-only connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiosqlite

from agentd.kernel._batching import KernelBatching, fail
from agentd.kernel._errors import (
    KernelUnavailable,
    LeaseLost,
)
from agentd.kernel._health import BACKOFF_START_S, Health, HealthEvent, WriteHealth
from agentd.kernel._lifecycle import Phase, PhaseEvent, next_phase
from agentd.kernel._lock import StateDirLock
from agentd.kernel._offline import DB_NAME
from agentd.kernel._options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from agentd.kernel._reads import KernelReads
from agentd.kernel._restarts import KernelRestarts, start_writer
from agentd.kernel._schema import code_version
from agentd.kernel._store import (
    readonly_uri,
)
from agentd.kernel._sweeps import KernelSweeps, SweepReport
from agentd.kernel._transaction import OnCommit, Transaction, TxContext
from agentd.kernel._writer import WriterProcess

# postgres: a lease holder whose renewals stop for this many intervals loses it.
LEASE_MISSED_RENEWALS = 3

log = logging.getLogger("agentd.kernel")

# Module constants: read for every transaction and batch.
_HEALTHY = Health.HEALTHY
_OPEN = Phase.OPEN



class Kernel(KernelReads, KernelBatching, KernelSweeps, KernelRestarts):
    """Use `await Kernel.open(state_dir)`; `async with` closes it."""

    def __init__(self, *, state_dir: Path, lock: StateDirLock, writer: WriterProcess,
                 store_options: dict[str, Any], reader: Any, ctx: TxContext,
                 commit_interval_s: float, commit_max_entries: int, sweep_interval_s: float,
                 context_ttl_s: float, checkpoint_idle_s: float, sweep_chunk: int,
                 on_commit: OnCommit | None, max_outbox_per_client: int = 10_000,
                 last_txn: int = 0, lease: tuple[int, float] = (0, 0.0),
                 lease_interval_s: float = 1.0) -> None:
        self._max_outbox = max_outbox_per_client
        self._clock = ctx.clock  # wall clock: stamps, retention and TTL cutoffs
        self.state_dir = state_dir
        self.db_path = state_dir / DB_NAME
        self._lock = lock
        self._writer_proc = writer
        writer.on_exit = self._writer_died
        self._store_options = store_options
        self.dsn: str | None = store_options.get("dsn")  # the postgres backend's
        self._db_bytes = 0  # on PostgreSQL: its size when last idle (`_idle_checkpoint`)
        self._reader = reader
        self._ctx = ctx
        self._interval = commit_interval_s
        self._max_entries = max(1, commit_max_entries)
        self._sweep_interval = sweep_interval_s
        self._context_ttl = context_ttl_s
        self._checkpoint_idle = checkpoint_idle_s
        self._sweep_chunk = sweep_chunk
        self._on_commit = on_commit
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._phase = Phase.OPEN
        self._init_batching()
        self._next_txn = last_txn + 1  # numbers of the transactions sent (_write)
        self._closed = asyncio.Event()  # set when CLOSED: a second close() waits for it
        self._health = WriteHealth()
        self._recovered = asyncio.Event()  # set while healthy: see wait_healthy
        self._recovered.set()
        self._last_write = self._loop.time()
        self._dirty = False
        self._settled = asyncio.Event()  # idle with nothing left to write: wait_settled
        self._next_sweep = self._loop.time() + sweep_interval_s
        self._sweep_waiters: list[asyncio.Future[SweepReport]] = []
        self._retention_backlog = False
        self.writer_restarts = 0
        self._writer = asyncio.create_task(self._run(), name="agentd-kernel-writer")
        # The postgres lease (`KernelOptions.lease`): epoch and since as taken, who
        # holds it, when it was last renewed (event-loop clock) and, once lost, why.
        self.lease_epoch, self.lease_since = lease
        self.lease_holder: str = store_options.get("holder", "")
        self.lease_lost: str | None = None
        self.on_lease_lost: Callable[[str], None] | None = None  # the daemon stops
        # When the last renewal that succeeded was sent (event-loop clock; see
        # KernelRestarts.lease_expired), and the handlers waiting for the next one.
        self.lease_renewed = self._loop.time()
        self._lease_interval = lease_interval_s
        self._lease_timeout = LEASE_MISSED_RENEWALS * lease_interval_s
        self._lease_waiters: list[asyncio.Future[bool]] = []
        self._lease_task = (asyncio.create_task(self._renew_lease(), name="agentd-lease")
                            if store_options.get("lease") else None)

    # -- lifecycle ----------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        state_dir: Path | str,
        options: KernelOptions = DEFAULT_KERNEL_OPTIONS,
        *,
        on_commit: OnCommit | None = None,
        clock: Callable[[], float] = time.time,
        lock: StateDirLock | None = None,
        **changes: Any,
    ) -> Kernel:
        """Lock `state_dir`, open (create, migrate) its database, start the writer.

        `options` with `changes` applied (`Kernel.open(d, commit_max_entries=16)`);
        `on_commit(seconds, operations)` is called after every committed batch.
        Raises `StateLocked` if another kernel holds the directory, `SchemaTooNew` if
        the database is newer than this code. `clock` is the wall clock (seconds) for
        journal stamps, retention expiry and the context and thread TTLs (tests pass a
        fake one); the writer loop's timers (batching, backoff, idle checkpoints) use
        the event loop's clock. `lock`: the state directory's, already taken (a
        standby daemon holds it while it waits for the lease); released on failure."""
        o = replace(options, **changes) if changes else options
        state_dir = Path(state_dir)
        if lock is None:
            # In a thread: it may wait (up to 10 s) for the writer of a dead holder.
            lock = await asyncio.to_thread(StateDirLock.acquire, state_dir)
        db = state_dir / DB_NAME
        store_options: dict[str, Any] = {"synchronous": o.synchronous,
                                         "max_db_bytes": o.max_db_bytes, "dsn": o.dsn}
        if o.dsn and o.lease:
            store_options.update(lease=o.lease, standby=o.standby,
                                 holder=f"{socket.gethostname()} pid {os.getpid()}",
                                 lease_timeout_s=LEASE_MISSED_RENEWALS * o.lease_interval_s)
        writer: WriterProcess | None = None
        try:
            writer, (seq, outbox_id, last_txn, migrated_from, counts, lease
                     ) = await start_writer(db, lock, store_options)
            if store_options.get("lease"):  # a new writer reclaims this epoch or stops
                store_options.update(epoch=lease[0], standby=False)
            if migrated_from != code_version():
                log.info("kernel database %s migrated from schema %d to %d", db,
                         migrated_from, code_version())
            reader: Any
            if o.dsn:
                from agentd.kernel._postgres import PgReader  # psycopg: an optional extra
                reader = PgReader(o.dsn)
            else:
                reader = await aiosqlite.connect(readonly_uri(db), uri=True)
                await reader.execute("PRAGMA query_only=1")
        except BaseException:
            if writer is not None:
                with contextlib.suppress(Exception):
                    await writer.stop()
            lock.release()
            raise
        ctx = TxContext(next_seq=seq + 1, next_outbox_id=outbox_id + 1,
                        retention=o.retention, audit_retention=o.audit_retention,
                        max_slots_per_thread=o.max_slots_per_thread, max_threads=o.max_threads,
                        context_counts=counts, full_sync_profiles=o.full_sync_profiles,
                        clock=clock)
        return cls(state_dir=state_dir, lock=lock, writer=writer,
                   store_options=store_options, reader=reader, ctx=ctx,
                   commit_interval_s=o.commit_interval_s,
                   commit_max_entries=o.commit_max_entries,
                   sweep_interval_s=o.sweep_interval_s,
                   context_ttl_s=o.context_ttl_hours * 3600.0,
                   checkpoint_idle_s=o.checkpoint_idle_s, sweep_chunk=o.sweep_chunk,
                   max_outbox_per_client=o.max_outbox_per_client,
                   on_commit=on_commit, last_txn=last_txn, lease=lease,
                   lease_interval_s=o.lease_interval_s)

    async def close(self) -> None:
        """Commit everything submitted, checkpoint, release the lock. Idempotent."""
        if self._phase is not _OPEN:
            await self._closed.wait()  # another close() does the work; wait for its end
            return
        self._phase = next_phase(self._phase, PhaseEvent.CLOSE_REQUESTED)
        if self._lease_task is not None:
            self._lease_task.cancel()
        self._wake.set()
        try:
            await asyncio.shield(self._writer)
        finally:
            if not self._writer.done():  # close() itself was cancelled: stop the writer
                self._writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._writer
            # Only after a cancelled close: outcome unknown, so not acknowledged.
            self._fail_all(KernelUnavailable("kernel closed"))
            for task in self._inflight:
                task.cancel()
            for batch in self._writing:
                for _, fut in batch:
                    fail(fut, KernelUnavailable("kernel closed before the commit finished"))
            for waiter in self._sweep_waiters:
                fail(waiter, KernelUnavailable("kernel closed"))
            with contextlib.suppress(Exception):
                await self._reader.close()
            try:
                # queued behind any batch still being written; checkpoints, then exits
                await self._writer_proc.stop()
            finally:
                self._lock.release()
                self._phase = next_phase(self._phase, PhaseEvent.DRAINED)
                self._closed.set()

    async def __aenter__(self) -> Kernel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- writing ------------------------------------------------------------------------

    def transaction(self) -> Transaction:
        return Transaction(self._ctx)

    def commit(self, tx: Transaction) -> asyncio.Future[None]:
        """Queue `tx`; the future resolves when its batch is durably committed, or fails
        with `KernelUnavailable` (`TransactionRejected` if `tx` alone was bad). Raises
        `ContextLimitExceeded` at once if its context appends no longer fit."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._enqueue(tx, fut)
        return fut

    def commit_then(self, tx: Transaction, done: Callable[[BaseException | None], None]
                    ) -> None:
        """`commit`, for callers that need no future: `done(None)` runs once `tx` is
        committed, `done(exc)` if it failed (same exceptions as `commit`), from the
        kernel's own task. Cheaper on the hot path: no future, no scheduled callback."""
        self._enqueue(tx, _Then(done))

    async def flush(self) -> None:
        """Wait until everything submitted so far has been committed (or has failed).
        Raises `KernelUnavailable` if the storage is failing."""
        if self._phase is not _OPEN:
            return
        await self.commit(Transaction(self._ctx))
        if not self._health.healthy:
            raise KernelUnavailable(f"kernel writes are failing: {self._health.last_error}")

    async def set_max_db_bytes(self, max_bytes: int | None) -> int:
        """Cap the database size (writes beyond fail like a full disk); None: no cap."""
        max_bytes = await self._call("set_max_bytes", max_bytes)
        self._store_options["max_db_bytes"] = max_bytes
        return max_bytes

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    def health(self) -> Health:
        return self._health.state

    @property
    def last_error(self) -> str:
        return self._health.last_error

    async def wait_settled(self) -> None:
        """Return once the writer is idle with nothing left to do: everything
        submitted is committed, writes succeed and the WAL has been checkpointed
        (which happens `checkpoint_idle_s` after the last write)."""
        await self._settled.wait()

    async def wait_healthy(self) -> None:
        """Return once writes succeed (at once if they do now). The writer recovers by
        itself: this only waits for it."""
        await self._recovered.wait()

    @property
    def in_flight(self) -> int:
        """Transactions handed to the writer whose outcome is not known yet: it grows
        while a writer is stuck (a stalled disk, a stopped process) though none failed."""
        return sum(len(batch) for batch in self._writing)

    @property
    def writer_pid(self) -> int:
        """The pid of the writer process (see _writer.py)."""
        return self._writer_proc.pid

    @property
    def journal_seq(self) -> int:
        """The seq of the last journal entry submitted (committed once `flush` returns)."""
        return self._ctx.next_seq - 1

    @property
    def writer(self) -> WriterProcess:
        """The writer process's handle (its pid, `alive`, `kill()`): what an operator's
        `kill -9` or a crash does to it, a test does through this; the kernel replaces
        a writer that died (a new handle then)."""
        return self._writer_proc

    def db_size_bytes(self) -> int:
        if self.dsn:
            return self._db_bytes
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(OSError):
                total += os.stat(f"{self.db_path}{suffix}").st_size
        return total

    # -- the writer ---------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> asyncio.Future[Any]:
        """Run `method` in the writer process (in order with every other call)."""
        return self._writer_proc.call(method, *args)

    async def _run(self) -> None:
        while True:
            try:
                if not self._queue:
                    if self._inflight:
                        await self._inflight.popleft()
                        continue
                    if self._phase is not _OPEN:
                        return
                    await self._idle()
                    continue
                if not self._health.healthy and self._phase is _OPEN:
                    await self._pause(self._backoff())
                if not self._writer_proc.alive and self._phase is _OPEN:
                    try:
                        await self._restart_writer()
                    except Exception as exc:  # cannot start one: fail, do not hang
                        if self._holding_on(exc):  # a lease holder tries again soon
                            self._record(HealthEvent.WRITE_FAILED, str(exc))
                            log.info("kernel: no writer yet (%s); %d transactions wait",
                                     exc, len(self._queue))
                            continue
                        self._storage_failed(exc, self._take())
                        self._fail_orphans(exc)
                        continue
                if self._lone_client():
                    await self._send_folded()
                else:
                    await self._gather()
                    await self._writer_ready()
                    self._send(self._take())
                if self._sweep_waiters or self._retention_backlog or (
                        self._loop.time() >= self._next_sweep):
                    await self._sweep()
            except Exception:  # a bug: never leave callers hanging
                log.exception("kernel writer: unexpected error")
                self._fail_all(KernelUnavailable("kernel writer error"))
                await asyncio.sleep(BACKOFF_START_S)

    def _backoff(self) -> float:
        """The wait before the next retry while writes fail. A lease holder whose
        connection was lost (a PostgreSQL restart) tries at least four times a lease
        interval: it must reclaim its epoch before a standby may take over."""
        if self._lease_task is None:
            return self._health.backoff
        return min(self._health.backoff, self._lease_interval / 4)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but return early on close."""
        self._wake.clear()
        if self._phase is not _OPEN:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing_or_woken(), seconds)

    async def _closing_or_woken(self) -> None:
        while self._phase is _OPEN:
            self._wake.clear()
            await self._wake.wait()

    async def _idle(self) -> None:
        if not self._dirty and not self._sweep_waiters and self._health.state is _HEALTHY:
            self._settled.set()
        now = self._loop.time()
        if self._sweep_waiters:
            due = now
        elif not self._health.healthy:
            due = now + self._backoff()
        else:
            due = self._next_sweep
            if self._dirty:
                due = min(due, self._last_write + self._checkpoint_idle)
        if due > now:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), due - now)
                return  # woken: new work or close
            except TimeoutError:
                pass
        if self._queue or self._phase is not _OPEN:
            return
        if not self._health.healthy:
            await self._probe()
        elif self._sweep_waiters or self._loop.time() >= self._next_sweep:
            await self._sweep()
        elif self._dirty:
            await self._idle_checkpoint()

    def _committed(self, batch: list[tuple[Transaction, asyncio.Future[None]]],
                   seconds: float, ops: int) -> None:
        for _, fut in batch:
            if type(fut) is _Then:  # commit_then's: called here, no two calls through
                fut.call(None)
            elif not fut.done():
                fut.set_result(None)
        if not ops:  # nothing was written: no evidence about the storage either way
            return
        self._last_write = self._loop.time()
        self._dirty = True
        if self._health.state is not _HEALTHY:  # healthy: nothing to record
            self._record(HealthEvent.WRITE_SUCCEEDED)
            log.warning("kernel: writes succeed again after %.1f s; accepting",
                        self._loop.time() - self._health.since)
        if self._on_commit is not None:
            try:
                self._on_commit(seconds, ops)
            except Exception:
                log.exception("kernel: on_commit hook failed")

    def _storage_failed(self, exc: BaseException,
                        batch: list[tuple[Transaction, asyncio.Future[None]]]) -> None:
        if isinstance(exc, LeaseLost):
            self._lose_lease(exc)
        message = f"kernel writes are failing: {exc}"
        if self._record(HealthEvent.WRITE_FAILED, str(exc)):
            log.error("%s (%s); nothing is acknowledged until writes succeed again",
                      message, self.db_path)
        for tx, fut in batch:
            self._ctx.release(tx.ops)
            fail(fut, KernelUnavailable(message))

    def _fail_all(self, exc: KernelUnavailable) -> None:
        while self._queue:
            tx, fut = self._queue.popleft()
            self._ctx.release(tx.ops)
            fail(fut, exc)
        self._queued_ops = 0
        self._fail_orphans(exc)

    def _record(self, event: HealthEvent, error: str = "") -> bool:
        """Apply a health event; True if the state changed."""
        changed = self._health.record(event, self._loop.time(), error)
        if changed:
            if self._health.healthy:
                self._recovered.set()
            else:
                self._recovered.clear()
        return changed


class _Then:
    """Future-shaped holder of a `commit_then` callback: the kernel resolves it like
    the futures of `commit`, and it calls the callback at once."""

    __slots__ = ("_done", "_fn")

    def __init__(self, fn: Callable[[BaseException | None], None]) -> None:
        self._fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, _result: None) -> None:
        self.call(None)

    def set_exception(self, exc: BaseException) -> None:
        self.call(exc)

    def exception(self) -> None:
        return None

    def call(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._fn(exc)
        except Exception:
            log.exception("kernel: commit callback failed")

