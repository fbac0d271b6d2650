"""A call to a peer organism's listener against the same call to a local one, in one run.

Two `agentd run` processes on 127.0.0.1. "beta" serves `calculator.add` and exports
it to the gateway "alpha"; "alpha" dials beta, imports it (pinned at the first
link-up) and has its own `calculator.add`. One bus client of alpha (TLS WebSocket,
TOTP) sends the same requests to `beta:calculator.add` (alpha's journal, the link,
beta's journal and handler, the reply back through alpha's journal) and to
`calculator.add` (alpha alone): pipelined (WINDOW outstanding) for pairs per second,
then one at a time for the round trip, in alternating rounds. Then beta is killed
with SIGKILL and restarted on the same port: `reconnect_ms` runs from beta being
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
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd.client import BusClient  # noqa: E402
from agentd.federation import load_identity  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402
from tests.daemon_process import DaemonProcess, edit_config, make_home  # noqa: E402

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
        doc["bus"].update(rate_per_s=1e9, rate_burst=1_000_000)  # measure, not throttle

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
        acquire = asyncio.ensure_future(sem.acquire())
        await asyncio.wait((acquire, task), return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # the reader failed (a wrong answer): say why, never hang
            acquire.cancel()
            task.result()
        thread, send = request(i)
        started[thread] = time.perf_counter()
        await send
    await task
    return done


async def calls(bus: BusClient, to: str, n: int, window: int) -> list[float]:
    """`n` additions sent by alpha's client to listener `to`; each answer checked."""
    from agentd._envelope import build_envelope, parse_envelope
    from agentd._xmlify import from_xml, spec_of, to_xml
    from agentd.client import is_answer
    from agentd.tools.calculator import Sum

    expected: dict[str, int] = {}

    def request(i: int) -> tuple[str, Awaitable[None]]:
        thread = str(uuid.uuid4())
        expected[thread] = i + 1
        return thread, bus.send_raw(build_envelope("alice", thread, to_xml(Add(a=i, b=1)), to=to))

    async def answered() -> str | None:
        frame = await bus.recv()
        if not is_answer(frame):
            return None
        env = parse_envelope(frame)
        from lxml import etree

        if env.payload.tag != spec_of(Sum).clark:
            raise RuntimeError(f"{to} did not answer with a sum: {frame!r}")
        got = from_xml(Sum, etree.tostring(env.payload)).value
        if got != expected.pop(env.thread):
            raise RuntimeError(f"wrong answer from {to}: {frame!r}")
        return env.thread

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
    organism(tmp / "alpha", "alpha", [])
    organism(tmp / "beta", "beta", [{"name": "alpha", "public_key": line(tmp, "alpha"),
                                     "profile": "public", "export": ["calculator.add"]}])
    beta = await DaemonProcess(tmp / "beta").start()
    port = port_of(beta)

    def dial(doc: dict[str, Any]) -> None:
        doc["gateways"] = [{"name": "beta", "public_key": line(tmp, "beta"),
                            "url": f"wss://127.0.0.1:{port}/federation",
                            "import": ["calculator.add"]}]
        doc["profiles"]["public"]["listeners"].append("beta:calculator.add")

    edit_config(tmp / "alpha", dial)
    edit_config(tmp / "beta", lambda doc: doc["federation"].update(listen=f"127.0.0.1:{port}"))
    alpha = await DaemonProcess(tmp / "alpha").start()
    try:
        await alpha.wait_for_line(r"reloaded for newly pinned peer schemas")
        async with BusClient(alpha.url, "alice", secret=alpha.secret,
                             cafile=alpha.cafile) as bus:
            await calls(bus, "beta:calculator.add", 50, WINDOW)  # warm-up, both ways
            await calls(bus, "calculator.add", 50, WINDOW)
            rounds = []
            for r in range(5 if args.quick else 7):
                rr, rp = await pairs_and_p50(
                    lambda k, w: calls(bus, "beta:calculator.add", k, w), n)
                lr, lp = await pairs_and_p50(lambda k, w: calls(bus, "calculator.add", k, w), n)
                rounds.append((rr, rp, lr, lp))
                print(f"round {r}: remote {rr:,.0f} pairs/s p50 {rp:,.0f} us; "
                      f"local {lr:,.0f} pairs/s p50 {lp:,.0f} us; ratio {rr / lr:.3f}")
        reconnect = await reconnect_ms(alpha, beta)
    finally:
        await alpha.stop(signal.SIGKILL)
    rr, rp, lr, lp = (statistics.median(x) for x in zip(*rounds, strict=True))
    ratios = [r[0] / r[2] for r in rounds]
    result = {
        "remote_pairs_per_s": round(rr, 1), "remote_p50_us": round(rp, 1),
        "local_pairs_per_s": round(lr, 1), "local_p50_us": round(lp, 1),
        "remote_ratio": round(statistics.median(ratios), 3),
        "reconnect_ms": round(reconnect, 1),
    }
    print(f"remote/local pairs per second: {result['remote_ratio']} (median of rounds "
          f"{min(ratios):.3f}-{max(ratios):.3f}; target >= 0.5)")
    print(f"reconnect after the peer restarts: {result['reconnect_ms']} ms")
    return result


def line(tmp: Path, name: str) -> str:
    return load_identity(tmp / name / "identity.key", name).public_line


async def reconnect_ms(alpha: DaemonProcess, beta: DaemonProcess) -> float:
    """beta is killed and restarted on the same port; alpha redials it."""
    mark = len(alpha.log)
    await beta.stop(signal.SIGKILL)
    await alpha.wait_for_line(r"federation gateway=beta down", after=mark)
    again = await DaemonProcess(beta.home).start()
    try:
        ready = next(line for line in again.log if _FEDERATION.search(line))
        up = await alpha.wait_for_line(r"federation gateway=beta up", after=mark)
        return (ts_of(up) - ts_of(ready)) * 1000
    finally:
        await again.stop(signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI size: under a minute")
    result = asyncio.run(bench(parser.parse_args()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
