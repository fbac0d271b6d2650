"""Transactions: the builder callers fill, and the pure planning of a batch of them.

A `Transaction` is one atomic unit. Building it touches no I/O: journal seqs and
outbox ids are allocated in memory at once, payloads are hashed and rows are built
here, in the caller's time. `plan_batch` folds a batch of transactions, in
submission order, into one set of statements per table whose effect equals applying
every operation one after the other (last thread write wins, a drop removes earlier
appends, a delivery cancels an earlier pending mark) so the writer can issue one
`executemany` per table per batch.

Invariants: seqs and outbox ids are strictly increasing in allocation order and never
reused (high-water marks are persisted); a transaction is committed at most once and
cannot change after `Kernel.commit`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from agentd.kernel._chain import SEP
from agentd.kernel._errors import ContextLimitExceeded
from agentd.kernel._records import (
    APPROVAL_STATES,
    AUDIT_DIRECTIONS,
    DIRECTIONS,
    RETAIN_FOREVER,
    THREAD_STATES,
    ApprovalRow,
    Retention,
    RetentionPolicy,
    ThreadRow,
    TimerRow,
)

# Operation codes (first element of every op tuple).
OP_THREAD_PUT = 0  # (op, uuid, row)
OP_THREAD_STATE = 1  # (op, uuid, state, hops | None, updated)
OP_DELIVERED = 2  # (op, seq)
OP_OUTBOX_PUT = 3  # (op, id, client, thread, data)
OP_OUTBOX_DELIVERED = 4  # (op, client, up_to_id)
OP_CONTEXT_APPEND = 5  # (op, thread, role, content, ts)
OP_CONTEXT_DROP = 6  # (op, thread)
OP_SEGMENT_PUT = 7  # (op, row of _store.SEGMENT_COLUMNS)
OP_SEGMENT_MOVE = 8  # (op, thread, id, tier, relevance, summary)
OP_MEMORY_PUT = 9  # (op, row of _store.MEMORY_COLUMNS)
OP_MEMORY_FORGET = 10  # (op, agent, id)
# Durable waits and handler state: applied in op order, one statement each.
OP_TIMER_PUT = 11  # (op, TimerRow)
OP_TIMER_DELETE = 12  # (op, id)
OP_STATE_PUT = 13  # (op, listener, conversation, key, value)
OP_STATE_DELETE = 14  # (op, listener, conversation, key)
OP_STATE_DROP = 15  # (op, conversation)
OP_APPROVAL_PUT = 16  # (op, ApprovalRow)
OP_APPROVAL_DECIDE = 17  # (op, id, state, decided_by, reason, decided_at)
OP_OUTBOX_SENT = 18  # (op, client, ids)
OP_AUTH_PUT = 19  # (op, (client, state JSON))
OP_STREAM_PUT = 20  # (op, (id, client, thread, last_seq))
OP_STREAM_DELETE = 21  # (op, (id,))

_DURABLE_SQL = {
    OP_TIMER_PUT: "INSERT OR REPLACE INTO timers (id, conversation, frame, listener, due, note, "
                  "hops, created) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
    OP_TIMER_DELETE: "DELETE FROM timers WHERE id = ?",
    OP_STATE_PUT: "INSERT OR REPLACE INTO handler_state (listener, conversation, key, value) "
                  "VALUES (?, ?, ?, ?)",
    OP_STATE_DELETE: "DELETE FROM handler_state WHERE listener = ? AND conversation = ? "
                     "AND key = ?",
    OP_STATE_DROP: "DELETE FROM handler_state WHERE conversation = ?",
    OP_APPROVAL_PUT: "INSERT INTO approvals (id, conversation, frame, owner, listener, sender, "
                     "hops, envelope, payload, payload_sha256, approvers, created, deadline, "
                     "state, decided_by, reason, decided_at, call_ref) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    OP_AUTH_PUT: "INSERT OR REPLACE INTO bus_auth (client, state) VALUES (?, ?)",
    OP_STREAM_PUT: "INSERT OR REPLACE INTO streams (id, client, thread, last_seq) "
                   "VALUES (?, ?, ?, ?)",
    OP_STREAM_DELETE: "DELETE FROM streams WHERE id = ?",
    # Only a pending approval can be decided: a second decision changes nothing.
    OP_APPROVAL_DECIDE: "UPDATE approvals SET state = ?, decided_by = ?, reason = ?, "
                        "decided_at = ? WHERE id = ? AND state = 'pending'",
}

# Journal base row: seq, ts, thread, direction, kind, handler, sender, tag, payload,
# profile, expires, pending. The writer adds payload_hash, pos, prev_hash and hash (it
# alone knows the chain head) to make the row of _store.INSERT_JOURNAL.
JournalRow = tuple[int, float, str, str, str, str, str, str, bytes, str, "float | None", int]

# Call paths repeat (every conversation of one shape has the same one): their JSON is
# cached, bounded, since json.dumps is a good part of a thread row's cost.
_PATH_JSON: dict[tuple[str, ...], str] = {}
_PATH_JSON_MAX = 4096


class TxContext:
    """The kernel's in-memory allocators and context-buffer counters (event-loop only)."""

    def __init__(
        self,
        *,
        next_seq: int,
        next_outbox_id: int,
        retention: RetentionPolicy = RETAIN_FOREVER,
        audit_retention: Retention = RETAIN_FOREVER,
        max_slots_per_thread: int = 1000,
        max_threads: int = 100000,
        context_counts: Mapping[str, tuple[int, float]] | None = None,
        full_sync_profiles: Iterable[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Wall-clock seconds for journal stamps, thread updates and context appends
        # (the kernel's clock: tests pass a fake one to expire entries without waiting).
        self.clock = clock
        self.next_seq = next_seq
        self.next_outbox_id = next_outbox_id
        self.max_slots = max_slots_per_thread
        self.max_threads = max_threads
        self.ctx_count: dict[str, int] = {}
        self.ctx_last: dict[str, float] = {}
        for thread, (n, last) in (context_counts or {}).items():
            self.ctx_count[thread] = n
            self.ctx_last[thread] = last
        self.audit_retention = audit_retention
        self.full_sync_profiles = frozenset(full_sync_profiles)
        # Each entry keeps the policy it was written under.
        if isinstance(retention, Retention):
            self._single: Retention | None = retention
            self._by_profile: dict[str, Retention] = {}
            self._default = retention
        else:
            self._single = None
            self._by_profile = dict(retention)
            self._default = self._by_profile.pop("*", RETAIN_FOREVER)
        self.forever = self.audit_retention == RETAIN_FOREVER and all(
            p == RETAIN_FOREVER for p in (self._default, *self._by_profile.values()))

    def expires(self, profile: str, direction: str, ts: float) -> float | None:
        if direction in AUDIT_DIRECTIONS:
            return self.audit_retention.expires(ts)
        policy = self._single or self._by_profile.get(profile, self._default)
        return policy.expires(ts)

    def context_check(self, counts: dict[str, int], thread: str) -> int:
        """Slots `thread` would have after one more append, given the overlay `counts`
        (threads not in it read through to the counters of submitted transactions).
        Raises if a limit would be exceeded."""
        n = counts[thread] if thread in counts else self.ctx_count.get(thread, 0)
        if n >= self.max_slots:
            raise ContextLimitExceeded(
                f"context buffer of thread {thread} is full "
                f"(max_slots_per_thread={self.max_slots})"
            )
        if n == 0:
            live = len(self.ctx_count) + sum(
                1 for t, c in counts.items() if c > 0 and t not in self.ctx_count
            ) - sum(1 for t, c in counts.items() if c == 0 and t in self.ctx_count)
            if live >= self.max_threads:
                raise ContextLimitExceeded(
                    f"too many context buffers (max_threads={self.max_threads}); "
                    f"cannot start one for thread {thread}"
                )
        return n + 1

    def reserve(self, ops: Iterable[tuple], now: float) -> None:
        """Re-check a transaction's context ops against the submitted counters and
        apply them (at submission, so counters follow submission order)."""
        overlay: dict[str, int] = {}
        for op in ops:
            if op[0] == OP_CONTEXT_APPEND:
                overlay[op[1]] = self.context_check(overlay, op[1])
            elif op[0] == OP_CONTEXT_DROP:
                overlay[op[1]] = 0
        for thread, n in overlay.items():
            if n:
                self.ctx_count[thread] = n
                self.ctx_last[thread] = now
            else:
                self.ctx_count.pop(thread, None)
                self.ctx_last.pop(thread, None)

    def release(self, ops: Iterable[tuple]) -> None:
        """Undo the appends of a transaction that failed (drops cannot be undone; the
        counters then under-count until the next open)."""
        for op in ops:
            if op[0] == OP_CONTEXT_APPEND and op[1] in self.ctx_count:
                n = self.ctx_count[op[1]] - 1
                if n > 0:
                    self.ctx_count[op[1]] = n
                else:
                    del self.ctx_count[op[1]]
                    self.ctx_last.pop(op[1], None)

    def idle_buffers(self, cutoff: float) -> list[str]:
        """Threads whose context buffer saw no append since `cutoff`; forgets them."""
        idle = [t for t, last in self.ctx_last.items() if last < cutoff]
        for t in idle:
            self.ctx_count.pop(t, None)
            del self.ctx_last[t]
        return idle


class Transaction:
    """A builder for ONE atomic unit. Nothing touches SQLite until Kernel.commit()
    batches it; either all of it is committed or none of it."""

    # Plain attributes, not properties: the kernel reads them for every transaction.
    # `rows` and `ops` are read-only outside this module; `committed` is set only
    # by the kernel when it queues the transaction; `touches_context` says whether
    # the kernel must reserve context counters for it at commit.
    __slots__ = ("_ctx", "_ctx_overlay", "_pending", "committed", "full_sync", "ops",
                 "rows", "touches_context")

    def __init__(self, ctx: TxContext) -> None:
        self._ctx = ctx
        self.rows: list[JournalRow] = []
        self.ops: list[tuple] = []
        self._pending: list[int] | None = None  # offsets in rows of pending entries
        self.full_sync = False  # commit this one with synchronous=FULL (profile setting)
        self.committed = False
        self.touches_context = False
        self._ctx_overlay: dict[str, int] | None = None

    # -- building -------------------------------------------------------------------

    def journal(
        self,
        *,
        thread: str,
        direction: str,
        kind: str = "message",
        handler: str = "",
        sender: str = "",
        tag: str = "",
        payload: bytes = b"",
        profile: str = "",
        pending: bool = False,
    ) -> int:
        """Append a journal entry; returns its seq (allocated now, never reused).

        `pending=True` marks a message to be redelivered after a crash until a
        transaction carrying `delivered(seq)` is committed."""
        if self.committed:
            raise RuntimeError("transaction already committed")
        if direction not in DIRECTIONS:
            raise ValueError(f"journal direction must be one of {sorted(DIRECTIONS)}")
        ctx = self._ctx
        seq = ctx.next_seq
        ctx.next_seq = seq + 1
        ts = (ctx.clock() * 1_000_000) // 1 / 1_000_000  # stamped on whole microseconds
        expires = None if ctx.forever else ctx.expires(profile, direction, ts)
        # The payload hash and the chain encoding (_chain.encode) are computed by the
        # writer process, off the event loop; the separator check stays here, so a bad
        # field fails now and not at commit.
        if (SEP in thread or SEP in kind or SEP in handler or SEP in sender or SEP in tag
                or SEP in profile):
            raise ValueError("journal fields must not contain U+001F")
        if profile in ctx.full_sync_profiles:
            self.full_sync = True
        if pending:
            if self._pending is None:
                self._pending = []
            self._pending.append(len(self.rows))
        self.rows.append(
            (seq, ts, thread, direction, kind, handler, sender, tag, payload, profile, expires,
             1 if pending else 0)
        )
        return seq

    def thread_put(self, row: ThreadRow) -> None:
        """Insert or replace a thread row."""
        self._check_open()
        if row.state not in THREAD_STATES:
            raise ValueError(f"thread state must be one of {sorted(THREAD_STATES)}")
        key = row.path if type(row.path) is tuple else tuple(row.path)
        path = _PATH_JSON.get(key)
        if path is None:
            path = json.dumps(list(key))
            if len(_PATH_JSON) < _PATH_JSON_MAX:
                _PATH_JSON[key] = path
        self.ops.append((OP_THREAD_PUT, row[0], (row[0], path, *row[2:])))

    def thread_state(self, uuid: str, state: str, hops: int | None = None) -> None:
        """Set a thread's state (and hop count); `updated` becomes now. No effect on a
        thread that does not exist."""
        self._check_open()
        if state not in THREAD_STATES:
            raise ValueError(f"thread state must be one of {sorted(THREAD_STATES)}")
        self.ops.append((OP_THREAD_STATE, uuid, state, hops, self._ctx.clock()))

    def delivered(self, seq: int) -> None:
        """Mark a pending journal entry as processed (the entry itself is unchanged)."""
        self._check_open()
        self.ops.append((OP_DELIVERED, seq))

    def outbox_put(self, client: str, thread: str, data: bytes) -> int:
        """Queue an envelope for an external client; returns its outbox id (ids grow
        in allocation order, so a client's outbox reads back in that order)."""
        self._check_open()
        ctx = self._ctx
        oid = ctx.next_outbox_id
        ctx.next_outbox_id = oid + 1
        self.ops.append((OP_OUTBOX_PUT, oid, client, thread, data))
        return oid

    def outbox_delivered(self, client: str, up_to_id: int) -> None:
        """Delete `client`'s outbox entries with id <= up_to_id."""
        self._check_open()
        self.ops.append((OP_OUTBOX_DELIVERED, client, up_to_id))

    def outbox_sent(self, client: str, ids: Iterable[int]) -> None:
        """Delete these outbox entries of `client`, and only these: frames written to
        one connection while others of the same client still hold older ones queued
        (a range would delete those before they are written)."""
        self._check_open()
        self.ops.append((OP_OUTBOX_SENT, client, tuple(ids)))

    def context_append(self, thread: str, role: str, content: bytes) -> None:
        """Append an immutable slot to `thread`'s context buffer. Raises
        `ContextLimitExceeded` now (not at commit) if a limit would be exceeded."""
        self._check_open()
        if self._ctx_overlay is None:
            self._ctx_overlay = {}
        self._ctx_overlay[thread] = self._ctx.context_check(self._ctx_overlay, thread)
        self.touches_context = True
        self.ops.append((OP_CONTEXT_APPEND, thread, role, content, self._ctx.clock()))

    def timer_put(self, row: TimerRow) -> None:
        """A pending timer (replaces one with the same id)."""
        self._check_open()
        self.ops.append((OP_TIMER_PUT, tuple(row)))

    def timer_delete(self, timer_id: str) -> None:
        """The timer fired or was cancelled."""
        self._check_open()
        self.ops.append((OP_TIMER_DELETE, (timer_id,)))

    def state_put(self, listener: str, conversation: str, key: str, value: str) -> None:
        self._check_open()
        self.ops.append((OP_STATE_PUT, (listener, conversation, key, value)))

    def auth_put(self, client: str, state: str) -> None:
        """The bus's authentication state of `client` (JSON), replacing the last."""
        self._check_open()
        self.ops.append((OP_AUTH_PUT, (client, state)))

    def stream_put(self, stream: str, client: str, thread: str, last_seq: int) -> None:
        """A model-text stream that sent `client` partials up to `last_seq` (at least)."""
        self._check_open()
        self.ops.append((OP_STREAM_PUT, (stream, client, thread, last_seq)))

    def stream_delete(self, stream: str) -> None:
        """The stream ended (its `final` was sent)."""
        self._check_open()
        self.ops.append((OP_STREAM_DELETE, (stream,)))

    def state_delete(self, listener: str, conversation: str, key: str) -> None:
        self._check_open()
        self.ops.append((OP_STATE_DELETE, (listener, conversation, key)))

    def state_drop(self, conversation: str) -> None:
        """Every listener's state of a conversation that ended."""
        self._check_open()
        self.ops.append((OP_STATE_DROP, (conversation,)))

    def approval_put(self, row: ApprovalRow) -> None:
        """A message parked at an approval gate."""
        self._check_open()
        if row.state not in APPROVAL_STATES:
            raise ValueError(f"approval state must be one of {sorted(APPROVAL_STATES)}")
        values = list(row)
        values[10] = ",".join(row.approvers)
        self.ops.append((OP_APPROVAL_PUT, tuple(values)))

    def approval_decide(self, approval_id: str, state: str, decided_by: str, reason: str,
                        decided_at: float) -> None:
        """Close a pending approval (no effect on one already decided)."""
        self._check_open()
        if state not in APPROVAL_STATES or state == "pending":
            raise ValueError(f"not a decided approval state: {state!r}")
        self.ops.append((OP_APPROVAL_DECIDE, (state, decided_by, reason, decided_at,
                                              approval_id)))

    def context_drop(self, thread: str) -> None:
        """Delete `thread`'s context buffer."""
        self._check_open()
        if self._ctx_overlay is None:
            self._ctx_overlay = {}
        self._ctx_overlay[thread] = 0
        self.touches_context = True
        self.ops.append((OP_CONTEXT_DROP, thread))

    def segment_put(self, row: tuple[object, ...]) -> None:
        """Insert or replace a context segment: (thread, id, conversation, agent, kind,
        tier, relevance, bytes, tokens, sha256, summary, original, ts)."""
        self._check_open()
        if len(row) != 13:
            raise ValueError("a segment row has 13 fields")
        self.ops.append((OP_SEGMENT_PUT, tuple(row)))

    def segment_move(self, thread: str, segment: int, tier: str, relevance: float,
                     summary: str) -> None:
        """Change a segment's tier, relevance and summary (its original never changes)."""
        self._check_open()
        self.ops.append((OP_SEGMENT_MOVE, thread, segment, tier, relevance, summary))

    def memory_put(self, row: tuple[object, ...]) -> None:
        """Insert or replace a long-term memory: (id, agent, key, text, created,
        embedder, vector)."""
        self._check_open()
        if len(row) != 7:
            raise ValueError("a memory row has 7 fields")
        self.ops.append((OP_MEMORY_PUT, tuple(row)))

    def memory_forget(self, agent: str, memory_id: str) -> None:
        self._check_open()
        self.ops.append((OP_MEMORY_FORGET, agent, memory_id))

    # -- what the kernel reads -----------------------------------------------------

    @property
    def has_pending(self) -> bool:
        """Whether it journals a message as pending (one a handler is to take)."""
        return self._pending is not None

    def wire(self) -> tuple:
        """What the writer process needs of this transaction, as plain data:
        (rows, ops, pending offsets, full_sync). See `plan_batch`."""
        return wires_of(((self, None),))[0]

    def _check_open(self) -> None:
        if self.committed:
            raise RuntimeError("transaction already committed")


def wires_of(batch: Iterable[tuple[Transaction, object]]) -> list[tuple]:
    """`Transaction.wire()` of each (transaction, future) of a batch, in one
    comprehension: the kernel sends every transaction, and a call each adds up.
    The one place the wire tuple is made."""
    return [(tx.rows, tx.ops, tx._pending, tx.full_sync) for tx, _ in batch]


@dataclass
class BatchPlan:
    """The statements for one batch, per table, in the order the writer runs them:
    deletes, then inserts/updates. See module docstring for the equivalence."""

    journal: list[JournalRow] = field(default_factory=list)
    pending: dict[int, int] = field(default_factory=dict)  # seq -> index in journal
    inflight_delete: list[tuple[int]] = field(default_factory=list)
    thread_put: dict[str, Sequence] = field(default_factory=dict)  # uuid -> row
    thread_update: dict[str, list] = field(default_factory=dict)  # uuid -> [state, hops, upd]
    outbox_delete: list[tuple[str, int]] = field(default_factory=list)
    outbox_sent: list[tuple[int, str]] = field(default_factory=list)  # (id, client)
    outbox_insert: dict[int, tuple[int, str, str, bytes]] = field(default_factory=dict)
    context_delete: list[tuple[str]] = field(default_factory=list)
    context_insert: list[tuple[str, str, bytes, float]] = field(default_factory=list)
    # Segment and memory writes, in submission order (they are rare next to journal
    # rows: one per model turn or operator command, so no per-table folding).
    memory_ops: list[tuple] = field(default_factory=list)
    # Timers, handler state, approvals: (statement, parameters) in op order.
    durable: list[tuple[str, tuple]] = field(default_factory=list)
    max_seq: int = 0
    max_outbox_id: int = 0
    ops: int = 0
    full_sync: bool = False
    # Writing it twice would duplicate rows or fail (journal entries, outbox rows,
    # context slots, approvals): its commit must record that it happened (the head's
    # `txn`). A plan without (deletes, updates, replaces) may simply be written again.
    once: bool = False


def plan_batch(txs: Iterable[tuple]) -> BatchPlan:
    """Fold transactions, each as `Transaction.wire()` gives it, into one plan.

    The operations of every request/answer pair (a thread put, an outbox row, a
    delivery) are folded here, not in `_apply_op`: a call per operation was a tenth
    of the writer's time under load."""
    plan = BatchPlan()
    journal, pending = plan.journal, plan.pending
    thread_put, thread_update = plan.thread_put, plan.thread_update
    outbox_insert, inflight_delete = plan.outbox_insert, plan.inflight_delete
    ops = max_seq = max_outbox_id = 0
    for rows, tx_ops, tx_pending, full_sync in txs:
        if full_sync:
            plan.full_sync = True
        if rows:
            ops += len(rows)
            if tx_pending is not None:
                base = len(journal)
                for offset in tx_pending:
                    pending[rows[offset][0]] = base + offset
            journal.extend(rows)
            if rows[-1][0] > max_seq:  # seqs ascend within a transaction
                max_seq = rows[-1][0]
        if tx_ops:
            ops += len(tx_ops)
            for op in tx_ops:
                code = op[0]
                if code == OP_THREAD_PUT:
                    if thread_update:
                        thread_update.pop(op[1], None)
                    thread_put[op[1]] = op[2]  # a tuple until a state op changes it
                elif code == OP_OUTBOX_PUT:
                    oid = op[1]
                    outbox_insert[oid] = op[1:]
                    if oid > max_outbox_id:
                        max_outbox_id = oid
                elif code == OP_DELIVERED:
                    if pending.pop(op[1], None) is None:
                        inflight_delete.append(op[1:])
                else:
                    _apply_op(plan, op)
    plan.ops = ops
    plan.max_seq = max_seq
    plan.max_outbox_id = max_outbox_id
    if journal or outbox_insert or plan.context_insert:
        plan.once = True
    return plan


def _apply_op(plan: BatchPlan, op: tuple) -> None:
    """The operations `plan_batch` does not fold itself."""
    code = op[0]
    if code == OP_THREAD_STATE:
        _, uuid, state, hops, updated = op
        row = plan.thread_put.get(uuid)
        if row is not None:
            if type(row) is not list:
                row = plan.thread_put[uuid] = list(row)
            row[6] = state
            row[8] = updated
            if hops is not None:
                row[9] = hops
        else:
            cur = plan.thread_update.get(uuid)
            if cur is not None and hops is None:
                hops = cur[1]
            plan.thread_update[uuid] = [state, hops, updated]
    elif code == OP_OUTBOX_DELIVERED:
        _, client, up_to = op
        gone = [k for k, v in plan.outbox_insert.items() if v[1] == client and k <= up_to]
        for k in gone:
            del plan.outbox_insert[k]
        plan.outbox_delete.append((client, up_to))
    elif code == OP_OUTBOX_SENT:
        _, client, ids = op
        for oid in ids:
            put = plan.outbox_insert.get(oid)
            if put is not None and put[1] == client:
                del plan.outbox_insert[oid]
            else:
                plan.outbox_sent.append((oid, client))
    elif code == OP_CONTEXT_APPEND:
        plan.context_insert.append((op[1], op[2], op[3], op[4]))
    elif code == OP_CONTEXT_DROP:
        thread = op[1]
        if any(slot[0] == thread for slot in plan.context_insert):
            plan.context_insert = [s for s in plan.context_insert if s[0] != thread]
        plan.context_delete.append((thread,))
    elif code in (OP_SEGMENT_PUT, OP_SEGMENT_MOVE, OP_MEMORY_PUT, OP_MEMORY_FORGET):
        plan.memory_ops.append(op)
    elif code in _DURABLE_SQL:
        plan.durable.append((_DURABLE_SQL[code], op[1]))
        if code == OP_APPROVAL_PUT:  # an INSERT: a second one fails
            plan.once = True
    else:  # pragma: no cover - ops are only built by Transaction
        raise AssertionError(f"unknown op {code}")


OnCommit = Callable[[float, int], None]
