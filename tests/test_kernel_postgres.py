"""The postgres backend as an operator meets it: the `kernel` section, verify-journal
on either backend, and a server that drops the kernel's connection. The kernel's
contract itself runs on both backends in tests/test_kernel.py (`backend`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from agentd._errors import ConfigError
from agentd._wiring import kernel_dsn, kernel_options
from agentd.config import load_config_text
from agentd.kernel import Kernel
from agentd.kernel._postgres import translate

BASE = "organism: {name: pg}\n"


def config(tmp_path: Path, kernel: str):
    return load_config_text(BASE + kernel, base_dir=tmp_path)


@pytest.mark.parametrize(("kernel", "words"), [
    ("kernel: {backend: postgres}", "backend postgres needs dsn or dsn_file"),
    ("kernel: {backend: postgres, dsn: 'host=x', dsn_file: f}", "not both"),
    ("kernel: {dsn: 'host=x'}", "only for backend postgres"),
    ("kernel: {backend: mysql}", "kernel.backend"),
])
def test_a_kernel_section_that_names_no_database_or_two_is_refused(
        tmp_path: Path, kernel: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, kernel)
    assert words in str(caught.value)


def test_the_dsn_comes_from_the_config_or_its_file_and_sqlite_needs_none(
        tmp_path: Path) -> None:
    assert kernel_options(config(tmp_path, "")).dsn is None
    assert kernel_dsn(config(tmp_path, "kernel: {backend: postgres, dsn: 'host=/x'}")
                      ) == "host=/x"
    (tmp_path / "dsn").write_text("postgresql://agentd@db/agentd\n")
    (tmp_path / "dsn").chmod(0o644)
    loaded = config(tmp_path, "kernel: {backend: postgres, dsn_file: dsn}")
    with pytest.raises(ConfigError, match="readable or writable by group or others"):
        kernel_dsn(loaded)  # it holds a password
    (tmp_path / "dsn").chmod(0o600)
    loaded = config(tmp_path, "kernel: {backend: postgres, dsn_file: dsn}")
    assert kernel_options(loaded).dsn == "postgresql://agentd@db/agentd"
    (tmp_path / "dsn").write_text("\n")
    with pytest.raises(ConfigError, match="is empty; write the database's DSN"):
        kernel_dsn(loaded)
    (tmp_path / "dsn").unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        kernel_dsn(loaded)


def test_the_sqlite_dialect_becomes_postgresql() -> None:
    assert translate("DELETE FROM outbox WHERE client = ? AND id <= ?") == (
        "DELETE FROM outbox WHERE client = %s AND id <= %s")
    upsert = translate("INSERT OR REPLACE INTO memories (id, agent, key) VALUES (?, ?, ?)")
    assert upsert == ("INSERT INTO memories (id, agent, key) VALUES (%s, %s, %s) "
                      "ON CONFLICT (id) DO UPDATE SET agent = EXCLUDED.agent, "
                      "key = EXCLUDED.key")
    assert translate("INSERT OR IGNORE INTO rejected_txns VALUES (?)") == (
        "INSERT INTO rejected_txns VALUES (%s) ON CONFLICT DO NOTHING")


async def _journal(kernel: Kernel, n: int) -> list[int]:
    seqs = []
    for i in range(n):
        tx = kernel.transaction()
        seqs.append(tx.journal(thread=f"t{i}", direction="in", handler="echo",
                               sender="alice", tag="{urn:t}m", payload=b"<m/>",
                               profile="public", pending=True))
        await kernel.commit(tx)
    return seqs


def _verify(config_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentd.cli", "verify-journal", "--config",
                           str(config_file)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["sqlite", "postgres"])
async def test_verify_journal_with_a_config_checks_the_backend_it_names(
        tmp_path: Path, name: str, request: pytest.FixtureRequest) -> None:
    dsn = request.getfixturevalue("postgres_db") if name == "postgres" else None
    kernel_line = f"kernel: {{backend: postgres, dsn: '{dsn}'}}\n" if dsn else ""
    config_file = tmp_path / "organism.yaml"
    config_file.write_text(BASE + kernel_line)
    async with await Kernel.open(tmp_path / "state", dsn=dsn) as k:
        seqs = await _journal(k, 3)
    done = _verify(config_file)
    assert done.returncode == 0, done.stderr
    assert "journal OK: 3 entries" in done.stdout
    sql = "UPDATE journal SET handler = 'evil' WHERE seq = %s"
    if dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql, (seqs[1],))
    else:
        import sqlite3
        with sqlite3.connect(tmp_path / "state" / "agentd.db") as conn:
            conn.execute(sql.replace("%s", "?"), (seqs[1],))
    done = _verify(config_file)
    assert done.returncode == 1 and "FAILED at seq" in done.stdout


def test_verify_journal_says_what_is_wrong_with_an_unreachable_database(
        tmp_path: Path) -> None:
    config_file = tmp_path / "organism.yaml"
    config_file.write_text(BASE + f"kernel: {{backend: postgres, dsn: 'host={tmp_path}'}}\n")
    done = _verify(config_file)
    assert done.returncode == 1
    assert "postgresql: cannot connect" in done.stderr


async def test_a_dropped_connection_replaces_the_writer_and_loses_nothing_acknowledged(
        tmp_path: Path, postgres_db: str) -> None:
    """The server ends the writer's session (as a restart or a network cut would):
    the writer process exits, the next one reads the head back, and the chain goes on
    unbroken with every acknowledged commit in it."""
    async with await Kernel.open(tmp_path / "state", dsn=postgres_db) as k:
        before = await _journal(k, 5)
        pid = k.writer_pid
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            killed = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid != pg_backend_pid()").fetchone()
        assert killed is not None and killed[0] >= 1
        async with asyncio.timeout(30):
            after = await _journal(k, 5)
        assert k.writer_pid != pid and k.writer_restarts == 1
        assert [e.seq for e in await k.pending_messages()] == before + after
        ok, _, message = await k.verify()
        assert ok and "10 entries" in message, message
