"""Metrics and health endpoints over real HTTP, one-line logs, and sd_notify datagrams
received on a real unix datagram socket (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path

import pytest

from agentd._observability import (
    MetricsServer,
    sd_notify,
    setup_logging,
    watchdog_interval,
    watchdog_pinger,
)
from agentd.tools.calculator import Add
from tests.test_bus_support import start_rig, stop_rig


async def http_get(port: int, path: str, raw: bytes | None = None) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw or f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


@pytest.fixture
async def metrics_server():
    state = {"ready": False}
    server = MetricsServer("127.0.0.1:0", ready=lambda: state["ready"])
    await server.start()
    yield server, state
    await server.close()


async def test_healthz_is_always_200(metrics_server) -> None:
    server, _ = metrics_server
    assert await http_get(server.port, "/healthz") == (200, "ok\n")


async def test_readyz_follows_ready(metrics_server) -> None:
    server, state = metrics_server
    assert (await http_get(server.port, "/readyz"))[0] == 503
    state["ready"] = True
    assert (await http_get(server.port, "/readyz"))[0] == 200


async def test_unknown_paths_and_methods(metrics_server) -> None:
    server, _ = metrics_server
    assert (await http_get(server.port, "/nope"))[0] == 404
    assert (await http_get(server.port, "", b"POST /metrics HTTP/1.1\r\n\r\n"))[0] == 405
    assert (await http_get(server.port, "", b"garbage\r\n\r\n"))[0] == 400


async def test_oversized_request_is_refused(metrics_server) -> None:
    server, _ = metrics_server
    huge = b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"
    assert (await http_get(server.port, "", huge))[0] == 431


async def test_idle_connections_cannot_hold_more_than_their_share(metrics_server) -> None:
    """Sockets that never send a request take at most MAX_CONNECTIONS of the daemon's
    descriptors (2,000 of them exhausted a daemon's 1,024 and the bus stopped
    accepting); past the cap a new one is closed at once, and once they go a
    scrape is served again."""
    from agentd._observability import MAX_CONNECTIONS

    server, _ = metrics_server
    idle = [await asyncio.open_connection("127.0.0.1", server.port)
            for _ in range(MAX_CONNECTIONS)]
    try:
        for _ in range(200):  # until the server has taken every one of them
            if server.connections == MAX_CONNECTIONS:
                break
            await asyncio.sleep(0.01)
        assert server.connections == MAX_CONNECTIONS
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        with contextlib.suppress(ConnectionResetError):  # closed (or reset), not held
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        for _, w in idle:
            w.close()
    for _ in range(300):
        if server.connections == 0:
            break
        await asyncio.sleep(0.01)
    assert await http_get(server.port, "/healthz") == (200, "ok\n")


async def test_metrics_exposes_the_contract_series(metrics_server) -> None:
    server, _ = metrics_server
    status, body = await http_get(server.port, "/metrics")
    assert status == 200
    for series in (
        "agentd_envelopes_received_total", "agentd_bus_connections", "agentd_auth_failures_total",
        "agentd_queue_depth", "agentd_threads_active", "agentd_journal_commit_seconds",
        "agentd_kernel_healthy", "agentd_kernel_writer_restarts",
    ):
        assert series in body, series


async def test_metrics_move_as_traffic_flows(tmp_path: Path, metrics_server) -> None:
    server, _ = metrics_server
    rig = await start_rig(tmp_path)
    try:
        def sample(body: str, name: str) -> float:
            for line in body.splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        _, before = await http_get(server.port, "/metrics")
        async with rig.client("alice") as c:
            await c.exchange(Add(a=1, b=2), timeout=5)
            await c.send_raw(b"<broken")
            await c.recv(timeout=5)
            _, during = await http_get(server.port, "/metrics")
        assert sample(during, "agentd_envelopes_received_total") >= sample(
            before, "agentd_envelopes_received_total"
        ) + 2
        assert sample(during, "agentd_bus_connections") >= 1
        assert 'agentd_envelopes_rejected_total{code="malformed"}' in during
        add = '{listener="calculator.add"}'
        assert sample(during, f"agentd_handler_seconds_count{add}") >= sample(
            before, f"agentd_handler_seconds_count{add}") + 1
        every = 'agentd_handler_seconds_bucket{le="+Inf",listener="calculator.add"}'
        assert sample(during, every) == sample(during, f"agentd_handler_seconds_count{add}")
        assert sample(during, f"agentd_handler_seconds_sum{add}") > 0
    finally:
        await stop_rig(rig)


# ---- sd_notify ------------------------------------------------------------------------


def _dgram(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2)
    return sock


def test_sd_notify_sends_a_datagram_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with _dgram(path) as sock:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": path})
        assert sock.recv(4096) == b"READY=1"
        assert sd_notify("STOPPING=1", {"NOTIFY_SOCKET": path})
        assert sock.recv(4096) == b"STOPPING=1"


def test_sd_notify_understands_abstract_sockets() -> None:
    name = f"agentd-test-{os.getpid()}"
    with _dgram("\0" + name) as sock:
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert sock.recv(4096) == b"READY=1"


def test_sd_notify_without_systemd_is_a_no_op(tmp_path: Path) -> None:
    assert sd_notify("READY=1", {}) is False
    assert sd_notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "missing")}) is False


class _StopPinging(Exception):
    pass


def _sleeps_then_stop(count: int, requested: list[float]):
    """A stand-in for asyncio.sleep that returns at once `count` times, recording
    what it was asked to wait, then stops the pinger."""

    async def sleep(seconds: float) -> None:
        requested.append(seconds)
        if len(requested) > count:
            raise _StopPinging

    return sleep


async def test_watchdog_pings_at_half_the_period(tmp_path: Path) -> None:
    path = str(tmp_path / "wd.sock")
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    requested: list[float] = []
    with _dgram(path) as sock:
        with pytest.raises(_StopPinging):
            await watchdog_pinger(env, sleep=_sleeps_then_stop(2, requested))
        got = [sock.recv(64) for _ in range(3)]
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # exactly one ping per period
            sock.recv(64)
    assert got == [b"WATCHDOG=1"] * 3
    assert requested == [pytest.approx(0.1)] * 3


async def test_watchdog_pings_without_a_pid_restriction(tmp_path: Path) -> None:
    path = str(tmp_path / "wd.sock")
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"}
    requested: list[float] = []
    with _dgram(path) as sock:
        with pytest.raises(_StopPinging):
            await watchdog_pinger(env, sleep=_sleeps_then_stop(0, requested))
        assert sock.recv(64) == b"WATCHDOG=1"
    assert requested == [pytest.approx(15.0)]


@pytest.mark.parametrize("env", [
    {"WATCHDOG_PID": "1"},  # systemd watches another process (we are its child)
    {"WATCHDOG_USEC": ""},
    {"WATCHDOG_USEC": "0"},
    {"WATCHDOG_USEC": "soon"},
    {"NOTIFY_SOCKET": ""},
])
async def test_watchdog_is_off_unless_systemd_watches_this_process(
        tmp_path: Path, env: dict[str, str]) -> None:
    path = str(tmp_path / "wd.sock")
    base = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    env = {**base, **env}
    assert watchdog_interval(env) is None
    requested: list[float] = []
    with _dgram(path) as sock:
        await watchdog_pinger(env, sleep=_sleeps_then_stop(5, requested))  # returns at once
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(64)
    assert requested == []


async def test_daemon_style_readiness_through_a_real_notify_socket(tmp_path: Path) -> None:
    """What the daemon does once the bus listens: READY=1 observed on the socket."""
    path = str(tmp_path / "notify.sock")
    with _dgram(path) as sock:
        rig = await start_rig(tmp_path / "home")
        try:
            assert rig.bus.listening
            sd_notify("READY=1", {"NOTIFY_SOCKET": path})
            assert sock.recv(64) == b"READY=1"
        finally:
            await stop_rig(rig)
            sd_notify("STOPPING=1", {"NOTIFY_SOCKET": path})
        assert sock.recv(64) == b"STOPPING=1"


# ---- logs -------------------------------------------------------------------------------


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_kv_logs_are_one_line_a_record(capsys, restore_logging) -> None:
    setup_logging("kv", "INFO")
    logging.getLogger("agentd.test").warning("two\nlines client=%s", "alice")
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "level=warning" in err and "logger=agentd.test" in err
    assert 'msg="two\\nlines client=alice"' in err


def test_json_logs_parse(capsys, restore_logging) -> None:
    setup_logging("json", "DEBUG")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("agentd.test").exception("failed")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert doc["level"] == "error" and doc["msg"] == "failed" and "ValueError" in doc["exc"]


def test_unknown_log_format_is_refused() -> None:
    with pytest.raises(ValueError):
        setup_logging("xml")


def test_handler_seconds_buckets_are_cumulative_and_bounds_inclusive() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agentd._metrics import HotCounters, observe_handler

    hot = HotCounters()
    registry = CollectorRegistry()
    registry.register(hot)
    cells = hot.handler_histogram("tool")
    assert hot.handler_histogram("tool") is cells  # one series per listener name
    for seconds in (0.00005, 0.0001, 0.002, 45.0):
        observe_handler(cells, seconds)
    body = generate_latest(registry).decode()
    bucket = 'agentd_handler_seconds_bucket{le="%s",listener="tool"} %s'
    assert bucket % ("0.0001", "2.0") in body  # a value on a bound counts in its bucket
    assert bucket % ("0.001", "2.0") in body
    assert bucket % ("0.005", "3.0") in body
    assert bucket % ("30.0", "3.0") in body
    assert bucket % ("+Inf", "4.0") in body
    assert 'agentd_handler_seconds_count{listener="tool"} 4.0' in body
