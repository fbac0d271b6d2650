"""The lease on the postgres backend: one writer per organism at a time. Each test
tries to get a second writer, or a write after a takeover, into the journal."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agentd.bus import current_totp
from agentd.client import BusClient, frame_kind
from agentd.kernel import Kernel, KernelUnavailable, LeaseHeld
from agentd.kernel._store import verify_postgres
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.organisms.tally import LISTENER as TALLY
from tests.organisms.tally import Tally

ROOT = Path(__file__).resolve().parent.parent


async def journal(kernel: Kernel, name: str, n: int) -> list[int]:
    seqs = []
    for _ in range(n):
        tx = kernel.transaction()
        seqs.append(tx.journal(thread=name, direction="in", handler="h", sender=name,
                               tag="{urn:t}m", payload=b"<m/>", profile="public"))
        await kernel.commit(tx)
    return seqs


def senders(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            "SELECT seq, sender FROM journal ORDER BY pos")]


async def test_a_commit_after_another_daemon_took_over_is_refused_and_writes_nothing(
        tmp_path: Path, postgres_db: str) -> None:
    lost: list[str] = []
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org") as k:
        k.on_lease_lost = lost.append
        assert k.lease_epoch == 1
        await journal(k, "a", 3)
        with psycopg.connect(postgres_db, autocommit=True) as conn:  # another took over
            conn.execute("UPDATE lease SET epoch = epoch + 1 WHERE organism = 'org'")
        with pytest.raises(KernelUnavailable, match="lease lost"):
            await journal(k, "a", 1)
        assert len(lost) == 1 and "stale lease epoch 1" in lost[0]
        with pytest.raises(KernelUnavailable, match="lease"):  # and never again
            await journal(k, "a", 1)
    assert [s for _, s in senders(postgres_db)] == ["a"] * 3
    assert verify_postgres(postgres_db).ok


async def test_a_renewal_finds_a_takeover_while_idle(
        tmp_path: Path, postgres_db: str) -> None:
    lost = asyncio.Event()
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org",
                                 lease_interval_s=0.1) as k:
        k.on_lease_lost = lambda _why: lost.set()
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            conn.execute("UPDATE lease SET epoch = epoch + 1 WHERE organism = 'org'")
        async with asyncio.timeout(10):
            await lost.wait()  # no commit needed: the next renewal finds out


async def test_a_second_daemon_is_refused_and_told_who_holds_the_lease(
        tmp_path: Path, postgres_db: str) -> None:
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org"):
        with pytest.raises(LeaseHeld) as caught:
            await Kernel.open(tmp_path / "b", dsn=postgres_db, lease="org")
    message = str(caught.value)
    assert f"pid {os.getpid()}" in message and "(epoch 1)" in message
    assert "--standby" in message


async def test_a_standby_takes_over_when_the_holder_closes_and_the_chain_goes_on(
        tmp_path: Path, postgres_db: str) -> None:
    a = await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org")
    await journal(a, "a", 3)
    standby = asyncio.create_task(
        Kernel.open(tmp_path / "b", dsn=postgres_db, lease="org", standby=True))
    await asyncio.sleep(0.5)
    assert not standby.done()  # it waits while the lease is held
    await a.close()
    async with asyncio.timeout(10):
        b = await standby
    async with b:
        assert b.lease_epoch == 2
        await journal(b, "b", 3)
    assert [s for _, s in senders(postgres_db)] == ["a"] * 3 + ["b"] * 3
    assert verify_postgres(postgres_db).ok


async def test_a_dropped_connection_with_nobody_taking_over_keeps_the_lease(
        tmp_path: Path, postgres_db: str) -> None:
    """A PostgreSQL restart, for this daemon: its session is gone, nobody took the
    lease meanwhile, so its next writer reclaims the same epoch and goes on."""
    lost: list[str] = []
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org") as k:
        k.on_lease_lost = lost.append
        await journal(k, "a", 2)
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = current_database() AND pid != pg_backend_pid()")
        # A commit that meets the dead session may be refused unacknowledged (the
        # kernel's "writes are failing"); the caller tries again, as the pump's client
        # would. Either way the lease is kept and nothing acknowledged is lost.
        async with asyncio.timeout(30):
            done = 0
            while done < 2:
                try:
                    await journal(k, "a", 1)
                    done += 1
                except KernelUnavailable:
                    await asyncio.sleep(0.1)  # the writer's backoff, then again
        assert not lost and k.writer_restarts <= 1
    with psycopg.connect(postgres_db) as conn:
        assert conn.execute("SELECT epoch FROM lease").fetchone() == (1,)
    assert len(senders(postgres_db)) == 4


async def test_transactions_queued_while_the_writer_reconnects_are_committed_not_failed(
        tmp_path: Path, postgres_db: str) -> None:
    """The server ends the writer's session (pg_terminate_backend from another
    connection) and refuses new ones for a moment: the transactions queued meanwhile
    wait for a writer while the lease is current, and the one that connects reclaims
    the same epoch and commits them; none fails unacknowledged."""
    lost: list[str] = []
    name = conninfo_to_dict(postgres_db)["dbname"]
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="org") as k:
        k.on_lease_lost = lost.append
        await journal(k, "a", 2)
        with psycopg.connect(make_conninfo(postgres_db, dbname="postgres"),
                             autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = %s", (name,))
            commits = []
            for n in range(20):
                tx = k.transaction()
                tx.journal(thread=f"q{n}", direction="in", handler="h", sender="a",
                           tag="{urn:t}m", payload=b"<m/>", profile="public")
                commits.append(k.commit(tx))
            async with asyncio.timeout(30):  # until a new writer was refused
                while "not currently accepting connections" not in k.last_error:
                    await asyncio.sleep(0.01)
            conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        async with asyncio.timeout(30):
            results = await asyncio.gather(*commits, return_exceptions=True)
        assert [r for r in results if r is not None] == []
        assert not lost and k.writer_restarts == 1
    with psycopg.connect(postgres_db) as conn:
        assert conn.execute("SELECT epoch FROM lease").fetchone() == (1,)
    assert len(senders(postgres_db)) == 22
    assert verify_postgres(postgres_db).ok


class Child:
    """tests/lease_kernel.py in a process of its own; its output lines, as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, dsn: str, state_dir: Path, name: str, *extra: str) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.lease_kernel", dsn, str(state_dir), name, *extra,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(line.decode().strip())
            self._new.set()
        self._new.set()

    async def wait_for(self, prefix: str, count: int = 1) -> None:
        while sum(1 for line in self.lines if line.startswith(prefix)) < count:
            if self._reader.done():
                raise AssertionError(f"exited without {prefix!r}: {self.lines}")
            self._new.clear()
            await self._new.wait()

    def acknowledged(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("ok ")]

    def kill(self) -> None:
        if self.proc.returncode is None:
            with_stopped = [signal.SIGCONT, signal.SIGKILL]
            for sig in with_stopped:
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    break


