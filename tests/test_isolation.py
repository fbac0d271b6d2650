"""Handler isolation, attacked for real: real worker processes confined by the
kernel, killed with SIGKILL, in front of the real pump and kernel (Harness)."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from agentd import _metrics
from agentd._core import Huh
from agentd._envelope import parse_envelope
from agentd._errors import ConfigError, HuhCode
from agentd._handler import HandlerMetadata
from agentd._secrets import checking_as
from agentd._xmlify import spec_of
from agentd.client import frame_kind
from agentd.config import load_config
from agentd.confine import landlock_status
from agentd.isolation import IsolationPools, WorkerFailed
from agentd.testing import Harness
from agentd.tools.calculator import Add
from tests.isolated.handlers import Probe, Relay
from tests.isolated.watch import alive, gone, recording_server

CLIENTS = {"alice": "public"}
SECRET = "s3cret-token-do-not-leak"
needs_landlock = pytest.mark.skipif(not landlock_status().filesystem,
                                    reason="kernel without Landlock")


def organism(tmp: Path, isolation: str = "{memory_mb: 1024, cpu_s: 20, workers: 2}",
             timeout_s: float = 10) -> Path:
    (tmp / "tls").mkdir()
    (tmp / "tls" / "key.pem").write_text(f"-----BEGIN PRIVATE KEY-----\n{SECRET}\n")
    (tmp / "tls" / "cert.pem").write_text("cert")
    (tmp / "clients.yaml").write_text(f"alice: {{secret: {SECRET}, profile: public}}\n")
    (tmp / "authorized_keys").write_text(f"ssh-ed25519 {SECRET} ops-1\n")
    path = tmp / "organism.yaml"
    path.write_text(textwrap.dedent(f"""
        organism: {{name: isolation-tests}}
        state_dir: state
        auth: {{clients_file: clients.yaml}}
        oob: {{authorized_keys: authorized_keys}}
        bus: {{tls: {{cert: tls/cert.pem, key: tls/key.pem}}}}
        listeners:
          - name: prober
            payload_class: tests.isolated.handlers:Probe
            response_class: tests.isolated.handlers:Outcome
            handler: tests.isolated.handlers:probe
            description: Runs probes.
            timeout_s: {timeout_s}
            isolation: {isolation}
          - name: relay
            payload_class: tests.isolated.handlers:Relay
            response_class: tests.isolated.handlers:Outcome
            handler: tests.isolated.handlers:relay
            description: Adds through its peer.
            peers: [calculator.add]
            isolation: {{workers: 1}}
          - name: calculator.add
            payload_class: agentd.tools.calculator:Add
            response_class: agentd.tools.calculator:Sum
            handler: agentd.tools.calculator:add
            description: Adds two integers.
        profiles:
          public: {{listeners: all}}
    """))
    return path


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    config = load_config(organism(tmp_path))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as harness:
        yield harness


def outcome(frames: list[bytes]) -> tuple[str, str]:
    """(kind, text) of the last frame: ("outcome", text) or ("huh", code)."""
    env = parse_envelope(frames[-1])
    name = frame_kind(frames[-1])[1]
    for child in env.payload.iter():
        tag = child.tag.split("}")[-1] if isinstance(child.tag, str) else ""
        if (name == "outcome" and tag == "text") or (name == "huh" and tag == "code"):
            return name, child.text or ""
    return name, ""


async def ask(h: Harness, action: str, arg: str = "") -> tuple[str, str]:
    return outcome(await h.send("alice", Probe(action, arg)))


def pool_pids(h: Harness) -> set[int]:
    return {w.pid for w in h.isolation.pools["prober"].workers}


async def settled(h: Harness, restarts: int) -> None:
    """Until the pool has replaced `restarts` workers and has them all ready."""
    pool = h.isolation.pools["prober"]
    for _ in range(3000):
        st = pool.status()
        if st["restarts"] >= restarts and st["workers"] == pool.spec.workers and not st["starting"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"pool did not settle: {pool.status()}")


def workers_gauge(state: str) -> float:
    return _metrics.REGISTRY.get_sample_value(
        "agentd_workers", {"listener": "prober", "state": state}) or 0.0


async def test_the_workers_gauge_counts_the_pool_by_state(h: Harness) -> None:
    """Two workers and the spare idle; one busy while it runs a call; none counted
    once the pool is stopped (the gauge is read from the pool when scraped)."""
    pool = h.isolation.pools["prober"]
    await settled(h, 0)
    assert (workers_gauge("idle"), workers_gauge("busy"), workers_gauge("starting")) == (3, 0, 0)
    call = asyncio.ensure_future(ask(h, "sleep", "0.3"))
    for _ in range(3000):
        if pool.status()["busy"]:
            break
        await asyncio.sleep(0.01)
    assert (workers_gauge("idle"), workers_gauge("busy")) == (2, 1)
    assert await call == ("outcome", "slept")
    assert (workers_gauge("idle"), workers_gauge("busy")) == (3, 0)
    await pool.stop()
    assert (workers_gauge("idle"), workers_gauge("busy")) == (0, 0)


async def test_isolated_handler_answers_like_in_process(h: Harness) -> None:
    assert await ask(h, "echo", "hello") == ("outcome", "hello")
    assert await ask(h, "await", "0.01") == ("outcome", "awaited")
    pid = int((await ask(h, "pid"))[1])
    assert pid != os.getpid() and pid in pool_pids(h)


async def test_an_isolated_handler_gets_its_peers_reply_as_an_object(h: Harness) -> None:
    frames = await h.send("alice", Relay(a=2, b=40))
    assert outcome(frames) == ("outcome", "sum=42")


async def other_conversation_completes(h: Harness) -> None:
    frames = await h.send("alice", Add(a=2, b=3))
    assert frame_kind(frames[-1])[1] == "sum"


@pytest.mark.parametrize("action,arg,reason", [
    ("exit", "", "exit"),
    ("segfault", "", "crash"),
    ("alloc", "4096", "memory"),
])
async def test_worker_that_dies_is_contained_and_replaced(
        h: Harness, action: str, arg: str, reason: str) -> None:
    daemon_pid = os.getpid()
    before = pool_pids(h)
    assert await ask(h, action, arg) == ("huh", "internal")
    assert os.getpid() == daemon_pid
    await other_conversation_completes(h)
    await settled(h, 1)
    assert pool_pids(h) != before
    assert await ask(h, "echo", "still here") == ("outcome", "still here")
    from agentd import _metrics
    assert (_metrics.REGISTRY.get_sample_value(
        "agentd_worker_restarts_total", {"listener": "prober", "reason": reason}) or 0) >= 1


@pytest.mark.parametrize("action,arg", [("loop", ""), ("sleep", "600")])
async def test_hung_worker_is_killed_at_the_timeout(tmp_path: Path, action: str, arg: str) -> None:
    config = load_config(organism(tmp_path, timeout_s=1))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        hung = asyncio.create_task(h.send("alice", Probe(action, arg)))
        # Meanwhile the other listener and the pool's other worker keep serving.
        await other_conversation_completes(h)
        assert outcome(await hung) == ("huh", "timeout")
        await settled(h, 1)
        assert await ask(h, "echo", "ok") == ("outcome", "ok")


async def test_a_worker_flooding_stderr_is_read_no_faster_than_its_rate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """5,000 lines (500 KB, far more than a pipe holds) in one call: the daemon logs at
    most STDERR_LINES_PER_S lines a second past a burst, so the worker blocks on its
    own pipe and the call times out; the daemon's loop and log are not its to use."""
    from agentd.isolation._worker import _STDERR_BURST, STDERR_LINES_PER_S

    config = load_config(organism(tmp_path, "{workers: 1}", timeout_s=1))
    (tmp_path / "state").mkdir()
    caplog.set_level("INFO", logger="agentd.isolation")
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        assert await ask(h, "stderr", "5000") == ("huh", "timeout")
        await settled(h, 1)
        assert await ask(h, "echo", "ok") == ("outcome", "ok")
    logged = [r for r in caplog.records if "worker stderr" in r.getMessage()
              and r.getMessage().endswith("x" * 20)]
    assert len(logged) < _STDERR_BURST + 3 * STDERR_LINES_PER_S  # 1 s of call, and margin
    assert sum("read no faster" in r.getMessage() for r in caplog.records) == 1


