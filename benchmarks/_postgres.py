"""The postgres arm of the kernel benchmarks (journal.py, peers.py): where its
database comes from, and how many round trips to PostgreSQL a committed batch takes.

The server: the one `.ci/run` started (its DSN in AGENTD_TEST_POSTGRES_DSN), else a
throwaway cluster of the tests' own (tests/postgres_cluster.py) where the server
binaries are installed; else the arm is skipped and the JSON says why. Each run gets
a new database, dropped after.

Round trips: the writer's own code (`Store` over `PgConnection`, the lease's fence
included) writes batches of one-entry transactions on a connection traced by libpq
(PQtrace); every round trip ends with the server's ReadyForQuery, so their count per
batch is read from the trace, not assumed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_DSN = "AGENTD_TEST_POSTGRES_DSN"


@contextlib.contextmanager
def database() -> Iterator[str | None]:
    """The DSN of a new, empty database (dropped at the end), or None: no server."""
    with _server() as server:
        if server is None:
            yield None
            return
        import psycopg
        from psycopg.conninfo import make_conninfo

        name = f"agentd_bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(server, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        try:
            yield make_conninfo(server, dbname=name)
        finally:
            with psycopg.connect(server, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextlib.contextmanager
def _server() -> Iterator[str | None]:
    if os.environ.get(ENV_DSN):
        yield os.environ[ENV_DSN]
        return
    try:
        import psycopg  # noqa: F401  (the optional extra)
    except ImportError:
        yield None
        return
    sys.path.insert(0, str(ROOT))
    from tests.postgres_cluster import cluster, server_bin

    if server_bin() is None:
        yield None
        return
    with cluster() as dsn:
        yield dsn


def skipped() -> str:
    return (f"no PostgreSQL: {ENV_DSN} unset and no server binaries (or psycopg) here")


def round_trips_per_batch(dsn: str, batches: int = 50, size: int = 10) -> float:
    """Round trips to the server per committed batch of `size` one-entry journal
    transactions, as the kernel's writer writes them (lease held: the fence rides
    along), over `batches` batches."""
    from agentd.kernel._store import Store
    from agentd.kernel._transaction import Transaction, TxContext, plan_batch

    store = Store.open_postgres(dsn, lease="bench-round-trips", holder="benchmark")
    try:
        ctx = TxContext(next_seq=store.head.seq + 1, next_outbox_id=store.head.outbox_id + 1)
        with tempfile.TemporaryFile() as trace:
            pgconn = store.conn.raw.pgconn
            pgconn.trace(trace.fileno())
            try:
                for b in range(batches):
                    txs = []
                    for i in range(size):
                        tx = Transaction(ctx)
                        tx.journal(thread=f"t{b}-{i}", direction="in", handler="h",
                                   sender="alice", tag="{urn:bench}m", payload=b"<m/>",
                                   profile="public", pending=True)
                        txs.append(tx.wire())
                    store.write(plan_batch(txs), store.head.txn + size)
            finally:
                pgconn.untrace()
            trace.seek(0)
            lines = trace.read().decode(errors="replace").splitlines()
    finally:
        store.close()
    # A trace line: [timestamp] TAB direction (F: client, B: server) TAB length TAB type
    ready = sum(1 for line in lines if "\tB\t" in f"\t{line}" and "\tReadyForQuery" in line)
    return ready / batches
