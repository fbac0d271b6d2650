"""What runs without a `Kernel`: `agentd verify-journal` (the hash chain walked
read-only, without the lock, safe while agentd runs) and the PostgreSQL checks of
`agentd check-config` and the standby (the lease, the database); psycopg is
imported only when one of them names a DSN."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from agentd.kernel._chain import Verdict
from agentd.kernel._errors import KernelUnavailable, SchemaTooNew
from agentd.kernel._schema import code_version, read_version, too_new_message
from agentd.kernel._store import readonly_uri, verify_file

DB_NAME = "agentd.db"


def read_lease(dsn: str, organism: str) -> tuple[str, int, float] | None:
    """(holder, epoch, since) of `organism`'s lease in the PostgreSQL database `dsn`,
    or None if nobody took it yet. Blocking; raises KernelUnavailable."""
    from agentd.kernel._postgres import read_lease as read  # psycopg: an optional extra

    return read(dsn, organism)


def check_database(dsn: str, organism: str) -> str:
    """One line on the PostgreSQL database `dsn` for `agentd check-config` (reachable,
    who holds `organism`'s lease); raises KernelUnavailable saying what is wrong."""
    from agentd.kernel._postgres import check_database as check  # an optional extra

    return check(dsn, organism)


def verify_journal_main(state_dir: Path | str, dsn: str | None = None) -> int:
    """`agentd verify-journal`: check the hash chain of `state_dir`'s journal (or of
    the PostgreSQL database `dsn` names) without taking the lock (read-only, one
    snapshot; safe while agentd runs). Prints the result; 0 if OK."""
    if dsn:
        return _verify_postgres_main(dsn)
    db = Path(state_dir) / DB_NAME
    if not db.exists():
        print(f"verify-journal: {db}: no such database", file=sys.stderr)
        return 1
    try:
        conn = sqlite3.connect(readonly_uri(db), uri=True)
        try:
            version = read_version(conn)
        finally:
            conn.close()
        if version is not None and version > code_version():
            raise SchemaTooNew(too_new_message(db, version))
        verdict = verify_file(db)
    except (sqlite3.Error, SchemaTooNew) as exc:
        print(f"verify-journal: {db}: {exc}", file=sys.stderr)
        return 1
    return _report(str(db), verdict)


def _verify_postgres_main(dsn: str) -> int:
    from agentd.kernel._postgres import PgConnection  # psycopg: an optional extra
    from agentd.kernel._store import verify_postgres

    try:
        conn = PgConnection.connect(dsn, pipeline=False)
        try:
            label = f"postgresql database {conn.raw.info.dbname}"
            version = read_version(conn)
        finally:
            conn.close()
        if version is not None and version > code_version():
            raise SchemaTooNew(too_new_message(label, version))
        if version is None:
            print(f"verify-journal: {label}: no agentd tables (nothing was written yet)",
                  file=sys.stderr)
            return 1
        verdict = verify_postgres(dsn)
    except (KernelUnavailable, SchemaTooNew) as exc:
        print(f"verify-journal: {exc}", file=sys.stderr)
        return 1
    return _report(label, verdict)


def _report(label: str, verdict: Verdict) -> int:
    """verify-journal's last line and exit code, whichever backend was walked."""
    if verdict.ok:
        print(f"{label}: {verdict.message}")
        return 0
    where = f" at seq {verdict.bad_seq}" if verdict.bad_seq is not None else ""
    print(f"{label}: journal verification FAILED{where}: {verdict.message}")
    return 1
