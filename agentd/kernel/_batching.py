"""How committed transactions reach the writer: the kernel's batching (mixed into
`Kernel`).

`commit` queues a transaction; the kernel's writer task takes what is queued as one
batch, hands it to the writer process (one message, one SQLite transaction) and
resolves each transaction's future once the writer has answered after its COMMIT.

- Group commit: with `commit_interval_s` > 0 a batch waits that long after its
  oldest transaction, or until `commit_max_entries` operations are queued. With 0
  (the default) it waits only while each loop turn adds transactions (a client's
  envelope, then its handler's answer in the next turn), at most `_FOLD_TURNS`.
- A pipeline of two: the next batch is sent while the writer still writes the
  previous one, but only if it is not small (a commit costs about the same whatever
  its size); under load transactions pile up while the writer works and batches
  form by themselves.
- When the writer is idle and much is waiting, half is sent now and the rest right
  behind it, so the callers of the first half build their next transactions while
  the second is written.
- Folds, for a lone client: its envelope is sent at once and its handler's answer,
  a few loop turns later, as the second part of the same SQLite transaction (see
  `_send_folded`).

A batch the writer could not take fails its callers with `KernelUnavailable`; a
transaction the database rejects fails alone (`TransactionRejected`); what the
kernel does with a commit or a storage failure (health, hooks) stays in `Kernel`.
A batch whose writer process died before answering is neither: it is an orphan,
kept until the next writer says what became of it (`Kernel._settle_orphans`). Every
transaction sent is numbered, in sending order, for that.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from agentd.kernel._errors import KernelUnavailable, TransactionRejected, WriterExited
from agentd.kernel._lifecycle import Phase
from agentd.kernel._store import is_storage_error
from agentd.kernel._transaction import Transaction, TxContext, wires_of
from agentd.kernel._writer import WriterProcess

log = logging.getLogger("agentd.kernel")

_OPEN = Phase.OPEN
_PIPELINE = 2  # batches sent to the writer and not yet answered
_FOLD_TURNS = 4  # loop turns a batch waits for while each adds transactions (_gather)
_FOLD_MAX_TXS = 2  # a fold starts from at most this many queued (a lone client's envelope)

Queued = tuple[Transaction, Any]  # a transaction and its future (or commit_then holder)
Sent = tuple[list[Queued], "asyncio.Future[tuple]", int]  # a batch, its reply, its first txn


class KernelBatching:
    """The queue of committed transactions, its batches and the writer pipeline."""

    # Set by Kernel.__init__.
    _loop: asyncio.AbstractEventLoop
    _ctx: TxContext
    _clock: Callable[[], float]
    _phase: Phase
    _wake: asyncio.Event
    _settled: asyncio.Event
    _interval: float
    _max_entries: int
    _writer_proc: WriterProcess
    _next_txn: int  # the number the next transaction sent gets (see `_write`)
    # Kernel's: a batch committed (resolve, record health, hooks) or failed.
    _committed: Callable[[list[Queued], float, int], None]
    _storage_failed: Callable[[BaseException, list[Queued]], None]

    def _init_batching(self) -> None:
        self._queue: deque[Queued] = deque()
        self._writing: list[list[Queued]] = []  # sent, outcome not yet known
        # Batches sent to a writer that died before answering, with the number of their
        # first transaction: settled when the next writer has started.
        self._orphans: list[tuple[int, list[Queued]]] = []
        self._inflight: deque[asyncio.Task[None]] = deque()  # one task a batch (or fold)
        # A lone client: send its batch in two parts (see _send_folded). Benchmarks set it
        # False to measure the kernel without.
        self.fold = True
        self._queued_ops = 0
        self._last_batch_ops = 0
        self._saturated_ops = max(2, self._max_entries // 8)
        self._head_time = 0.0

    def _enqueue(self, tx: Transaction, fut: Any) -> None:
        if self._phase is not _OPEN:
            raise KernelUnavailable("kernel is closed")
        if tx.committed:
            raise RuntimeError("transaction already committed")
        if tx.touches_context:
            self._ctx.reserve(tx.ops, self._clock())
        tx.committed = True  # sealed: no more changes (Transaction._check_open)
        queue = self._queue
        if not queue:
            self._head_time = self._loop.time()
            self._wake.set()
            self._settled.clear()
        queue.append((tx, fut))
        self._queued_ops += len(tx.rows) + len(tx.ops)
        if self._queued_ops >= self._saturated_ops:  # see _writer_ready
            self._wake.set()

    def _lone_client(self) -> bool:
        """Whether to send what is queued as a fold (see `_send_folded`): folds on, no
        batching interval, the writer idle, at most two transactions queued after a
        small batch, and among them a message a handler is about to take."""
        return (self.fold and self._interval <= 0 and not self._in_flight()
                and self._phase is _OPEN and len(self._queue) <= _FOLD_MAX_TXS
                and self._last_batch_ops < self._saturated_ops
                and any(tx.has_pending for tx, _ in self._queue))

    async def _gather(self) -> None:
        """Wait for the batch window: commit_interval_s after the oldest queued tx, or
        until commit_max_entries operations are queued. Skipped while the writer is
        saturated (the previous batch was big): then transactions pile up while it
        writes, batching is natural, and waiting would only leave both the event loop
        and the writer idle (the GIL lets them overlap little)."""
        if self._interval <= 0 or self._last_batch_ops >= self._saturated_ops:
            # Yield while each loop turn adds transactions (at most _FOLD_TURNS): what
            # the turn already scheduled joins the batch. A client's envelope is
            # queued, then its handler runs in the next turn and queues the answer; a
            # delegation chain (relay -> tool -> relay) adds one transaction a turn.
            # Without this each step would commit after the previous one, and a lone
            # client would wait for every commit in turn instead of one.
            queue = self._queue
            for _ in range(_FOLD_TURNS):
                if self._inflight or self._phase is not _OPEN:
                    break
                seen = len(queue)
                await asyncio.sleep(0)
                if len(queue) == seen:
                    break
            return
        loop = self._loop
        delay = self._head_time + self._interval - loop.time()
        while delay > 0 and self._queued_ops < self._max_entries and self._phase is _OPEN:
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except TimeoutError:
                return
            delay = self._head_time + self._interval - loop.time()

    async def _send_folded(self) -> None:
        """With the writer idle, one or two transactions queued (a lone client's) and
        among them a message a handler is about to take (a pending journal entry, whose
        answer is likely to follow within a few turns): send what is queued at once,
        then what the next loop turns add (at most _FOLD_TURNS, while each adds some),
        as one fold: the writer applies the first part while the event loop is still
        building the rest (a client's envelope is queued, its handler answers in the
        next turn), and commits both in one SQLite transaction. The second part is
        always sent, empty if nothing came: the writer waits for it before it commits.
        One task finishes both parts, so a fold takes one place in the pipeline.
        Under load batches form by themselves while the writer works (`_gather`)."""
        first = self._take()
        first_sent = self._write(first, more=True)
        if first_sent is None:
            return
        queue = self._queue
        try:
            for _ in range(_FOLD_TURNS):
                seen = len(queue)
                await asyncio.sleep(0)
                if len(queue) == seen:
                    break
        finally:
            last = self._take() if queue else []
            last_sent = self._write(last, more=False)
            if last_sent is None:  # it failed; the writer still waits for the end
                last_sent = self._write([], more=False)
            parts = [first_sent]
            if last_sent is not None:
                parts.append(last_sent)
            self._inflight.append(self._loop.create_task(self._finish(parts)))

    def _take(self) -> list[Queued]:
        queue = self._queue
        limit = self._max_entries
        if not self._inflight and self._queued_ops >= 2 * self._saturated_ops:
            # The writer is idle and much is waiting: send half now and the rest
            # behind it, so callers whose half is committed build their next
            # transactions while the other half is written.
            limit = min(limit, (self._queued_ops + 1) // 2)
        item = queue.popleft()
        n = len(item[0].rows) + len(item[0].ops)
        batch = [item]
        while queue:
            tx = queue[0][0]
            m = len(tx.rows) + len(tx.ops)
            if n + m > limit:
                break
            batch.append(queue.popleft())
            n += m
        self._queued_ops -= n
        self._last_batch_ops = n
        if queue:
            self._head_time = self._loop.time() - self._interval  # overdue: next at once
        return batch

    async def _writer_ready(self) -> None:
        """Wait until the writer should get the next batch: when nothing is in flight,
        or when one batch is and a second would not be small (a commit costs about a
        millisecond whatever its size, so a pipeline of tiny batches writes less)."""
        while True:
            in_flight = self._in_flight()
            if not in_flight or self._phase is not _OPEN or (
                    in_flight < _PIPELINE and self._queued_ops >= self._saturated_ops):
                return
            self._wake.clear()
            await self._wake.wait()

    def _in_flight(self) -> int:
        """How many batches are still in flight, once those the writer has answered
        are dropped from the head of `_inflight`."""
        inflight = self._inflight
        while inflight and inflight[0].done():
            inflight.popleft()
        return len(inflight)

    def _send(self, batch: list[Queued]) -> None:
        """Send `batch` to the writer now (calls are answered in order) and finish it
        in a task of its own, so the next batch can be sent while this one is written
        (two in flight: the event loop builds the next while the writer writes)."""
        sent = self._write(batch)
        if sent is not None:
            self._inflight.append(self._loop.create_task(self._finish([sent])))

    def _write(self, batch: list[Queued], more: bool | None = None) -> Sent | None:
        """Hand `batch` to the writer, its transactions numbered from `_next_txn`: what
        was sent, or None if it could not be (then it failed). `more`: part of a fold
        (see `_send_folded`); True: another part follows."""
        wires = wires_of(batch)
        first = self._next_txn
        args = (wires, first) if more is None else (wires, first, more)
        try:  # the loop polls for the reply, except to a fold's first part (see call)
            reply = self._writer_proc.call("write_batch", *args, spin=not more)
        except Exception as exc:  # e.g. a payload that does not pickle: not written
            self._storage_failed(KernelUnavailable(f"kernel writer error: {exc!r}"), batch)
            return None
        self._next_txn = first + len(batch)
        self._writing.append(batch)
        return batch, reply, first

    async def _finish(self, parts: list[Sent]) -> None:
        """Resolve the futures of a batch, or of each part of a fold, from its reply."""
        for part in parts:
            await self._finish_part(*part)
        self._wake.set()  # _writer_ready

    async def _finish_part(self, batch: list[Queued], reply: asyncio.Future[tuple],
                           first: int) -> None:
        whole = batch
        try:
            seconds, ops, rejected, storage = await reply
        except WriterExited:
            if batch:  # committed or not: the next writer knows (_settle_orphans)
                self._orphans.append((first, batch))
        except Exception as exc:
            if not is_storage_error(exc):  # a bug in the writer: do not acknowledge
                log.error("kernel: writer error: %r", exc)
                exc = KernelUnavailable(f"kernel writer error: {exc}")
            self._storage_failed(exc, batch)
        else:
            # The writer retried each transaction alone after the batch failed: some
            # were rejected, and a storage error may have stopped it at `storage[0]`.
            for i, message in rejected:
                tx, fut = batch[i]
                log.error("kernel: transaction rejected: %s", message)
                self._ctx.release(tx.ops)
                fail(fut, TransactionRejected(
                    f"transaction rejected by the database: {message}"))
            if storage is not None:
                stop, message = storage
                self._storage_failed(KernelUnavailable(message), batch[stop:])
                batch = batch[:stop]
            self._committed(batch, seconds, ops)
        # Not in a `finally`: if this task is cancelled mid-write, close() must still
        # see the batch whose outcome is unknown, to fail its futures.
        self._writing = [b for b in self._writing if b is not whole]


def fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()  # retrieved: callers that chose not to await are not warned
