"""The writer's side of SQLite: every statement that changes the database.

A `Store` belongs to the kernel's single writer thread (the sqlite3 connection is
bound to the thread that made it) and is driven one call at a time. Each public
method is one SQLite transaction: it commits whole or rolls back whole, and the
in-memory chain head moves only after a successful COMMIT. Journal rows are only
ever inserted or (by retention) deleted with a gap record; never updated.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

from agentd.kernel._chain import Gap, Verdict, chain_rows, verify_chain
from agentd.kernel._errors import KernelUnavailable
from agentd.kernel._records import JournalEntry, ThreadRow
from agentd.kernel._schema import is_postgres, migrate
from agentd.kernel._transaction import (
    OP_MEMORY_FORGET,
    OP_MEMORY_PUT,
    OP_SEGMENT_MOVE,
    OP_SEGMENT_PUT,
    BatchPlan,
)

# Primary result codes meaning "the storage is failing", as opposed to "this
# transaction is bad": BUSY, LOCKED, NOMEM, READONLY, IOERR, CORRUPT, FULL, CANTOPEN,
# PROTOCOL, NOTADB.
STORAGE_ERROR_CODES = frozenset({5, 6, 7, 8, 10, 11, 13, 14, 15, 26})

SYNCHRONOUS_MODES = frozenset({"OFF", "NORMAL", "FULL", "EXTRA"})

JOURNAL_COLUMNS = (
    "pos, seq, ts, thread, direction, kind, handler, sender, tag, payload_hash, payload, "
    "profile, expires, pending, prev_hash, hash"
)
INSERT_JOURNAL = (
    "INSERT INTO journal (seq, ts, thread, direction, kind, handler, sender, tag, "
    "payload_hash, payload, profile, expires, pending, pos, prev_hash, hash) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
THREAD_COLUMNS = ("uuid, path, parent, owner, profile, table_version, state, created, updated, "
                  "hops, call_ref")

_SELECT_EXPIRED = (
    "SELECT pos, prev_hash, hash FROM journal "
    "WHERE expires IS NOT NULL AND expires <= ? "
    "AND NOT (pending = 1 AND EXISTS (SELECT 1 FROM inflight WHERE inflight.seq = journal.seq)) "
    "ORDER BY expires LIMIT ?"
)

_BUSY_TIMEOUT_MS = 2000


# sqlite3 binds int, float, str and bytearray directly but sends every other value
# (bytes, None: payloads, hashes, an absent expiry) through its adaptation protocol,
# whose failed `__adapt__` lookup formats an AttributeError message each time: about
# ten per request/answer pair, a tenth of the writer's instructions. An identity
# adapter registered for them is found in the registry first. Bytes still bind as
# blobs and None as NULL; nothing else is registered (registering int, float, str or
# bytearray would send every value through the protocol). Both adapters are C
# callables (None's: an empty dict's `get`, which returns None for any key): a Python
# function costs a frame for each of the three None a pair binds.
sqlite3.register_adapter(bytes, bytes.__bytes__)
sqlite3.register_adapter(type(None), cast(Callable[[None], None], {}.get))


def is_storage_error(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None:  # e.g. ProgrammingError raised by the module itself
            return isinstance(exc, sqlite3.OperationalError)
        return (code & 0xFF) in STORAGE_ERROR_CODES
    return isinstance(exc, (OSError, KernelUnavailable))


@dataclass(frozen=True)
class Head:
    pos: int
    hash: bytes
    seq: int
    outbox_id: int
    txn: int  # the last transaction number made durable (see `commit`)


_STANDBY_RETRY_S = 0.25  # a waiting standby that cannot reach the server tries again


class Store:
    """On SQLite (`open`) or PostgreSQL (`open_postgres`: `conn` is then a
    `_postgres.PgConnection`, which speaks this module's SQL): the same statements,
    transactions and chain. What only SQLite has (PRAGMAs, the WAL checkpoint, a size
    cap, synchronous=FULL batches: PostgreSQL commits every transaction durably) is
    skipped on PostgreSQL."""

    def __init__(self, conn: Any, db: Path | str, head: Head, default_max_pages: int):
        self.conn = conn
        self.db = db
        self.head = head
        self.postgres = is_postgres(conn)
        self._default_max_pages = default_max_pages
        self.migrated_from = 0
        if self.postgres:
            self.page_size = 0
            self.synchronous = "on"
        else:
            self.page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
            self.synchronous = str(conn.execute("PRAGMA synchronous").fetchone()[0])
        self._open_head = head  # the chain head within the open transaction (`apply`)
        self.lease = (0, 0.0)  # postgres: (epoch, since) of the lease this writer holds

    @classmethod
    def open(cls, db: Path, *, synchronous: str = "NORMAL", max_db_bytes: int | None = None,
             wal_autocheckpoint: int = 1000, journal_size_limit: int = 64 << 20) -> Store:
        if synchronous.upper() not in SYNCHRONOUS_MODES:
            raise ValueError(f"synchronous must be one of {sorted(SYNCHRONOUS_MODES)}")
        if not db.exists():  # SQLite would create it 0644 (minus umask); we want 0600
            os.close(os.open(db, os.O_CREAT | os.O_WRONLY, 0o600))
        conn = sqlite3.connect(db, isolation_level=None, timeout=_BUSY_TIMEOUT_MS / 1000)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise KernelUnavailable(f"{db}: cannot switch to WAL mode (got {mode!r})")
            conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
            conn.execute(f"PRAGMA wal_autocheckpoint={int(wal_autocheckpoint)}")
            conn.execute(f"PRAGMA journal_size_limit={int(journal_size_limit)}")
            conn.execute("PRAGMA temp_store=MEMORY")
            conn.execute("PRAGMA foreign_keys=OFF")
            default_max_pages = int(conn.execute("PRAGMA max_page_count").fetchone()[0])
            migrated_from, _ = migrate(conn, db)
            pos, h, seq, oid, txn = conn.execute(
                "SELECT pos, hash, seq, outbox_id, txn FROM head WHERE id = 0").fetchone()
            store = cls(conn, db, Head(pos, h, seq, oid, txn), default_max_pages)
            store.migrated_from = migrated_from
            if max_db_bytes is not None:
                store.set_max_bytes(max_db_bytes)
            return store
        except BaseException:
            conn.close()
            raise

    @classmethod
    def open_postgres(cls, dsn: str, *, lease: str | None = None, holder: str = "",
                      standby: bool = False, epoch: int | None = None,
                      lease_timeout_s: float = 3.0,
                      abandoned: Callable[[], bool] | None = None) -> Store:
        """Connect (one connection, this writer's alone), take the organism's lease
        on it if `lease` names the organism (see `_postgres.take_lease`), migrate.
        `abandoned()`: a standby stops waiting once it is true."""
        from agentd.kernel._postgres import PgConnection, take_lease  # optional extra

        while True:
            try:
                conn = PgConnection.connect(dsn, exit_on_loss=epoch is not None or not standby)
                break
            except KernelUnavailable:  # a standby waits on while the server is away
                if not standby or (abandoned is not None and abandoned()):
                    raise
                time.sleep(_STANDBY_RETRY_S)
        try:
            label = f"postgresql database {conn.raw.info.dbname}"
            lease_epoch, since = 0, 0.0
            if lease is not None:
                lease_epoch, since = take_lease(conn, lease, holder, wait=standby,
                                                epoch=epoch, timeout_s=lease_timeout_s,
                                                abandoned=abandoned)
            conn.exit_on_loss = True  # from here on a lost connection is a lost writer
            migrated_from, _ = migrate(conn, label)
            row = conn.execute("SELECT pos, hash, seq, outbox_id, txn FROM head WHERE id = 0"
                               ).fetchone()
            assert row is not None
            pos, h, seq, oid, txn = row
            store = cls(conn, label, Head(pos, bytes(h), seq, oid, txn), 0)
            store.migrated_from = migrated_from
            store.lease = (lease_epoch, since)
            return store
        except BaseException:
            conn.close()
            raise

    # -- writes ---------------------------------------------------------------------

    def write(self, plan: BatchPlan, txn: int | None = None) -> None:
        """One batch, one SQLite transaction. Chain hashes are computed here, in commit
        order, so a transaction that fails never leaves a hole in the chain. `txn`: the
        number of its last transaction, recorded with it (see `commit`)."""
        upgrade = plan.full_sync and self.synchronous in ("0", "1")  # SQLite OFF, NORMAL
        if upgrade:
            self.conn.execute("PRAGMA synchronous=FULL")
        try:
            self.begin()
            try:
                self.apply(plan)
                self.commit(txn)
            except BaseException:
                self.rollback()
                raise
        finally:
            if upgrade:
                self.conn.execute(f"PRAGMA synchronous={self.synchronous}")

    def begin(self) -> None:
        """Open the SQLite transaction that `apply` adds batches to and `commit` ends
        (or `rollback` undoes): batches applied together commit together."""
        self.conn.execute("BEGIN")
        self._open_head = self.head

    def apply(self, plan: BatchPlan) -> None:
        """The statements of one batch, inside the open transaction; its chain goes on
        from the batches applied before it in that transaction."""
        head = self._open_head
        rows, pos, prev = chain_rows(plan.journal, head.pos, head.hash)
        conn = self.conn
        if plan.inflight_delete:
            conn.executemany("DELETE FROM inflight WHERE seq = ?", plan.inflight_delete)
        if plan.outbox_delete:
            conn.executemany("DELETE FROM outbox WHERE client = ? AND id <= ?",
                             plan.outbox_delete)
        if plan.outbox_sent:
            conn.executemany("DELETE FROM outbox WHERE id = ? AND client = ?",
                             plan.outbox_sent)
        if plan.context_delete:
            conn.executemany("DELETE FROM context WHERE thread = ?", plan.context_delete)
        if rows:
            conn.executemany(INSERT_JOURNAL, rows)
        if plan.pending:
            first = head.pos + 1
            conn.executemany("INSERT INTO inflight (seq, pos) VALUES (?, ?)",
                             [(seq, first + i) for seq, i in plan.pending.items()])
        if plan.thread_put:
            conn.executemany(
                f"INSERT OR REPLACE INTO threads ({THREAD_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                plan.thread_put.values())
        if plan.thread_update:
            conn.executemany(
                "UPDATE threads SET state = ?, hops = COALESCE(?, hops), updated = ? "
                "WHERE uuid = ?",
                [(s, h, u, uuid) for uuid, (s, h, u) in plan.thread_update.items()])
        if plan.outbox_insert:
            conn.executemany("INSERT INTO outbox (id, client, thread, data) "
                             "VALUES (?, ?, ?, ?)", plan.outbox_insert.values())
        if plan.context_insert:
            conn.executemany("INSERT INTO context (thread, role, content, ts) "
                             "VALUES (?, ?, ?, ?)", plan.context_insert)
        for op in plan.memory_ops:
            _write_memory_op(conn, op)
        for statement, params in plan.durable:
            conn.execute(statement, params)
        self._open_head = Head(pos, prev, max(head.seq, plan.max_seq),
                               max(head.outbox_id, plan.max_outbox_id), head.txn)

    def commit(self, txn: int | None = None) -> None:
        """End the open transaction; the chain head moves only once COMMIT returned.
        `txn`, the kernel's number of the last transaction this commit makes durable,
        commits with it: a writer that dies before answering leaves the outcome on
        disk (see `outcomes`)."""
        new_head = self._open_head
        if txn is not None and txn > new_head.txn:
            new_head = Head(new_head.pos, new_head.hash, new_head.seq, new_head.outbox_id, txn)
        if new_head != self.head:
            self.conn.execute("UPDATE head SET pos = ?, hash = ?, seq = ?, outbox_id = ?, "
                              "txn = ? WHERE id = 0",
                              (new_head.pos, new_head.hash, new_head.seq, new_head.outbox_id,
                               new_head.txn))
        self.conn.execute("COMMIT")
        self.head = new_head

    def record_rejected(self, txn: int) -> None:
        """Transaction `txn` was refused by the database on its own: say so durably,
        so its outcome is known even if the writer dies before answering."""
        self.begin()
        try:
            self.conn.execute("INSERT OR IGNORE INTO rejected_txns VALUES (?)", (txn,))
            self.commit(txn)
        except BaseException:
            self.rollback()
            raise

    def outcomes(self, first: int) -> tuple[int, list[int]]:
        """What became of the transactions numbered `first` and later: (the last one
        made durable, those of them the database rejected). Older rejections are
        forgotten: the kernel asks only about what it has not settled."""
        self.conn.execute("DELETE FROM rejected_txns WHERE txn < ?", (first,))
        rejected = [r[0] for r in self.conn.execute(
            "SELECT txn FROM rejected_txns WHERE txn >= ? ORDER BY txn", (first,))]
        return self.head.txn, rejected

    def rollback(self) -> None:
        self._rollback()
        self._open_head = self.head

    def sweep_retention(self, now: float, limit: int) -> tuple[int, bool]:
        """Delete up to `limit` expired, delivered journal entries, recording gaps.
        Returns (deleted, maybe_more)."""
        conn = self.conn
        conn.execute("BEGIN")
        try:
            found = conn.execute(_SELECT_EXPIRED, (now, limit)).fetchall()
            found.sort()
            runs: list[list] = []
            for pos, prev, h in found:
                if runs and runs[-1][1] == pos - 1:
                    runs[-1][1] = pos
                    runs[-1][3] = h
                else:
                    runs.append([pos, pos, prev, h])
            for start, end, prev, h in runs:
                conn.execute("DELETE FROM journal WHERE pos BETWEEN ? AND ?", (start, end))
                self._record_gap(start, end, prev, h)
            conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return len(found), len(found) >= limit

    def _record_gap(self, start: int, end: int, prev: bytes, h: bytes) -> None:
        conn = self.conn
        left = conn.execute("SELECT start_pos, prev_hash FROM journal_gaps WHERE end_pos = ?",
                            (start - 1,)).fetchone()
        if left is not None:
            conn.execute("DELETE FROM journal_gaps WHERE start_pos = ?", (left[0],))
            start, prev = left
        right = conn.execute("SELECT end_pos, hash FROM journal_gaps WHERE start_pos = ?",
                             (end + 1,)).fetchone()
        if right is not None:
            conn.execute("DELETE FROM journal_gaps WHERE start_pos = ?", (end + 1,))
            end, h = right
        conn.execute("INSERT INTO journal_gaps VALUES (?, ?, ?, ?)", (start, end, prev, h))

    def gc(self, thread_cutoff: float, idle_buffers: Iterable[str]) -> tuple[int, int]:
        """Delete completed/failed threads last updated before `thread_cutoff`, and the
        given idle context buffers. Returns (threads, buffers) deleted."""
        conn = self.conn
        idle = [(t,) for t in idle_buffers]
        conn.execute("BEGIN")
        try:
            # A task's segments live as long as its frame's thread row.
            conn.execute(
                "DELETE FROM segments WHERE thread IN (SELECT uuid FROM threads WHERE "
                "state != 'active' AND updated < ?)", (thread_cutoff,))
            threads = conn.execute(  # finished threads: the index threads_finished
                "DELETE FROM threads WHERE state != 'active' AND updated < ?",
                (thread_cutoff,)).rowcount
            # Decided approvals go with the threads of their time (the journal keeps
            # their audit entries); pending ones stay until decided or expired.
            conn.execute("DELETE FROM approvals WHERE state != 'pending' AND decided_at < ?",
                         (thread_cutoff,))
            if idle:
                conn.executemany("DELETE FROM context WHERE thread = ?", idle)
            conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return threads, len(idle)

    def cap_outboxes(self, max_per_client: int) -> int:
        """Keep at most `max_per_client` undelivered frames per client (the newest):
        the outbox of a client that never comes back must not grow without bound.
        Returns how many frames were dropped."""
        conn = self.conn
        over = conn.execute("SELECT client FROM outbox GROUP BY client HAVING COUNT(*) > ?",
                            (max_per_client,)).fetchall()
        if not over:
            return 0
        deleted = 0
        conn.execute("BEGIN")
        try:
            for (client,) in over:
                deleted += conn.execute(
                    "DELETE FROM outbox WHERE client = ? AND id <= (SELECT id FROM outbox "
                    "WHERE client = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (client, client, max_per_client)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise
        return deleted

    def checkpoint(self, mode: str = "PASSIVE") -> tuple[int, int, int]:
        """(busy, wal frames, frames checkpointed); TRUNCATE also empties the WAL file.
        Never waits for readers (busy_timeout 0): a reader in the way means busy=1 and
        the caller tries again later, rather than stalling every commit behind it.
        PostgreSQL checkpoints by itself: nothing to do."""
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise ValueError(mode)
        if self.postgres:
            return 0, 0, 0
        conn = self.conn
        conn.execute("PRAGMA busy_timeout=0")
        try:
            busy, log, done = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        finally:
            conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        return int(busy), int(log), int(done)

    def probe(self) -> None:
        """A small real write (allocates pages, appends to the WAL), then undone."""
        conn = self.conn
        conn.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
        try:
            if self.postgres:
                conn.execute("INSERT INTO probe (data) VALUES (?)", (bytes(65536),))
            else:
                conn.execute("INSERT INTO probe (data) VALUES (zeroblob(65536))")
            conn.execute("DELETE FROM probe")
            conn.execute("COMMIT")
        except BaseException:
            self._rollback()
            raise

    def set_max_bytes(self, max_bytes: int | None) -> int:
        """Cap the database file (SQLITE_FULL beyond it). Returns the effective cap.
        On PostgreSQL the server's disk is the cap (0: none here)."""
        if self.postgres:
            if max_bytes is not None:
                raise ValueError("journal.max_db_bytes applies to the sqlite backend only")
            return 0
        if max_bytes is None:
            pages = self._default_max_pages
        else:
            pages = max(1, max_bytes // self.page_size)
        got = self.conn.execute(f"PRAGMA max_page_count={int(pages)}").fetchone()[0]
        return int(got) * self.page_size

    def context_counts(self) -> dict[str, tuple[int, float]]:
        return {t: (int(n), float(last)) for t, n, last in self.conn.execute(
            "SELECT thread, count(*), max(ts) FROM context GROUP BY thread")}

    def renew(self) -> None:
        """Check the lease between transactions (postgres with a lease only)."""
        if self.postgres and self.conn.fence is not None:
            self.conn.renew()

    def size_bytes(self) -> int:
        """The database's size on the PostgreSQL server (SQLite's: see the kernel)."""
        if not self.postgres:
            return 0
        row = self.conn.execute("SELECT pg_database_size(current_database())").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.checkpoint("TRUNCATE")
        self.conn.close()

    def _rollback(self) -> None:
        if self.postgres:
            self.conn.rollback()
            return
        with contextlib.suppress(sqlite3.Error):
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")


# -- reading (any connection, any thread) ---------------------------------------------


SEGMENT_COLUMNS = ("thread, id, conversation, agent, kind, tier, relevance, bytes, tokens, "
                   "sha256, summary, original, ts")
MEMORY_COLUMNS = "id, agent, key, text, created, embedder, vector"


def _write_memory_op(conn: sqlite3.Connection, op: tuple) -> None:
    code = op[0]
    if code == OP_SEGMENT_PUT:
        conn.execute(f"INSERT OR REPLACE INTO segments ({SEGMENT_COLUMNS}) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", op[1])
    elif code == OP_SEGMENT_MOVE:
        _, thread, segment, tier, relevance, summary = op
        conn.execute("UPDATE segments SET tier = ?, relevance = ?, summary = ? "
                     "WHERE thread = ? AND id = ?", (tier, relevance, summary, thread, segment))
    elif code == OP_MEMORY_PUT:
        conn.execute(f"INSERT OR REPLACE INTO memories ({MEMORY_COLUMNS}) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?)", op[1])
    elif code == OP_MEMORY_FORGET:
        conn.execute("DELETE FROM memories WHERE agent = ? AND id = ?", (op[1], op[2]))


def readonly_uri(db: Path) -> str:
    return f"file:{quote(str(db))}?mode=ro"


def entry_from_row(row: tuple) -> JournalEntry:
    (pos, seq, ts, thread, direction, kind, handler, sender, tag, payload_hash, payload,
     profile, expires, pending, prev_hash, h) = row
    return JournalEntry(seq=seq, ts=ts, thread=thread, direction=direction, kind=kind,
                        handler=handler, sender=sender, tag=tag, payload_hash=payload_hash,
                        payload=payload, prev_hash=prev_hash.hex(), hash=h.hex(),
                        profile=profile, pending=bool(pending), expires=expires, pos=pos)


def thread_from_row(row: tuple) -> ThreadRow:
    uuid, path, parent, owner, profile, table_version, state, created, updated, hops, call_ref = row
    return ThreadRow(uuid=uuid, path=tuple(json.loads(path)), parent=parent, owner=owner,
                     profile=profile, table_version=table_version, state=state,
                     created=created, updated=updated, hops=hops, call_ref=call_ref)


def verify_connection(conn: Any) -> Verdict:
    """Verify the chain in one read snapshot of `conn` (a connection in autocommit:
    sqlite3's, or a `PgConnection` whose BEGIN takes a snapshot)."""
    conn.execute("BEGIN")
    try:
        head_pos, head_hash = conn.execute("SELECT pos, hash FROM head WHERE id = 0").fetchone()
        head_hash = bytes(head_hash)
        gaps = [Gap(*g) for g in conn.execute(
            "SELECT start_pos, end_pos, prev_hash, hash FROM journal_gaps ORDER BY start_pos")]
        rows = conn.execute(f"SELECT {JOURNAL_COLUMNS} FROM journal ORDER BY pos")
        verdict = verify_chain(rows, gaps, head_pos, head_hash)
        if not verdict.ok:
            return verdict
        # Recovery redelivers what `inflight` lists: each row must name a pending entry
        # of the chain (a row added for a handled message would run it again). A row
        # deleted cannot be told from a delivery: the chain does not record those.
        stray = conn.execute(
            "SELECT i.seq FROM inflight i LEFT JOIN journal j ON j.pos = i.pos "
            "WHERE j.seq IS NOT i.seq OR j.pending != 1 ORDER BY i.seq LIMIT 1").fetchone()
        if stray is not None:
            return Verdict(False, stray[0], f"inflight entry seq {stray[0]} names no pending "
                           "journal entry (redelivery tampered with)", verdict.entries,
                           verdict.gaps)
        return verdict
    finally:
        conn.execute("ROLLBACK")


def verify_file(db: Path) -> Verdict:
    """Open `db` read-only (no lock needed: WAL readers never block the writer)."""
    conn = sqlite3.connect(readonly_uri(db), uri=True, isolation_level=None)
    try:
        return verify_connection(conn)
    finally:
        conn.close()


def verify_postgres(dsn: str) -> Verdict:
    """Verify the chain of the PostgreSQL database `dsn` names, in one snapshot
    (read-only; safe while the kernel writes)."""
    from agentd.kernel._postgres import PgConnection  # psycopg: an optional extra

    conn = PgConnection.connect(dsn, pipeline=False,
                                begin="BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
    try:
        return verify_connection(conn)
    finally:
        conn.close()