async def test_stderr_without_newlines_is_read_no_faster_either(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Chunks of stderr with no newline (each over the reader's 64 KiB line limit)
    skipped the rate limit: the daemon read them as fast as the worker wrote, 68 % of
    a core for one worker. They are charged like lines now."""
    config = load_config(organism(tmp_path, "{workers: 1}", timeout_s=1))
    (tmp_path / "state").mkdir()
    caplog.set_level("INFO", logger="agentd.isolation")
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        assert await ask(h, "stderr-long", "5000") == ("huh", "timeout")  # it blocked
        await settled(h, 1)
        assert await ask(h, "echo", "ok") == ("outcome", "ok")
    assert sum("read no faster" in r.getMessage() for r in caplog.records) == 1


async def test_a_worker_that_dies_as_it_starts_is_restarted_ever_more_slowly(
        h: Harness) -> None:
    """A worker that exits right after it is ready used to be restarted in a tight
    loop (84 restarts, 1.35 cores in 10 s); each quick death doubles the pause.
    "Quick" is 1 s after ready; the worker first asked was ready when the harness
    started, which in a loaded full run can be longer ago than that (it failed a
    fresh-clone CI run so), so the window is widened here: what is tested is the
    doubling, not the constant."""
    pool = h.isolation.pools["prober"]
    pool.quick_death_s = 600.0
    await settled(h, 0)
    assert pool.restart_pause_s == 0.0
    assert await ask(h, "exit-soon") == ("outcome", "exiting")
    await settled(h, 1)
    assert pool.restart_pause_s == 0.1
    assert await ask(h, "exit-soon") == ("outcome", "exiting")
    await settled(h, 2)
    assert pool.restart_pause_s == 0.2
    assert await ask(h, "echo", "ok") == ("outcome", "ok")


async def test_a_pool_keeps_restarting_when_the_system_refuses_a_process(
        h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon out of processes or descriptors when it starts a replacement (a
    hostile worker can cause both): the restart loop stopped for good on the first
    OSError and the listener answered `huh timeout` for ever. It retries."""
    import errno

    from agentd.isolation import _pool

    await settled(h, 0)
    real = _pool.spawn
    refusals = [OSError(errno.EAGAIN, "Resource temporarily unavailable")] * 2

    async def refusing(*args: Any, **kw: Any) -> Any:
        if refusals:
            raise refusals.pop()
        return await real(*args, **kw)

    monkeypatch.setattr(_pool, "spawn", refusing)
    assert await ask(h, "exit") == ("huh", "internal")
    pool = h.isolation.pools["prober"]
    for _ in range(3000):  # the spare took over; its successor is refused twice
        if not refusals and pool.status()["spare"]:
            break
        await asyncio.sleep(0.01)
    assert not refusals and pool.status()["spare"] == 1, pool.status()
    assert await ask(h, "echo", "ok") == ("outcome", "ok")


async def test_cpu_limit_stops_a_busy_loop(tmp_path: Path) -> None:
    config = load_config(organism(tmp_path, "{cpu_s: 1, workers: 1}", timeout_s=120))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        assert await ask(h, "loop") == ("huh", "internal")
        await settled(h, 1)
        assert await ask(h, "echo", "ok") == ("outcome", "ok")


async def test_grandchild_does_not_outlive_its_worker(h: Harness) -> None:
    # While its call runs, the handler's grandchild (it tried setsid() to leave the
    # worker's process group) lives; the worker crashes: its whole group goes.
    call = asyncio.ensure_future(ask(h, "grandchild", "30"))
    found: list[tuple[int, int]] = []
    for _ in range(3000):
        found = [(pid, int(child)) for pid in pool_pids(h)
                 for child in children_of(pid)]
        if found:
            break
        await asyncio.sleep(0.01)
    [(worker_pid, grandchild)] = found
    assert alive(grandchild)
    os.kill(worker_pid, signal.SIGKILL)
    assert await gone(grandchild)
    assert await call == ("huh", "internal")
    await settled(h, 1)
    await other_conversation_completes(h)


def children_of(pid: int) -> list[str]:
    try:
        return [child for tid in os.listdir(f"/proc/{pid}/task")
                for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("action", ["grandchild", "orphan", "thread-child",
                                    "ended-thread-child"])
async def test_processes_a_handler_leaves_behind_end_with_its_call(
        h: Harness, action: str, caplog: pytest.LogCaptureFixture) -> None:
    """A child left running (one trying setsid, an orphan whose parent exited, one
    forked by a thread that lives on, one forked by a thread that ended: the worker
    has one thread again) is found once the worker has finished its call: the worker
    is replaced with its whole group, after its answer was delivered."""
    before = _metrics.REGISTRY.get_sample_value(
        "agentd_worker_restarts_total", {"listener": "prober", "reason": "leftover"}) or 0
    kind, text = await ask(h, action)
    assert kind == "outcome"
    assert await gone(int(text))
    await settled(h, 1)
    assert (_metrics.REGISTRY.get_sample_value(
        "agentd_worker_restarts_total", {"listener": "prober", "reason": "leftover"})
        == before + 1)
    assert "processes it started still there" in caplog.text
    await other_conversation_completes(h)


async def child_of_a_worker(h: Harness) -> int:
    for _ in range(3000):
        found = [int(c) for pid in pool_pids(h) for c in children_of(pid)]
        if found:
            return found[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no worker has a child")


async def test_a_process_started_after_the_answer_is_found_while_idle(h: Harness) -> None:
    """A thread the handler left starts a process once the call was answered: the
    idle worker is checked again, and replaced."""
    assert await ask(h, "late-fork", "0.3") == ("outcome", "later")
    child = await child_of_a_worker(h)
    assert await gone(child, 10)
    await settled(h, 1)


async def test_a_leftover_is_found_under_steady_load(tmp_path: Path) -> None:
    """Calls that keep the one worker busy (one always queued behind the running one)
    do not postpone the check for ever: a worker due for it is given no more calls
    until it has gone idle."""
    async with one_worker(tmp_path) as h:
        pool = h.isolation.pools["prober"]
        stop = asyncio.Event()
        answered = 0

        async def load() -> None:
            nonlocal answered
            while not stop.is_set():
                answer = await pool.call(Probe("sleep", "0.02"), META)
                assert answer is not None and b"slept" in bytes(answer.payload)
                answered += 1

        loads = [asyncio.ensure_future(load()) for _ in range(8)]
        try:
            for _ in range(3000):  # the load is on: callers wait for room in the queue
                if pool.waiting >= 4:
                    break
                await asyncio.sleep(0.01)
            async with asyncio.timeout(30):  # a caller that arrived later is not served
                answer = await pool.call(Probe("grandchild"), META)  # for ever first
            assert answer is not None
            grandchild = int(etree.fromstring(bytes(answer.payload)).findtext("{*}text") or 0)
            before = answered
            assert await gone(grandchild, 10)
            assert not any(task.done() for task in loads)  # the load went on meanwhile
        finally:
            stop.set()
            await asyncio.gather(*loads, return_exceptions=True)
        assert answered > before


async def test_a_worker_left_with_too_many_threads_is_replaced(tmp_path: Path) -> None:
    """Each check reads every thread's list, opened and closed each time: a worker
    left with more than MAX_THREADS threads is replaced instead of checked, and the
    daemon keeps no descriptor per thread. (max_tasks lets it make them.)"""
    from agentd.isolation._children import MAX_THREADS

    config = load_config(organism(tmp_path, "{memory_mb: 1024, workers: 2, max_tasks: 512}"))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        fds = len(os.listdir("/proc/self/fd"))
        assert await ask(h, "threads", "8") == ("outcome", "9")
        assert abs(len(os.listdir("/proc/self/fd")) - fds) <= 2  # a pipe may come and go
        assert h.isolation.pools["prober"].status()["restarts"] == 0
        assert await ask(h, "threads", str(MAX_THREADS + 10))
        await settled(h, 1)


async def test_a_child_on_a_reused_thread_id_is_found(tmp_path: Path) -> None:
    """A thread ends and a new one gets its id, then forks: found (a descriptor kept
    for the old thread read nothing, and hid that child for the worker's life)."""
    config = load_config(organism(tmp_path, "{memory_mb: 1024, workers: 1}", timeout_s=30))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        assert await ask(h, "tid-reuse", "arm") == ("outcome", "armed")
        kind, text = await ask(h, "tid-reuse", "fire")
        if text == "not-reused":
            pytest.skip("no thread id was reused within 20 s (pid_max too large)")
        assert kind == "outcome" and text.startswith("reused=")
        assert await gone(int(text.split("=")[1]), 10)
        pool = h.isolation.pools["prober"]
        for _ in range(3000):
            if pool.status()["restarts"] == 1:
                break
            await asyncio.sleep(0.01)
        assert pool.status()["restarts"] == 1


async def test_a_child_run_to_its_end_leaves_the_worker_in_place(h: Harness) -> None:
    """A handler that runs a command and waits for it leaves nothing: no replacement."""
    assert h.isolation.pools["prober"].status()["leftovers_checked"] == 1
    for _ in range(3):
        assert await ask(h, "subprocess") == ("outcome", "7")
    assert h.isolation.pools["prober"].status()["restarts"] == 0


@needs_landlock
@pytest.mark.parametrize("target", ["clients.yaml", "tls/key.pem", "authorized_keys",
                                    "organism.yaml", "state/journal.db", "/proc/{pid}/environ"])
async def test_worker_cannot_read_the_daemons_secrets(
        h: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str) -> None:
    path = target.format(pid=os.getpid()) if target.startswith("/") else str(tmp_path / target)
    frames = await h.send("alice", Probe("read", path))
    assert outcome(frames) == ("huh", "internal")
    assert all(SECRET.encode() not in f for f in frames)
    assert SECRET not in caplog.text
    await other_conversation_completes(h)


@pytest.mark.both_loops  # spawned as the daemon spawns it: on uvloop too
async def test_worker_environment_holds_only_what_the_listener_declares(
        tmp_path: Path) -> None:
    os.environ["AGENTD_DAEMON_SECRET"] = SECRET
    try:
        config = load_config(organism(tmp_path, "{workers: 1, env: {GREETING: hi}}"))
        (tmp_path / "state").mkdir()
        async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
            kind, names = await ask(h, "environ")
    finally:
        del os.environ["AGENTD_DAEMON_SECRET"]
    assert kind == "outcome"
    assert "GREETING" in names.split(",") and "AGENTD_DAEMON_SECRET" not in names


def _others_may_enter(path: str) -> bool:
    """Every folder down to `path` is searchable by any user (o+x)."""
    parts = Path(os.path.realpath(path)).parents
    return all(os.stat(d).st_mode & 0o001 for d in parts)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching the workers' user needs root")
@pytest.mark.skipif(not all(_others_may_enter(p) for p in (sys.base_prefix, sys.prefix, __file__)),
                    reason="this Python installation or checkout is not readable by other "
                           "users (the switch itself is tested in test_confine)")
async def test_workers_run_as_the_declared_user_and_cannot_signal_the_daemon(
        tmp_path: Path) -> None:
    config = load_config(organism(tmp_path, "{workers: 1, user: nobody}"))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        nobody = pwd.getpwnam("nobody")
        assert await ask(h, "ids") == ("outcome", f"{nobody.pw_uid},{nobody.pw_gid},")
        assert await ask(h, "signal-parent") == ("huh", "internal")
        await other_conversation_completes(h)


async def test_a_worker_that_cannot_start_says_why(tmp_path: Path) -> None:
    # A `user` that cannot read the installation: the shim's reason reaches the error.
    config = load_config(organism(tmp_path, "{workers: 1, user: nobody}"))
    if all(_others_may_enter(p) for p in (sys.base_prefix, sys.prefix, __file__)):
        pytest.skip("this installation is readable by nobody: the worker starts")
    if os.geteuid() != 0:
        pytest.skip("switching the workers' user needs root")
    pools = IsolationPools()
    with pytest.raises(WorkerFailed, match=r"did not start \(exit 125\): confine: PermissionError"):
        await pools.apply(config)


def test_another_user_without_root_is_refused_at_start(tmp_path: Path) -> None:
    config = load_config(organism(tmp_path, "{workers: 1, user: nobody}"))
    with checking_as(1000), pytest.raises(  # a daemon that will run as uid 1000
            ConfigError, match="only when the daemon runs as root"):
        IsolationPools.specs(config)


def test_check_config_reports_what_the_workers_start_would_refuse(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agentd._preflight import preflight
    from agentd.config import check_config_main

    path = organism(tmp_path, "{workers: 1, user: nobody}")
    with checking_as(1000):
        assert check_config_main(path, preflight=preflight) == 1
    assert "only when the daemon runs as root" in capsys.readouterr().err
    # A state folder inside the handler's package: the worker could read it.
    inside = Path(__file__).parent / "isolated" / "state-never-created"
    path.write_text(path.read_text().replace("state_dir: state", f"state_dir: {inside}"))
    assert check_config_main(path, preflight=preflight) == 1
    assert f"the worker would be able to read {inside}" in capsys.readouterr().err
    assert not inside.exists()


def test_an_unknown_user_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such user: no-such-user-here"):
        load_config(organism(tmp_path, "{workers: 1, user: no-such-user-here}"))


async def test_network_false_refuses_a_loopback_connection(h: Harness) -> None:
    async with recording_server() as (port, accepted):
        assert await ask(h, "connect", f"127.0.0.1:{port}") == ("huh", "internal")
    assert accepted == []


async def test_forged_envelope_on_stdout_goes_nowhere(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    frames = await h.send("alice", Probe("forge"))
    assert outcome(frames) == ("outcome", "forged")
    assert all(b"<from>core</from><to>alice</to><thread>x" not in f for f in frames)
    assert [frame_kind(f)[1] for f in frames] == ["accepted", "outcome"]


async def test_bad_output_from_a_worker_is_refused_like_in_process_output(h: Harness) -> None:
    # Invalid output is refused by the pump's own checks, with a huh to the listener
    # (as for an in-process handler): nothing of it reaches the client. The prober
    # fails on that huh, so its caller (the client) is told, with the generic huh.
    frames = await h.send("alice", Probe("bad-xml"))
    assert [frame_kind(f)[1] for f in frames] == ["accepted", "huh"]
    assert all(b"nope" not in f for f in frames)
    assert await ask(h, "echo", "ok") == ("outcome", "ok")


def one_worker(tmp_path: Path) -> Harness:
    """A harness whose `prober` pool has one worker (calls go to it directly)."""
    config = load_config(organism(tmp_path, "{workers: 1}"))
    (tmp_path / "state").mkdir()
    return Harness(config, CLIENTS, state_dir=tmp_path / "state")


META = HandlerMetadata("0b7c1d52-3b9e-4c1e-9a57-2b1f0c3d4e5f", "alice", "prober")


async def test_a_worker_dead_while_idle_does_not_fail_the_next_call(tmp_path: Path) -> None:
    import select

    async with one_worker(tmp_path) as h:
        pool = h.isolation.pools["prober"]
        (idle,) = list(pool._idle)
        pidfd = os.pidfd_open(idle.pid)
        try:
            os.kill(idle.pid, signal.SIGKILL)
            # Block (without letting the event loop run, so the pool has not yet
            # noticed) until the worker has really exited.
            assert select.select([pidfd], [], [], 30)[0]
        finally:
            os.close(pidfd)
        answer = await pool.call(Probe("echo", "served"), META)
        assert answer is not None and b"served" in bytes(answer.payload)
        await settled(h, 1)


async def test_worker_is_recycled_after_max_calls(tmp_path: Path) -> None:
    config = load_config(organism(tmp_path, "{workers: 1, max_calls: 2}"))
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        first = (await ask(h, "pid"))[1]
        assert (await ask(h, "pid"))[1] == first
        await settled(h, 1)
        assert (await ask(h, "pid"))[1] != first
        assert h.isolation.status()["pools"][0]["restarts"] == 1


async def test_an_isolated_handler_cannot_lock_the_operator_out(tmp_path: Path) -> None:
    """A handler (network: false, the daemon's uid) held 70 connections to the
    operator socket by its path, reconnecting any dropped, and `agentctl status`
    failed for as long as it ran. Its worker may not create a Unix socket (uvloop
    still runs); the operator is answered while it runs."""
    from agentd.client import BusClient
    from tests.daemon_process import DaemonProcess, make_home

    home = tmp_path / "home"
    make_home(home, [{
        "name": "prober", "payload_class": "tests.isolated.handlers:Probe",
        "response_class": "tests.isolated.handlers:Outcome",
        "handler": "tests.isolated.handlers:probe", "description": "Runs probes.",
        "isolation": {"workers": 1, "network": False},
    }])
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            held = await bus.exchange(Probe("hold-oob", f"{d.socket} 70"))
            code, status = d.agentctl("status")
            assert code == 0, status
            assert outcome(held) == ("outcome", "uvloop ran; refused 13")
            assert outcome(await bus.exchange(Probe("echo", "alive"))) == ("outcome", "alive")
    finally:
        await d.stop()


async def test_daemon_survives_a_segfaulting_worker_and_reports_its_pool(tmp_path: Path) -> None:
    from agentd.client import BusClient
    from tests.daemon_process import DaemonProcess, make_home

    home = tmp_path / "home"
    make_home(home, [{
        "name": "prober", "payload_class": "tests.isolated.handlers:Probe",
        "response_class": "tests.isolated.handlers:Outcome",
        "handler": "tests.isolated.handlers:probe", "description": "Runs probes.",
        "isolation": {"workers": 1},
    }])
    d = await DaemonProcess(home).start()
    try:
        assert d.proc is not None
        daemon_pid = d.proc.pid
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            crashed = await bus.exchange(Probe("segfault"))
            assert outcome(crashed) == ("huh", "internal")
            secret = (home / "tls" / "key.pem").read_text()
            stolen = await bus.exchange(Probe("read", str(home / "tls" / "key.pem")))
            assert outcome(stolen) == ("huh", "internal")
            assert all(secret.encode() not in f for f in stolen)
            assert outcome(await bus.exchange(Probe("echo", "alive"))) == ("outcome", "alive")
        assert d.proc.returncode is None and d.proc.pid == daemon_pid
        code, status = d.agentctl("status")
        assert code == 0, status
        text = json.dumps(status)
        assert "prober" in text and "restarts" in text and "landlock_abi" in text
    finally:
        await d.stop()
    assert secret not in "".join(d.log)



def element(payload: object) -> etree._Element:
    """A payload as the pump hands it to an isolated listener: the validated element."""
    return etree.fromstring(spec_of(payload).to_bytes(payload))


async def test_an_isolated_handler_gets_payloads_and_core_notices_from_their_elements(
        tmp_path: Path) -> None:
    pools = IsolationPools()
    try:
        handler = (await pools.apply(load_config(organism(tmp_path))))["relay"]
        asked = await handler(element(Relay(a=2, b=3)), META)
        assert asked is not None and asked.to == "calculator.add"
        assert b"<a>2</a><b>3</b>" in bytes(asked.payload)
        huh = etree.fromstring(Huh.of(HuhCode.TIMEOUT).to_bytes())  # a core payload
        told = await handler(huh, META)
        assert told is not None and b"huh=timeout" in bytes(told.payload)
    finally:
        await pools.stop()

async def test_a_reload_retires_an_old_pool_until_no_live_table_reaches_it(
        tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = load_config(organism(tmp_path / "a", "{workers: 1, memory_mb: 1024}"))
    after = load_config(organism(tmp_path / "b", "{workers: 1, memory_mb: 768}"))
    meta = META
    pools = IsolationPools()
    try:
        old_call = (await pools.apply(before))["prober"]
        new_call = (await pools.apply(after, last_version=1))["prober"]
        assert new_call != old_call
        # The pump hands an isolated listener's handler the element it validated.
        assert getattr(new_call, "takes_element", False) is True
        # A thread created before the reload (table version 1) still routes to the
        # old pool: it must still serve.
        answer = await old_call(element(Probe("echo", "old table")), meta)
        assert answer is not None and b"old table" in bytes(answer.payload)
        assert pools.status()["retired_pools"] == 1
        # Both pools' workers (and spares) are counted until the old one stops.
        assert workers_gauge("idle") == 4
        assert await pools.close_unused(lambda: {1, 2}) == 0
        assert await pools.close_unused(lambda: {2}) == 1
        assert pools.status()["retired_pools"] == 0
        assert workers_gauge("idle") == 2
        with pytest.raises(WorkerFailed):
            await old_call(element(Probe("echo", "too late")), meta)
        answer = await new_call(element(Probe("echo", "new table")), meta)
        assert answer is not None and b"new table" in bytes(answer.payload)
    finally:
        await pools.stop()


async def test_a_call_queued_behind_one_whose_worker_dies_runs_on_another(
        tmp_path: Path) -> None:
    meta = META
    async with one_worker(tmp_path) as h:
        pool = h.isolation.pools["prober"]
        running = asyncio.create_task(pool.call(Probe("sleep", "600"), meta))
        queued = asyncio.create_task(pool.call(Probe("pid"), meta))
        for _ in range(10_000):  # both written to the one worker (loop turns, no clock)
            busy = [w for w in pool.workers if len(w.inflight) == 2]
            if busy:
                break
            await asyncio.sleep(0)
        (worker,) = busy
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerFailed):
            await running
        answer = await queued  # never started there: served by the replacement
        assert answer is not None
        pid = int(bytes(answer.payload).split(b"<text>")[1].split(b"</text>")[0])
        assert pid != worker.pid and pid in pool_pids(h)


async def test_a_caller_cancelled_while_waiting_for_a_worker_leaves_the_queue(
        tmp_path: Path) -> None:
    meta = META
    async with one_worker(tmp_path) as h:
        pool = h.isolation.pools["prober"]
        running = [asyncio.create_task(pool.call(Probe("sleep", "0.3"), meta))
                   for _ in range(pool.pipeline)]  # the one worker's queue is full
        waiting = [asyncio.create_task(pool.call(Probe("pid"), meta)) for _ in range(2)]
        for _ in range(10_000):
            if pool.waiting == 2:
                break
            await asyncio.sleep(0)
        assert pool.waiting == 2
        waiting[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting[0]
        assert pool.waiting == 1  # gone from the queue, not left for _wake to skip
        assert await waiting[1] is not None  # served once the worker had room
        for task in running:
            assert await task is not None
        assert not pool.waiting and pool.status()["restarts"] == 0


async def test_meta_state_of_an_isolated_handler_persists_like_in_process(h: Harness) -> None:
    """`meta.state` crosses the worker boundary: the slice goes with the call, the
    writes come back with the answer and commit with the output. It used to be a
    throw-away in a worker: every call saw an empty slice, writes were lost."""
    from agentd._threads import new_uuid

    thread = new_uuid()
    counts = [outcome(await h.send("alice", Probe("count"), thread=thread)) for _ in range(3)]
    assert counts == [("outcome", "1"), ("outcome", "2"), ("outcome", "3")]
    assert h.kernel is not None
    rows = [r for r in await h.kernel.handler_state() if r[1] == thread]
    assert rows == [("prober", thread, "n", "3")]
    assert outcome(await h.send("alice", Probe("count"))) == ("outcome", "1")  # its own slice


async def test_an_isolated_handlers_state_is_bounded_in_the_worker_and_at_commit(
        tmp_path: Path) -> None:
    """The worker's view refuses what the daemon would (the handler raises there); a
    worker that writes past its view anyway is refused when the writes are applied,
    and nothing of them is kept."""
    text = organism(tmp_path).read_text().replace(
        "organism: {name: isolation-tests}",
        "organism: {name: isolation-tests}\npump: {max_state_bytes_per_thread: 1024}")
    (tmp_path / "organism.yaml").write_text(text)
    config = load_config(tmp_path / "organism.yaml")
    (tmp_path / "state").mkdir()
    async with Harness(config, CLIENTS, state_dir=tmp_path / "state") as h:
        assert await ask(h, "state-set", "100") == ("outcome", "set")
        assert await ask(h, "state-set", "2000") == ("huh", "internal")  # raised in the worker
        assert await ask(h, "state-smuggle", "2000") == ("huh", "too-large")
        assert h.kernel is not None
        assert all(len(r[3]) <= 1024 for r in await h.kernel.handler_state())



SIBLING_HANDLER = '''
import importlib
from dataclasses import dataclass

from agentd import HandlerMetadata, HandlerResponse, xmlify
{import_line}


@xmlify(namespace="https://example.org/ns/sibling/say/v1")
@dataclass
class Say:
    text: str


@xmlify(namespace="https://example.org/ns/sibling/said/v1")
@dataclass
class Said:
    text: str


async def say(payload: Say, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Said(shout(payload.text)))
'''


def sibling_organism(tmp: Path, module: str, import_line: str, extra: str = "") -> Path:
    """Handler module `module` beside its helper module `module`_help and beside the
    organism file itself (a secret: so the folder as a whole cannot be granted).
    Each test names its own modules: an imported module stays in sys.modules."""
    helper = f"{module}_help"
    (tmp / f"{module}.py").write_text(SIBLING_HANDLER.format(
        import_line=import_line.format(helper=helper)))
    (tmp / f"{helper}.py").write_text("def shout(text):\n    return text.upper() + '!'\n")
    path = tmp / "organism.yaml"
    path.write_text(textwrap.dedent(f"""
        organism: {{name: sibling-tests}}
        state_dir: state
        python_path: [.]
        listeners:
          - name: speaker
            payload_class: {module}:Say
            response_class: {module}:Said
            handler: {module}:say
            description: Says it louder.
            isolation: {{workers: 1{extra}}}
        profiles:
          public: {{listeners: all}}
    """))
    return path


async def say_hi(path: Path, module: str) -> bytes:
    config = load_config(path)
    async with Harness(config, {"alice": "public"}) as h:
        frames = await h.send("alice", sys.modules[module].Say("hi"))
    return frames[-1]


@needs_landlock
async def test_an_isolated_handler_imports_its_sibling_module(tmp_path: Path) -> None:
    path = sibling_organism(tmp_path, "speaker_a", "from {helper} import shout")
    assert b"<text>HI!</text>" in await say_hi(path, "speaker_a")


RUN_TIME_IMPORT = "shout = importlib.import_module('{helper}').shout"


@needs_landlock
def test_a_module_imported_at_run_time_stops_the_start_in_one_line(tmp_path: Path) -> None:
    import subprocess

    path = sibling_organism(tmp_path, "speaker_b", RUN_TIME_IMPORT)
    run = subprocess.run([sys.executable, "-m", "agentd.cli", "run", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: isolated worker failed: worker for speaker did not start")
    assert "speaker_b_help.py" in last and "isolation: read of listener speaker" in last
    # The worker's own stderr is logged line by line; the daemon's output has no traceback.
    daemon = [line for line in run.stderr.splitlines() if "worker stderr" not in line]
    assert not any("Traceback" in line for line in daemon)


@needs_landlock
async def test_isolation_read_grants_a_module_imported_at_run_time(tmp_path: Path) -> None:
    path = sibling_organism(tmp_path, "speaker_c", RUN_TIME_IMPORT,
                            extra=", read: [speaker_c_help.py]")
    assert b"<text>HI!</text>" in await say_hi(path, "speaker_c")


def test_isolation_read_cannot_grant_a_secret(tmp_path: Path) -> None:
    path = sibling_organism(tmp_path, "speaker_d", "from {helper} import shout",
                            extra=", read: [.]")
    with pytest.raises(ConfigError, match=r"would be able to read .*/(state|organism.yaml) "):
        IsolationPools.specs(load_config(path))
