"""Database schema and migrations.

`schema_version` holds one row. `MIGRATIONS[v]` takes a database from version v-1 to
v; all pending migrations run in one transaction with the version bump, so a crash
mid-migration leaves the old version intact. A database newer than `max(MIGRATIONS)` is refused
(`SchemaTooNew`): an older agentd must never write a schema it does not know.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentd.kernel._errors import SchemaTooNew

# The chain head and high-water marks (one row, id 0), updated by every batch: seqs
# and outbox ids are never reused even after retention deleted the newest rows.
_V1 = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE head (
        id INTEGER PRIMARY KEY CHECK (id = 0),
        pos INTEGER NOT NULL, hash BLOB NOT NULL,
        seq INTEGER NOT NULL, outbox_id INTEGER NOT NULL)""",
    "INSERT INTO head VALUES (0, 0, zeroblob(32), 0, 0)",
    # Append-only. pos is the chain position (commit order); rows are never updated,
    # retention deletes whole rows and records the gap in journal_gaps.
    """CREATE TABLE journal (
        pos INTEGER PRIMARY KEY,
        seq INTEGER NOT NULL,
        ts REAL NOT NULL,
        thread TEXT NOT NULL,
        direction TEXT NOT NULL,
        kind TEXT NOT NULL,
        handler TEXT NOT NULL,
        sender TEXT NOT NULL,
        tag TEXT NOT NULL,
        payload_hash TEXT NOT NULL,
        payload BLOB,
        profile TEXT NOT NULL,
        expires REAL,
        pending INTEGER NOT NULL,
        prev_hash BLOB NOT NULL,
        hash BLOB NOT NULL)""",
    # Only entries that can expire are indexed; retain_forever rows cost nothing here.
    "CREATE INDEX journal_expires ON journal (expires) WHERE expires IS NOT NULL",
    """CREATE TABLE journal_gaps (
        start_pos INTEGER PRIMARY KEY,
        end_pos INTEGER NOT NULL UNIQUE,
        prev_hash BLOB NOT NULL,
        hash BLOB NOT NULL)""",
    # Pending journal entries not yet delivered (crash recovery redelivers these).
    "CREATE TABLE inflight (seq INTEGER PRIMARY KEY, pos INTEGER NOT NULL)",
    """CREATE TABLE threads (
        uuid TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        parent TEXT,
        owner TEXT NOT NULL,
        profile TEXT NOT NULL,
        table_version INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('active', 'completed', 'failed')),
        created REAL NOT NULL,
        updated REAL NOT NULL,
        hops INTEGER NOT NULL)""",
    "CREATE INDEX threads_state ON threads (state, updated)",
    """CREATE TABLE outbox (
        id INTEGER PRIMARY KEY,
        client TEXT NOT NULL,
        thread TEXT NOT NULL,
        data BLOB NOT NULL)""",
    "CREATE INDEX outbox_client ON outbox (client, id)",
    # Append-only slots; a buffer is deleted whole (context_drop, idle GC).
    """CREATE TABLE context (
        id INTEGER PRIMARY KEY,
        thread TEXT NOT NULL,
        role TEXT NOT NULL,
        content BLOB NOT NULL,
        ts REAL NOT NULL)""",
    "CREATE INDEX context_thread ON context (thread, id)",
    # Scratch table for the write probe run while the disk is failing.
    "CREATE TABLE probe (data BLOB)",
)

# Context segments (an agent task's working memory, one row a segment, keyed by the
# task's frame; `conversation` is the client's thread an operator knows) and
# long-term memories (per agent, with the vector of their text and the embedder that
# made it: another embedder means re-embedding). A segment's `original` is never
# changed once its segment is complete; tier, relevance and summary are.
_V2_CONTEXT = (
    """CREATE TABLE segments (
        thread TEXT NOT NULL,
        id INTEGER NOT NULL,
        conversation TEXT NOT NULL,
        agent TEXT NOT NULL,
        kind TEXT NOT NULL,
        tier TEXT NOT NULL CHECK (tier IN ('expanded', 'folded', 'evicted')),
        relevance REAL NOT NULL,
        bytes INTEGER NOT NULL,
        tokens INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        summary TEXT NOT NULL,
        original BLOB NOT NULL,
        ts REAL NOT NULL,
        PRIMARY KEY (thread, id))""",
    "CREATE INDEX segments_conversation ON segments (conversation)",
    """CREATE TABLE memories (
        id TEXT PRIMARY KEY,
        agent TEXT NOT NULL,
        key TEXT,
        text TEXT NOT NULL,
        created REAL NOT NULL,
        embedder TEXT NOT NULL,
        vector BLOB NOT NULL)""",
    "CREATE INDEX memories_agent ON memories (agent, created)",
)

