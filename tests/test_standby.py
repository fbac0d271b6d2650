"""`agentd run --standby` on the postgres backend: a second daemon of the same
organism waits for the lease (its OOB socket answers, its bus is closed) and takes
over when the primary dies, recovering as after `kill -9`. Real daemons, a real
PostgreSQL, a real client under load, the primary killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from agentd.bus import current_totp
from agentd.client import AuthenticationFailed, BusClient, BusError, Client, frame_kind
from agentd.kernel import Kernel
from agentd.kernel._store import verify_postgres
from tests.daemon_process import ROOT, DaemonProcess, edit_config, make_home
from tests.organisms.listeners import Done, Hold

_BUS = re.compile(r"bus listening url=(wss://[0-9.]+:\d+/bus)")


@pytest.fixture
def home(tmp_path: Path, postgres_db: str) -> Path:
    home = tmp_path / "home"
    make_home(home)
    edit_config(home, lambda doc: doc.update(kernel={"backend": "postgres",
                                                     "dsn": postgres_db}))
    return home


async def ctl(d: DaemonProcess, *args: str) -> Any:
    code, doc = await asyncio.to_thread(d.agentctl, *args)
    assert code == (0 if doc["ok"] else 1), doc
    return doc


def answers_committed(dsn: str) -> dict[str, int]:
    """Per thread, the answers (`done`) the organism committed to the client."""
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute(
            "SELECT thread, count(*) FROM journal WHERE direction = 'out' "
            "AND tag LIKE '%}done' GROUP BY thread").fetchall())


class Load:
    """One client sending `Hold` messages back to back: which threads were accepted
    and which were answered (an answer may come twice after a failover)."""

    def __init__(self) -> None:
        self.accepted: set[str] = set()
        self.answered: dict[str, int] = {}
        self.changed = asyncio.Event()

    async def read(self, bus: BusClient) -> None:
        try:
            while True:
                _, kind, thread = frame_kind(await bus.recv(timeout=60))
                if kind == "accepted":
                    self.accepted.add(thread)
                elif kind == "done":
                    self.answered[thread] = self.answered.get(thread, 0) + 1
                self.changed.set()
        except BusError:
            return

    async def send(self, bus: BusClient, first: int, count: int) -> None:
        before, sent = len(self.accepted), 0
        try:
            for n in range(first, first + count):
                await bus.send(Hold(n=n))
                sent += 1
                while len(self.accepted) - before + 50 < sent:  # at most 50 in flight
                    self.changed.clear()
                    await self.changed.wait()
        except BusError:
            return

    async def until(self, done: Any) -> None:
        while not done():
            self.changed.clear()
            await self.changed.wait()


async def primary_and_standby(home: Path, tmp_path: Path, daemons: list[DaemonProcess],
                              ) -> tuple[DaemonProcess, DaemonProcess]:
    """A primary serving, and a `--standby` of the same organism waiting for its lease
    (its OOB socket up, its bus closed)."""
    primary = DaemonProcess(home)
    daemons.append(primary)
    await primary.start()
    standby = DaemonProcess(home, args=("--standby", "--state-dir", str(tmp_path / "b")))
    daemons.append(standby)
    await standby.start(until=("socket",))
    return primary, standby

async def test_a_standby_takes_over_a_primary_killed_under_load_and_answers_every_accepted_message(
        home: Path, tmp_path: Path, postgres_db: str, daemons: list[DaemonProcess]) -> None:
    primary, standby = await primary_and_standby(home, tmp_path, daemons)

    # Waiting: its OOB socket says who holds the lease, its bus is closed.
    status = (await ctl(standby, "status"))["result"]["status"]
    assert status["kernel"]["role"] == "standby"
    assert status["kernel"]["backend"] == "postgres"
    assert status["kernel"]["lease"]["epoch"] == 1
    assert f"pid {primary.proc.pid}" in status["kernel"]["lease"]["holder"]
    assert not any(_BUS.search(line) for line in standby.log)
    refused = await ctl(standby, "journal")
    assert not refused["ok"] and "standby" in refused["error"]["message"]
    mine = (await ctl(primary, "status"))["result"]["status"]["kernel"]
    assert mine["role"] == "primary" and mine["lease"]["epoch"] == 1

    load = Load()
    code = current_totp(primary.secret)
    async with BusClient(primary.url, "alice", totp=code, cafile=primary.cafile) as bus:
        session = bus.session
        reader = asyncio.create_task(load.read(bus))
        sender = asyncio.create_task(load.send(bus, 0, 100_000))
        async with asyncio.timeout(60):
            await load.until(lambda: len(load.accepted) >= 200)
        killed = time.monotonic()
        await primary.stop(signal.SIGKILL)
        await asyncio.wait_for(reader, 30)  # the connection dropped
        sender.cancel()
    accepted_before = set(load.accepted)

    line = await standby.wait_for_line(_BUS.pattern, timeout=30)
    takeover = time.monotonic() - killed
    print(f"standby serving {takeover:.2f} s after the primary's kill -9 "
          f"({len(accepted_before)} messages accepted by the primary)")
    standby.url = _BUS.search(line).group(1)  # type: ignore[union-attr]
    mine = (await ctl(standby, "status"))["result"]["status"]["kernel"]
    assert mine["role"] == "primary" and mine["lease"]["epoch"] == 2

    # The sessions and used codes are in the kernel: the primary's code is spent here
    # too, and the client resumes with its session token (no TOTP secret at all).
    with pytest.raises(AuthenticationFailed):
        await BusClient(standby.url, "alice", totp=code, cafile=standby.cafile).connect()
    async with BusClient(standby.url, "alice", session=session,
                         cafile=standby.cafile) as bus:
        reader = asyncio.create_task(load.read(bus))
        async with asyncio.timeout(60):
            await load.send(bus, 1_000_000, 20)  # and it serves new messages
            await load.until(lambda: len(load.accepted) >= len(accepted_before) + 20
                             and load.accepted <= load.answered.keys())
        reader.cancel()

    async with Client.connect([primary.url, standby.url], "alice", session=session,
                              cafile=standby.cafile) as client:  # the first is gone
        assert client.url == standby.url
        assert await client.call(Hold(n=7), timeout=30) == Done(seq=7, by="hold")

    assert load.accepted <= load.answered.keys()  # every accepted message answered
    committed = answers_committed(postgres_db)
    assert {t: committed.get(t) for t in load.accepted} == dict.fromkeys(load.accepted, 1)
    verdict = verify_postgres(postgres_db)
    assert verdict.ok, verdict.message
    assert await standby.stop() == 0


async def test_a_waiting_standby_is_a_live_service_and_stops_giving_its_state_directory_back(
        home: Path, tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    """Under systemd a waiting standby is started (READY=1) and alive (watchdog
    pings: WatchdogSec would kill it otherwise); SIGTERM ends the wait."""
    primary = DaemonProcess(home)
    daemons.append(primary)
    await primary.start()
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    standby = DaemonProcess(home, args=("--standby", "--state-dir", str(tmp_path / "b")),
                            env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"})
    daemons.append(standby)
    await standby.start(until=("socket",))
    seen: list[str] = []
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(30):
            while seen.count("WATCHDOG=1") < 2:
                seen.extend((await loop.sock_recv(sock, 4096)).decode().splitlines())
    finally:
        sock.close()
    assert seen[:2] == ["READY=1", "STATUS=standby: waiting for the lease"]
    assert not any(_BUS.search(line) for line in standby.log)
    assert await standby.stop(signal.SIGTERM, timeout=20) == 0
    assert any("stopped while waiting for the lease" in line for line in standby.log)
    again = DaemonProcess(home, args=("--standby", "--state-dir", str(tmp_path / "b")))
    daemons.append(again)
    await again.start(until=("socket",))  # the state directory's lock was released
    assert await again.stop(signal.SIGTERM, timeout=20) == 0
    assert await primary.stop() == 0


async def test_standby_on_sqlite_is_refused_with_what_to_set(
        tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    home = tmp_path / "home"
    make_home(home)
    d = DaemonProcess(home, args=("--standby",))
    daemons.append(d)
    with pytest.raises(RuntimeError, match="backend: postgres"):
        await d.start()
    assert await d.wait() == 1
    assert not any(_BUS.search(line) for line in d.log)  # it never listened


async def check_config(home: Path, dsn: str) -> subprocess.CompletedProcess[str]:
    edit_config(home, lambda doc: doc.update(kernel={"backend": "postgres", "dsn": dsn}))
    return await asyncio.to_thread(
        subprocess.run,[sys.executable, "-m", "agentd.cli", "check-config",
                           str(home / "organism.yaml")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


async def test_check_config_reaches_the_database_and_says_what_is_wrong(
        tmp_path: Path, postgres_db: str) -> None:
    home = tmp_path / "home"
    make_home(home)
    done = await check_config(home, postgres_db)
    assert done.returncode == 0, done.stderr
    assert "kernel: database reachable; the lease of agent-demo was never taken" in done.stdout
    async with await Kernel.open(tmp_path / "a", dsn=postgres_db, lease="agent-demo") as k:
        done = await check_config(home, postgres_db)
        assert done.returncode == 0, done.stderr  # a held lease is not an error
        assert re.search(rf"lease held by \S+ pid {os.getpid()} since "
                         r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(epoch 1\)", done.stdout)
        assert k.lease_epoch == 1
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS agentd_nologin")
        conn.execute("CREATE ROLE agentd_nologin NOLOGIN")
    try:
        for dsn, words in [
            (make_conninfo(postgres_db, dbname="no_such_db"),
             'database "no_such_db" does not exist on that server: create it'),
            (make_conninfo(postgres_db, user="no_such_role"),
             'role "no_such_role" does not exist'),
            (make_conninfo(postgres_db, user="agentd_nologin"),
             "PostgreSQL refused the login"),
            (make_conninfo(postgres_db, host=str(tmp_path / "nowhere")),
             "cannot reach PostgreSQL"),
        ]:
            done = await check_config(home, dsn)
            assert done.returncode == 1 and "kernel.dsn: " + words in done.stderr, (
                dsn, done.stderr)
            assert "Traceback" not in done.stderr
    finally:
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            conn.execute("DROP ROLE agentd_nologin")


async def lock_waiters(conn: psycopg.AsyncConnection[Any]) -> int:
    """How many sessions of this database wait for a lock now."""
    cur = await conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                             "current_database() AND wait_event_type = 'Lock'")
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def test_a_login_is_committed_before_auth_ok_so_a_takeover_right_after_keeps_it(
        home: Path, tmp_path: Path, postgres_db: str, daemons: list[DaemonProcess]) -> None:
    """The session token a TOTP login opens is in the kernel before the client is told
    `auth-ok`: the primary killed the moment the client has it, the standby that takes
    over resumes that session. The kernel's commit is held back (the bus_auth table
    locked by another connection) to see the order: no `auth-ok` while it waits."""
    primary, standby = await primary_and_standby(home, tmp_path, daemons)

    bus = BusClient(primary.url, "alice", totp=current_totp(primary.secret),
                    cafile=primary.cafile)
    async with await psycopg.AsyncConnection.connect(postgres_db) as locker, \
            await psycopg.AsyncConnection.connect(postgres_db, autocommit=True) as watcher:
        await locker.execute("LOCK TABLE bus_auth IN EXCLUSIVE MODE")
        login = asyncio.create_task(bus.connect())
        async with asyncio.timeout(30):  # until the writer waits for the table
            while not await lock_waiters(watcher):
                await asyncio.sleep(0.01)
        assert not login.done(), "auth-ok was sent before the session was committed"
        await locker.rollback()
    await asyncio.wait_for(login, 30)
    session = bus.session
    assert session
    await primary.stop(signal.SIGKILL)  # the moment the client has its token
    await bus.close()

    line = await standby.wait_for_line(_BUS.pattern, timeout=30)
    standby.url = _BUS.search(line).group(1)  # type: ignore[union-attr]
    async with Client.connect([primary.url, standby.url], "alice", session=session,
                              cafile=standby.cafile) as client:
        assert client.url == standby.url
        assert await client.call(Hold(n=1), timeout=30) == Done(seq=1, by="hold")
    assert await standby.stop() == 0
