"""Failover as a user would run it: three hosts on this machine. One network
namespace runs PostgreSQL, two run the same organism (a primary and a `--standby`),
each behind its own veth link on a bridge (in a fourth namespace, the switch); the
test process is the client, on a fifth link, and knows both buses' URLs. Under a
steady load of conversations (a handler that writes down each of its runs, a relay
through the calculator, an agent on a scripted backend) the primary is killed, cut
off, paused, or PostgreSQL itself restarts; every accepted message must be answered,
its result committed once, and no handler run again for a result already committed.

Skipped with the reason where `ip netns` is not permitted (it needs root)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from agentd.bus._tls import make_self_signed
from agentd.client import Accepted, Answer, BusError, Client, Huh
from agentd.kernel._store import verify_postgres
from agentd.platform.demo import MathQuestion
from agentd.tools.calculator import Sum
from agentd.tools.relay import Relay
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.network_namespaces import ip, network
from tests.organisms.listeners import Done
from tests.organisms.tally import LISTENER as TALLY
from tests.organisms.tally import Tally
from tests.postgres_cluster import server_bin

_OCTET = os.getpid() % 200 + 20
SUBNET = f"10.234.{_OCTET}"
CLIENT, PG, HOST_A, HOST_B = (f"{SUBNET}.{n}" for n in (1, 2, 3, 4))
BUS_PORT = 8765
_TOOK = re.compile(r"took the lease \(epoch (\d+)\) after waiting \S+ s at journal seq (\d+)")
_QUESTION = "What is (2 + 3) * 7?"  # the demo cassette's conversation


@dataclass
class Hosts:
    """The namespaces, the links to cut and PostgreSQL's folder and command."""

    ns: dict[str, str]  # role (pg, a, b) -> namespace
    links: dict[str, str]  # role -> its end of its veth (inside its namespace)
    pg_root: Path
    pg_bin: Path

    def run_pg(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A server binary in the PostgreSQL host's namespace, as user postgres."""
        return subprocess.run(["ip", "netns", "exec", self.ns["pg"], "runuser", "-u",
                               "postgres", "--", *args], capture_output=True, text=True,
                              timeout=60)

    def link(self, role: str, state: str) -> None:
        done = ip("-n", self.ns[role], "link", "set", self.links[role], state)
        assert done.returncode == 0, done.stderr

    def database(self) -> str:
        """A new database on the PostgreSQL host; its DSN (over the veth)."""
        name = f"failover_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"postgresql://agentd@{PG}:5432/postgres", autocommit=True,
                             connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://agentd@{PG}:5432/{name}"


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces and a PostgreSQL server user need root")
    folder = server_bin()
    if folder is None:
        pytest.skip("no PostgreSQL 15+ server binaries (apt-get install postgresql-15)")
    with network(f"fo{os.getpid() % 100000}") as net:
        tag = net.tag
        ns = {role: net.namespace(role) for role in ("sw", "pg", "a", "b")}
        # The client's link: this (the root) namespace's end keeps its name.
        net.veth(f"{tag}c", f"{tag}cs", peer_ns=ns["sw"], address=f"{CLIENT}/24")
        links = {}
        for role, address in (("pg", PG), ("a", HOST_A), ("b", HOST_B)):
            end = links[role] = f"{tag}{role}0"
            net.veth(end, f"{tag}{role}s", ns=ns[role], peer_ns=ns["sw"],
                     address=f"{address}/24")
        net.bridge(ns["sw"], "br0", [f"{tag}cs", f"{tag}pgs", f"{tag}as", f"{tag}bs"])
        root = Path(tempfile.mkdtemp(prefix="agentd-failover-pg-"))
        try:
            made_hosts = Hosts(ns, links, root, folder)
            os.chown(root, *_postgres_ids())
            data = root / "data"
            done = made_hosts.run_pg(str(folder / "initdb"), "-D", str(data), "-U", "agentd",
                                     "-A", "trust", "-E", "UTF8", "--no-sync",
                                     "--no-instructions")
            assert done.returncode == 0, done.stderr
            with open(data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {SUBNET}.0/24 trust\n")
            done = made_hosts.run_pg(
                str(folder / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "-o",
                f"-k {root} -c listen_addresses={PG} -c fsync=off -c max_connections=100",
                "start")
            assert done.returncode == 0, done.stderr + (root / "log").read_text()
            try:
                yield made_hosts
            finally:
                made_hosts.run_pg(str(folder / "pg_ctl"), "-D", str(data), "-m", "immediate",
                                  "-w", "stop")
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _postgres_ids() -> tuple[int, int]:
    import pwd

    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


@dataclass
class Organism:
    home: Path
    dsn: str
    runs: Path  # the tally handler's runs: "PID N" lines
    primary: DaemonProcess
    standby: DaemonProcess

    @property
    def urls(self) -> list[str]:
        return [f"wss://{HOST_A}:{BUS_PORT}/bus", f"wss://{HOST_B}:{BUS_PORT}/bus"]


@pytest.fixture
async def organism(hosts: Hosts, tmp_path: Path,
                   daemons: list[DaemonProcess]) -> Organism:
    """The same organism.yaml on hosts a (the primary) and b (the standby)."""
    dsn = hosts.database()
    home = tmp_path / "home"
    make_home(home, extra_listeners=[TALLY])
    # One certificate the operator made for both hosts' addresses.
    for name in ("cert.pem", "key.pem"):
        (home / "tls" / name).unlink()
    make_self_signed(home / "tls" / "cert.pem", home / "tls" / "key.pem",
                     [HOST_A, HOST_B])

    def edit(doc: dict[str, Any]) -> None:
        doc["kernel"] = {"backend": "postgres", "dsn": dsn}
        doc["bus"]["host"] = "0.0.0.0"
        doc["bus"]["port"] = BUS_PORT

    edit_config(home, edit)
    runs = tmp_path / "runs"
    env = {"AGENTD_TEST_RUNS": str(runs)}
    primary = DaemonProcess(home, env=env, wrapper=("ip", "netns", "exec", hosts.ns["a"]),
                            args=("--state-dir", str(tmp_path / "a")))
    daemons.append(primary)
    await primary.start()
    standby = DaemonProcess(home, env=env, wrapper=("ip", "netns", "exec", hosts.ns["b"]),
                            args=("--standby", "--state-dir", str(tmp_path / "b")))
    daemons.append(standby)
    await standby.start(until=("socket",))
    return Organism(home, dsn, runs, primary, standby)


@dataclass
class Load:
    """Conversations sent back to back by a few workers through one `Client` that
    knows both URLs: which threads were accepted, which answered (and how often),
    and what each was."""

    client: Client
    accepted: set[str] = field(default_factory=set)
    answered: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    tally: dict[str, int] = field(default_factory=dict)  # thread -> the Tally's n
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    stopping: bool = False
    _n: itertools.count[int] = field(default_factory=itertools.count)
    _followers: set[asyncio.Task[None]] = field(default_factory=set)

    async def worker(self) -> None:
        while not self.stopping:
            n = next(self._n)
            payload: Any
            expected: Any
            if n % 10 == 9:
                payload, expected = MathQuestion(text=_QUESTION), None
            elif n % 3 == 1:
                payload, expected = Relay(a=n, b=1), Sum(value=n + 1)
            else:
                payload, expected = Tally(n=n), Done(seq=n, by="tally")
            try:
                exchange = await self.client.start(payload, timeout=120)
            except BusError:  # between a drop and the resumed session
                await self._pause()
                continue
            if isinstance(payload, Tally):
                self.tally[exchange.thread] = n
            # The next message once this one is accepted; one lost with a dropped
            # connection (never accepted) is given up after a while, but still heard.
            moved_on = asyncio.Event()
            follower = asyncio.create_task(self._follow(exchange, expected, moved_on))
            self._followers.add(follower)
            follower.add_done_callback(self._followers.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(moved_on.wait(), 5)

    async def _follow(self, exchange: Any, expected: Any, moved_on: asyncio.Event) -> None:
        try:
            async for event in exchange.events():
                if isinstance(event, Accepted):
                    self.accepted.add(exchange.thread)
                elif isinstance(event, Answer):
                    self.answered[exchange.thread] += 1
                    if expected is not None and event.payload != expected:
                        self.wrong.append(f"{expected!r} -> {event.payload!r}")
                    elif expected is None and "35" not in (event.text or ""):
                        self.wrong.append(f"tutor -> {event.text!r}")
                moved_on.set()
                self.changed.set()
        except (Huh, BusError, TimeoutError):
            moved_on.set()  # refused, or never accepted: not counted

    async def stop(self) -> None:
        for task in list(self._followers):
            task.cancel()
        await asyncio.gather(*self._followers, return_exceptions=True)

    async def _pause(self) -> None:
        """Wait for the next event of any call, at most a moment (the client is
        resuming its session meanwhile)."""
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), 0.1)

    async def until(self, done: Any, timeout: float = 90) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                self.changed.clear()
                await self.changed.wait()

    def answered_accepted(self) -> bool:
        return self.accepted <= self.answered.keys()


async def run_load(organism: Organism, fault: Any, *, workers: int = 6) -> tuple[Load, Any]:
    """Start the load, let `fault()` happen once some messages are accepted, wait for
    the organism to serve again and answer every accepted message; the fault's
    result."""
    secret = organism.primary.secret
    client = Client.connect(organism.urls, "alice", secret=secret, cafile=organism.primary.cafile,
                            open_timeout=2)
    await client.open()
    load = Load(client)
    tasks = [asyncio.create_task(load.worker()) for _ in range(workers)]
    try:
        await load.until(lambda: len(load.answered) >= 60)
        before = len(load.answered)
        result = await fault(load)
        await load.until(lambda: len(load.answered) >= before + 60)
        load.stopping = True
        await load.until(load.answered_accepted)
    except BaseException:
        print(f"accepted {len(load.accepted)}, answered {len(load.answered)}, "
              f"unanswered {len(load.accepted - load.answered.keys())}, client at "
              f"{client.url}")
        for daemon in (organism.primary, organism.standby):
            print("".join(daemon.log[-30:]))
        raise
    finally:
        load.stopping = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await load.stop()
        await client.aclose()
    return load, result


def committed_answers(dsn: str, threads: set[str]) -> dict[str, list[int]]:
    """Per client thread, the journal seqs of the answers committed to the client."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT thread, seq FROM journal WHERE direction = 'out' AND thread = ANY(%s) "
            "AND (tag LIKE '%%}done' OR tag LIKE '%%}sum' OR tag LIKE '%%}answer')",
            (list(threads),)).fetchall()
    found: dict[str, list[int]] = {}
    for thread, seq in rows:
        found.setdefault(thread, []).append(seq)
    return found


def check_exactly_once(organism: Organism, load: Load, takeover_seq: int | None) -> None:
    """Every accepted message answered, its answer committed once, the results right,
    and (after a takeover) no tally run by the new primary for a message whose answer
    the old one had committed."""
    assert not load.wrong, load.wrong[:5]
    assert load.answered_accepted()
    threads = load.accepted | load.answered.keys()
    committed = committed_answers(organism.dsn, threads)
    twice = {t: seqs for t, seqs in committed.items() if len(seqs) != 1}
    missing = threads - committed.keys()
    assert not twice and not missing, (twice, missing)
    verdict = verify_postgres(organism.dsn)
    assert verdict.ok, verdict.message
    if takeover_seq is None:
        return
    assert organism.standby.proc is not None and organism.primary.proc is not None
    runs = [tuple(map(int, line.split())) for line in organism.runs.read_text().splitlines()]
    by_standby = {n for pid, n in runs if pid == organism.standby.proc.pid}
    old = {n for thread, n in load.tally.items()
           if thread in committed and committed[thread][0] <= takeover_seq}
    assert old and by_standby, (len(old), len(by_standby))  # both served some
    assert not old & by_standby, sorted(old & by_standby)[:10]
    counts = Counter(n for _, n in runs)
    print(f"{len(threads)} conversations answered, {len(old)} tally results committed "
          f"by the old primary; tally runs: {sum(counts.values())} for {len(counts)} "
          f"messages ({sum(1 for c in counts.values() if c > 1)} run twice, each result "
          "committed by the new primary)")


async def takeover(standby: DaemonProcess, since: float) -> tuple[float, int]:
    """Wait for the standby to serve: (seconds since `since`, the journal seq the old
    primary had committed up to)."""
    await standby.wait_for_line(r"bus listening url=", timeout=60)
    seconds = time.monotonic() - since
    line = next(line for line in standby.log if _TOOK.search(line))
    match = _TOOK.search(line)
    assert match is not None and match.group(1) == "2"
    return seconds, int(match.group(2))


async def test_the_primary_killed_under_load_the_standby_serves_and_answers_each_accepted_once(
        organism: Organism) -> None:
    async def kill(load: Load) -> tuple[float, int]:
        since = time.monotonic()
        await organism.primary.stop(signal.SIGKILL)
        return await takeover(organism.standby, since)

    load, (seconds, seq) = await run_load(organism, kill)
    print(f"kill -9: the standby served {seconds:.2f} s after the kill")
    check_exactly_once(organism, load, seq)
    assert await organism.standby.stop() == 0


async def test_the_primary_cut_off_the_standby_serves_and_the_old_primary_exits_when_back(
        organism: Organism, hosts: Hosts) -> None:
    async def cut(load: Load) -> tuple[float, int]:
        since = time.monotonic()
        hosts.link("a", "down")
        return await takeover(organism.standby, since)

    try:
        load, (seconds, seq) = await run_load(organism, cut)
        print(f"veth down: the standby served {seconds:.2f} s after the cut")
        assert organism.primary.proc is not None and organism.primary.proc.returncode is None
    finally:
        hosts.link("a", "up")
    # Back on the network: its lease is gone, it commits nothing and exits non-zero.
    assert await organism.primary.wait(timeout=60) == 3
    assert any("lease lost" in line for line in organism.primary.log)
    check_exactly_once(organism, load, seq)
    assert await organism.standby.stop() == 0


async def test_the_primary_paused_past_the_takeover_commits_nothing_when_resumed(
        organism: Organism) -> None:
    assert organism.primary.proc is not None
    pid = organism.primary.proc.pid

    async def pause(load: Load) -> tuple[float, int]:
        since = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        return await takeover(organism.standby, since)

    try:
        load, (seconds, seq) = await run_load(organism, pause)
        print(f"SIGSTOP: the standby served {seconds:.2f} s after the pause")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await organism.primary.wait(timeout=60) == 3
    check_exactly_once(organism, load, seq)
    assert await organism.standby.stop() == 0


async def test_a_postgresql_restart_under_load_loses_nothing_and_neither_daemon_exits(
        organism: Organism, hosts: Hosts) -> None:
    async def restart(load: Load) -> None:
        done = await asyncio.to_thread(
            hosts.run_pg, str(hosts.pg_bin / "pg_ctl"), "-D", str(hosts.pg_root / "data"),
            "-m", "fast", "-w", "-l", str(hosts.pg_root / "log"), "restart")
        assert done.returncode == 0, done.stderr

    load, _ = await run_load(organism, restart)
    check_exactly_once(organism, load, None)
    for daemon in (organism.primary, organism.standby):
        assert daemon.proc is not None and daemon.proc.returncode is None, "".join(
            daemon.log[-20:])
    with psycopg.connect(organism.dsn) as conn:  # nobody took over
        assert conn.execute("SELECT epoch FROM lease").fetchall() == [(1,)]
    assert not any(_TOOK.search(line) for line in organism.standby.log)
    assert await organism.primary.stop() == 0, "".join(organism.primary.log[-10:])
    assert await organism.standby.stop(timeout=30) == 0, "".join(organism.standby.log[-10:])