# Durable waits: timers (a row per pending `wait`, deleted when it fires or is
# cancelled), per-(listener, conversation) handler state, and approval gates (a row
# per parked message; kept after the decision, so a replayed decision finds it
# decided). IF NOT EXISTS: a database whose version was set back re-runs it.
_V3_DURABLE = (
    """CREATE TABLE IF NOT EXISTS timers (
        id TEXT PRIMARY KEY,
        conversation TEXT NOT NULL,
        frame TEXT NOT NULL,
        listener TEXT NOT NULL,
        due REAL NOT NULL,
        note TEXT NOT NULL,
        hops INTEGER NOT NULL,
        created REAL NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS timers_due ON timers (due)",
    """CREATE TABLE IF NOT EXISTS handler_state (
        listener TEXT NOT NULL,
        conversation TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (conversation, listener, key))""",
    """CREATE TABLE IF NOT EXISTS approvals (
        id TEXT PRIMARY KEY,
        conversation TEXT NOT NULL,
        frame TEXT NOT NULL,
        owner TEXT NOT NULL,
        listener TEXT NOT NULL,
        sender TEXT NOT NULL,
        hops INTEGER NOT NULL,
        envelope BLOB NOT NULL,
        payload BLOB NOT NULL,
        payload_sha256 TEXT NOT NULL,
        approvers TEXT NOT NULL,
        created REAL NOT NULL,
        deadline REAL NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'approved', 'denied', 'expired',
                                             'cancelled')),
        decided_by TEXT,
        reason TEXT,
        decided_at REAL)""",
    "CREATE INDEX IF NOT EXISTS approvals_pending ON approvals (state, deadline)",
)

# The outcome of the writer's last batch: every batch the kernel sends numbers its
# transactions in sending order (the writer commits in that order), and each commit
# that could not be written twice records in `head.txn` the number of the last
# transaction it made durable;
# `rejected_txns` holds the numbers of transactions the database refused on their own.
# When the writer process dies with batches in flight, the next writer reads both and
# the kernel resolves each of those transactions exactly: committed, rejected, or
# sent again (`Kernel._settle_orphans`).
_V4_OUTCOMES = (
    "ALTER TABLE head ADD COLUMN txn INTEGER NOT NULL DEFAULT 0",
    "CREATE TABLE IF NOT EXISTS rejected_txns (txn INTEGER PRIMARY KEY)",
)

# The bus's authentication state per client (JSON: last TOTP step, lockout, session
# token hashes), so that on PostgreSQL a standby that takes over knows the sessions
# and used codes of its primary.
_V5_BUS_AUTH = (
    "CREATE TABLE IF NOT EXISTS bus_auth (client TEXT PRIMARY KEY, state TEXT NOT NULL)",
)

# Model-text streams that sent a client a partial and have not ended: after a crash
# each is told to its client as interrupted (a `final` in its outbox).
_V6_STREAMS = (
    "CREATE TABLE IF NOT EXISTS streams (id TEXT PRIMARY KEY, client TEXT NOT NULL, "
    "thread TEXT NOT NULL, last_seq INTEGER NOT NULL)",
)

# The threads table rebuilt with its state CHECK as comparisons: SQLite evaluates
# `state IN ('active', 'completed', 'failed')` by building a temporary b-tree of the
# three values for every row written, an eighth of the writer's instructions per
# request/answer pair. Same columns, same index, same rows.
_V7_THREADS_CHECK = (
    """CREATE TABLE threads_v7 (
        uuid TEXT PRIMARY KEY,
        path TEXT NOT NULL,
        parent TEXT,
        owner TEXT NOT NULL,
        profile TEXT NOT NULL,
        table_version INTEGER NOT NULL,
        state TEXT NOT NULL
            CHECK (state = 'active' OR state = 'completed' OR state = 'failed'),
        created REAL NOT NULL,
        updated REAL NOT NULL,
        hops INTEGER NOT NULL)""",
    "INSERT INTO threads_v7 (uuid, path, parent, owner, profile, table_version, state, "
    "created, updated, hops) SELECT uuid, path, parent, owner, profile, table_version, "
    "state, created, updated, hops FROM threads",
    "DROP TABLE threads",
    "ALTER TABLE threads_v7 RENAME TO threads",
    "CREATE INDEX threads_state ON threads (state, updated)",
)

# The caller's reference of the call a frame runs, and of a parked call: every
# message back about that call carries it, also after a restart (pump/message.py).
_V8_CALL_REFS = (
    "ALTER TABLE threads ADD COLUMN call_ref TEXT NOT NULL DEFAULT ''",
    "ALTER TABLE approvals ADD COLUMN call_ref TEXT NOT NULL DEFAULT ''",
)

# The threads index serves the thread GC alone (finished threads last updated before
# a cutoff): as an index of finished threads only, the row of a thread that starts
# (active) adds no entry to it, and a batch of new conversations touches one b-tree
# less. The GC asks `state != 'active'`, the index's own condition, so both SQLite
# and PostgreSQL use it; the CHECK leaves 'completed' and 'failed' as the others.
_V9_FINISHED_THREADS = (
    "DROP INDEX IF EXISTS threads_state",
    "CREATE INDEX IF NOT EXISTS threads_finished ON threads (updated) "
    "WHERE state != 'active'",
)

MIGRATIONS: dict[int, tuple[str, ...]] = {1: _V1, 2: _V2_CONTEXT, 3: _V3_DURABLE,
                                          4: _V4_OUTCOMES, 5: _V5_BUS_AUTH, 6: _V6_STREAMS,
                                          7: _V7_THREADS_CHECK, 8: _V8_CALL_REFS,
                                          9: _V9_FINISHED_THREADS}


def is_postgres(conn: Any) -> bool:
    return getattr(conn, "dialect", "sqlite") == "postgres"


def code_version() -> int:
    return max(MIGRATIONS)


def read_version(conn: Any) -> int | None:
    """The database's schema version; None for an empty database."""
    if is_postgres(conn):
        from agentd.kernel._postgres import table_names  # psycopg: an optional extra
        names = table_names(conn) - {"lease"}  # taken before migrating (_postgres)
    else:
        names = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
    if "schema_version" in names:
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        return int(row[0]) if row else 0
    if names:
        raise SchemaTooNew("the database has tables but no schema_version: not an agentd "
                           "database (or one from an unknown version)")
    return None


