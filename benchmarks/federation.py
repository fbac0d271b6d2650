"""A call across a federation link against the same call on the local bus, in one run.

One `agentd run` process ("beta") serves `calculator.add` on its bus and exports it
to the gateway "alpha" on /federation. This process plays both callers over real
TLS WebSockets on 127.0.0.1: a bus client (TOTP) and the federation peer alpha
(Ed25519 handshake bound to the TLS exporter). Each sends the same requests:
pipelined (WINDOW outstanding) for pairs per second, then one at a time for the
round trip. Every remote reply is acknowledged, as a peer must, so beta's outbox
rows are removed as they would be in production. Then a second daemon ("alpha",
dialing beta) measures `reconnect_ms`: from beta's restart (after SIGKILL) being
ready to alpha's link being up again, read from the two daemons' log timestamps.

Usage: python benchmarks/federation.py [--quick]. The last line is one JSON object:
remote_pairs_per_s, remote_p50_us, local_pairs_per_s, local_p50_us, remote_ratio
(remote pairs/s over local pairs/s; target >= 0.5), reconnect_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from agentd.client import BusClient  # noqa: E402
from agentd.federation import Identity, load_identity  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402
from tests.daemon_process import DaemonProcess, edit_config, make_home  # noqa: E402
from tests.federation_peer import RawPeer  # noqa: E402

WINDOW = 16
_FEDERATION = re.compile(r"federation listening url=wss://[0-9.]+:(\d+)/federation")
_TS = re.compile(r"ts=(\S+Z)")


def organism(home: Path, name: str, gateways: list[dict[str, Any]]) -> None:
    make_home(home)

    def edit(doc: dict[str, Any]) -> None:
        doc["organism"]["name"] = name
        doc["federation"] = {"listen": "127.0.0.1:0",
                             "tls": {"cert": "tls/cert.pem", "key": "tls/key.pem"},
                             "backoff_initial_s": 0.05, "backoff_max_s": 0.5,
                             "rate_per_s": 1e6, "rate_burst": 1_000_000}
        doc["gateways"] = gateways

    edit_config(home, edit)


def port_of(daemon: DaemonProcess) -> int:
    return int(next(m.group(1) for line in daemon.log if (m := _FEDERATION.search(line))))


def ts_of(line: str) -> float:
    stamp = _TS.search(line)
    assert stamp is not None
    return dt.datetime.fromisoformat(stamp.group(1).replace("Z", "+00:00")).timestamp()


async def windowed(
    n: int,
    window: int,
    request: Callable[[int], tuple[str, Awaitable[None]]],
    answered: Callable[[], Awaitable[str | None]],
) -> list[float]:
    """Sends `n` requests with up to `window` outstanding; the round trip of each.
    `request(i)`: the thread its answer will carry and the send; `answered()`: the
    thread of the next answer received (None for any other frame)."""
    started: dict[str, float] = {}
    done: list[float] = []
    sem = asyncio.Semaphore(window)

    async def reader() -> None:
        while len(done) < n:
            thread = await answered()
            t0 = started.pop(thread, None) if thread is not None else None
            if t0 is not None:
                done.append(time.perf_counter() - t0)
                sem.release()

    task = asyncio.create_task(reader())
    for i in range(n):
        await sem.acquire()
        thread, send = request(i)
        started[thread] = time.perf_counter()
        await send
    await task
    return done


async def remote(peer: RawPeer, n: int, window: int, tag: str) -> list[float]:
    """Calls across the link; every reply is acknowledged, as a peer must."""
    from agentd.federation._calls import call_thread

    assert peer.ws is not None
    ws = peer.ws

    def request(i: int) -> tuple[str, Awaitable[None]]:
        call_id = f"{tag}-{i}"
        return (call_thread("alpha", call_id),
                peer.call(call_id, Add(a=i, b=1), to="calculator.add"))

    async def answered() -> str | None:
        frame = json.loads(await ws.recv())
        if frame["t"] == "refused":
            raise RuntimeError(f"call refused: {frame}")
        if frame["t"] != "reply":
            return None
        await ws.send(json.dumps({"t": "ack", "id": frame["id"]}))
        return str(frame["thread"])

    return await windowed(n, window, request, answered)


async def local(bus: BusClient, n: int, window: int) -> list[float]:
    from agentd.client import is_answer

    def request(i: int) -> tuple[str, Awaitable[None]]:
        data, thread = bus.wrap(Add(a=i, b=1))
        return thread, bus.send_raw(data)

    async def answered() -> str | None:
        frame = await bus.recv()
        thread = re.search(rb"<thread>([^<]+)</thread>", frame)
        return thread.group(1).decode() if is_answer(frame) and thread else None

    return await windowed(n, window, request, answered)


async def pairs_and_p50(run: Any, n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    await run(n, WINDOW)
    rate = n / (time.perf_counter() - t0)
    p50 = statistics.median(await run(max(50, n // 10), 1)) * 1e6
    return rate, p50


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    n = 400 if args.quick else 4000
    tmp = Path(tempfile.mkdtemp(prefix="agentd-bench-fed-"))
    alpha = Identity("alpha", Ed25519PrivateKey.generate())
    organism(tmp / "beta", "beta", [{"name": "alpha", "public_key": alpha.public_line,
                                     "profile": "public", "export": ["calculator.add"]}])
    beta = await DaemonProcess(tmp / "beta").start()
    try:
        key = load_identity(tmp / "beta" / "identity.key", "beta").key.public_key()
        peer = await RawPeer(alpha, "beta", key).connect(port_of(beta))
        async with BusClient(beta.url, "alice", secret=beta.secret, cafile=beta.cafile) as bus:
            rounds = []
            for r in range(1 if args.quick else 3):
                rr, rp = await pairs_and_p50(
                    lambda k, w, r=r: remote(peer, k, w, f"r{r}-{w}-{k}"), n)
                lr, lp = await pairs_and_p50(lambda k, w: local(bus, k, w), n)
                rounds.append((rr, rp, lr, lp))
                print(f"round {r}: remote {rr:,.0f} pairs/s p50 {rp:,.0f} us; "
                      f"local {lr:,.0f} pairs/s p50 {lp:,.0f} us")
        await peer.close()
        reconnect = await reconnect_ms(tmp, beta)
    finally:
        await beta.stop(signal.SIGKILL)
    rr, rp, lr, lp = (statistics.median(x) for x in zip(*rounds, strict=True))
    result = {
        "remote_pairs_per_s": round(rr, 1), "remote_p50_us": round(rp, 1),
        "local_pairs_per_s": round(lr, 1), "local_p50_us": round(lp, 1),
        "remote_ratio": round(rr / lr, 3), "reconnect_ms": round(reconnect, 1),
    }
    print(f"remote/local pairs per second: {result['remote_ratio']} (target >= 0.5)")
    print(f"reconnect after the peer restarts: {result['reconnect_ms']} ms")
    return result


async def reconnect_ms(tmp: Path, beta: DaemonProcess) -> float:
    """alpha (a daemon) dials beta; beta is killed and restarted on the same port."""
    port = port_of(beta)
    beta_key = load_identity(tmp / "beta" / "identity.key", "beta").public_line
    organism(tmp / "alpha", "alpha", [{"name": "beta", "public_key": beta_key,
                                       "url": f"wss://127.0.0.1:{port}/federation"}])
    alpha_line = load_identity(tmp / "alpha" / "identity.key", "alpha").public_line
    edit_config(tmp / "beta", lambda doc: (
        doc["federation"].update(listen=f"127.0.0.1:{port}"),
        doc["gateways"][0].update(public_key=alpha_line)))
    await beta.stop(signal.SIGKILL)
    beta2 = await DaemonProcess(tmp / "beta").start()
    a = await DaemonProcess(tmp / "alpha").start()
    try:
        await a.wait_for_line(r"federation gateway=beta up")
        mark = len(a.log)
        await beta2.stop(signal.SIGKILL)
        await a.wait_for_line(r"federation gateway=beta down", after=mark)
        beta3 = await DaemonProcess(tmp / "beta").start()
        try:
            ready = next(line for line in beta3.log if _FEDERATION.search(line))
            up = await a.wait_for_line(r"federation gateway=beta up", after=mark)
            return (ts_of(up) - ts_of(ready)) * 1000
        finally:
            await beta3.stop(signal.SIGKILL)
    finally:
        await a.stop(signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI size: under a minute")
    result = asyncio.run(bench(parser.parse_args()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