async def test_a_paused_primary_resumed_after_the_takeover_commits_nothing(
        tmp_path: Path, postgres_db: str) -> None:
    a = await Child.start(postgres_db, tmp_path / "a", "a")
    b: Child | None = None
    try:
        async with asyncio.timeout(60):
            await a.wait_for("ready")
            await a.wait_for("ok ", 10)
            b = await Child.start(postgres_db, tmp_path / "b", "b", "--standby")
            await asyncio.sleep(0.5)
            assert not any(line.startswith("ready") for line in b.lines)
            os.kill(a.proc.pid, signal.SIGSTOP)
            paused = time.monotonic()
            await b.wait_for("ready")
            takeover = time.monotonic() - paused
            await b.wait_for("ok ", 10)
            os.kill(a.proc.pid, signal.SIGCONT)
            status = await a.proc.wait()
            await b.wait_for("ok ", 20)
        print(f"takeover {takeover:.2f} s after the primary was paused")
        assert status == 3 and any(line.startswith("lost") for line in a.lines)
        assert "ready 2" in b.lines
        rows = senders(postgres_db)
        first_b = next(i for i, (_, sender) in enumerate(rows) if sender == "b")
        assert all(sender == "b" for _, sender in rows[first_b:])  # none of a's after
        seqs = {seq for seq, _ in rows}
        assert set(a.acknowledged()) <= seqs and set(b.acknowledged()) <= seqs
        verdict = verify_postgres(postgres_db)
        assert verdict.ok, verdict.message
    finally:
        a.kill()
        if b is not None:
            b.kill()
            await b.proc.wait()
        await a.proc.wait()


async def test_a_daemon_that_lost_its_lease_stops_serving_and_exits_non_zero(
        tmp_path: Path, postgres_db: str, daemons: list[DaemonProcess]) -> None:
    home = tmp_path / "home"
    make_home(home)
    edit_config(home, lambda doc: doc.update(kernel={"backend": "postgres",
                                                     "dsn": postgres_db}))
    daemon = DaemonProcess(home)
    daemons.append(daemon)
    await daemon.start()
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        assert conn.execute("SELECT organism, epoch FROM lease").fetchall() == [
            (yaml.safe_load((home / "organism.yaml").read_text())["organism"]["name"], 1)]
        conn.execute("UPDATE lease SET epoch = epoch + 1")  # another daemon took over
    assert await daemon.wait(timeout=30) == 3
    assert any("lease lost" in line for line in daemon.log)
    host, port = daemon.url.removeprefix("wss://").split("/")[0].rsplit(":", 1)
    with pytest.raises(OSError):  # its bus is closed
        socket.create_connection((host, int(port)), timeout=2).close()


async def test_a_daemon_whose_lease_expired_by_its_own_clock_starts_no_handler(
        tmp_path: Path, postgres_db: str, daemons: list[DaemonProcess]) -> None:
    """Its writer stuck (here: stopped), no renewal for three lease intervals: a
    standby may have the lease by now, so a message that comes in waits for the next
    renewal before its handler runs (and runs once that comes: nobody took over)."""
    home = tmp_path / "home"
    make_home(home, extra_listeners=[TALLY])
    edit_config(home, lambda doc: doc.update(kernel={"backend": "postgres",
                                                     "dsn": postgres_db}))
    runs = tmp_path / "runs"
    daemon = DaemonProcess(home, env={"AGENTD_TEST_RUNS": str(runs)})
    daemons.append(daemon)
    await daemon.start()
    assert daemon.proc is not None
    code, doc = await asyncio.to_thread(daemon.agentctl, "status")
    assert code == 0, doc
    writer = int(doc["result"]["status"]["kernel_writer_pid"])
    async with BusClient(daemon.url, "alice", totp=current_totp(daemon.secret),
                         cafile=daemon.cafile) as bus:
        mark = len(daemon.log)
        os.kill(writer, signal.SIGSTOP)
        try:
            await daemon.wait_for_line("no handler starts until it is", after=mark)
            await bus.send(Tally(n=1))
            await daemon.wait_for_line("a handler waits for the lease", after=mark)
            assert not runs.exists()  # the handler did not run
        finally:
            os.kill(writer, signal.SIGCONT)
        await daemon.wait_for_line("lease renewed; handlers start again", after=mark)
        async with asyncio.timeout(30):
            while frame_kind(await bus.recv())[1] != "done":
                pass
    assert runs.read_text().split() == [str(daemon.proc.pid), "1"]
    assert await daemon.stop() == 0