def too_new_message(db: Path | str, found: int) -> str:
    return (f"{db}: database schema version {found} is newer than this agentd supports "
            f"(version {code_version()}); run a newer agentd, or point state_dir elsewhere")


def migrate(conn: Any, db: Path | str) -> tuple[int, int]:
    """Bring the database to `code_version()`; returns (from_version, to_version).
    `conn`: a sqlite3 connection, or a `PgConnection` (the same statements in
    PostgreSQL's types; two daemons starting at once migrate one after the other)."""
    postgres = is_postgres(conn)
    if postgres:
        from agentd.kernel._postgres import MIGRATION_LOCK_KEY, ddl
    conn.execute("BEGIN" if postgres else "BEGIN IMMEDIATE")
    try:
        if postgres:
            conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK_KEY,))
        found = read_version(conn)
        target = code_version()
        if found is not None and found > target:
            raise SchemaTooNew(too_new_message(db, found))
        start = 0 if found is None else found
        for version in range(start + 1, target + 1):
            for statement in MIGRATIONS[version]:
                conn.execute(ddl(statement) if postgres else statement)
            if version == 1:
                conn.execute("INSERT INTO schema_version VALUES (1)")
            else:
                conn.execute("UPDATE schema_version SET version = ?", (version,))
        conn.execute("COMMIT")
    except BaseException:
        if postgres:
            conn.rollback()
        elif conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return start, target
