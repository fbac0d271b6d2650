"""Many model calls in flight: a real daemon, a slow OpenAI-compatible backend.

    python benchmarks/llm_inflight.py [--quick] [--n N] [--delay S] [--bare-only | --no-bare]

A scripted backend (tests.llm_servers.FakeLLM: real HTTP/1.1 on loopback, keep-alive)
answers every chat completion after `--delay` seconds (2). A real `agentd run` child
process (a home made by `agentd init`, the tutor agent pointed at that backend, the
pump, listener and bus limits raised above N, the backend's `max_concurrency` N
unless `--backend-concurrency` says otherwise) gets N concurrent conversations
(1,000; `--quick` 200) from one bus client over TLS WebSocket, each one question
answered by one model call.

Reported (the last line is one JSON object):

- `done_after_last_start_s`: from the last question sent to the last answer back;
  with a backend that waits `delay`, `delay` is its floor. `arrival_spread_s`: from
  the first request at the backend to the last;
- `daemon_cpu_s` (main process and children) over the round, `cpu_ms_per_conv`, and
  `wait_cpu_fraction`: the daemon's CPU seconds per wall second while all N calls
  wait at the backend (0 is idle, 1 a whole core; null when the calls did not all
  arrive before the first answer was due);
- `rss_kb_per_waiting_conv`: the daemon's RSS with all N waiting, less before the
  round, per conversation;
- `backend_connections`: connections the backend accepted during the round;
- `held_wait_cpu_fraction`, `held_rss_kb_per_waiting_conv`: a second round in which
  the backend holds every answer until all N calls wait there: the daemon's CPU
  over one second of that wait (CPU seconds per second), and its RSS then less
  before the round, per conversation (steady figures on a loaded machine, where
  the first round's calls may not all wait at once);
- `bare_*`: the same N requests from a bare HTTP client in a child process against
  the same backend, measured in the same run: aiohttp, httpx with one pool of N
  connections, and httpx as 16 clients of N/16 (its pool's cost grows with
  connections times waiting requests, so sharding is the one tuning that helps).

The load average is printed beside the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from _process import cpu_s, rss_kb, run  # noqa: E402

from tests.llm_servers import FakeLLM, Reply, Seen  # noqa: E402

ANSWER = "Two and two make 4."


class CountingLLM(FakeLLM):
    """FakeLLM that counts the connections it accepts and stamps each request."""

    def __init__(self, delay_s: float) -> None:
        super().__init__("openai", [Reply(ANSWER, delay_s=delay_s)])
        self.connections = 0
        self.arrivals: list[float] = []
        self.held: asyncio.Event | None = None  # set: answers wait for it

    async def start(self) -> CountingLLM:
        # A backlog for a burst of N connections (asyncio's 100 would drop SYNs).
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await super()._serve(reader, writer)

    async def _delay(self, seen: Seen, reply: Reply) -> None:
        """Stamped as it arrives; while `held` is set, the answer waits for it."""
        self.arrivals.append(time.monotonic())
        if self.held is not None:
            await self.held.wait()
        else:
            await super()._delay(seen, reply)


def make_home(home: Path, base_url: str, n: int, concurrency: int) -> Path:
    from agentd._cli_bus import init_home

    init_home(home, port=0, metrics="127.0.0.1:0")
    path = home / "organism.yaml"
    doc = yaml.safe_load(path.read_text())
    room = n + 100
    doc["pump"].update(max_concurrency=room, per_listener_concurrency=room,
                       handler_timeout_s=120)
    doc["bus"].update(max_inflight=room, rate_per_s=float(room), rate_burst=room)
    backend = {"name": "tutor-model", "provider": "openai", "base_url": base_url,
               "model": "fake-1", "timeout_s": 60}
    backend["max_concurrency"] = concurrency
    doc["llm"]["backends"] = [backend]
    doc["llm"]["retries"] = 0
    for listener in doc["listeners"]:
        if listener["name"] == "tutor":
            listener["max_concurrency"] = room
            listener["agent"]["token_budget"] = 10**9
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


async def round_(client: Any, server: CountingLLM, pid: int, n: int,
                 delay: float) -> dict[str, Any]:
    from agentd.platform.demo import MathQuestion

    server.arrivals.clear()
    server.connections = 0
    rss0, cpu0 = rss_kb(pid), cpu_s(pid)
    started = time.monotonic()
    exchanges = [await client.start(MathQuestion(text=f"What is {i} + 4?"), timeout=120)
                 for i in range(n)]
    last_start = time.monotonic()
    results = asyncio.gather(*(e.result() for e in exchanges), return_exceptions=True)
    # Wait (polling the backend, in this process) until every call waits there.
    while len(server.arrivals) < n and not results.done():
        await asyncio.sleep(0.01)
    all_in = time.monotonic()
    first_due = server.arrivals[0] + delay if server.arrivals else all_in
    rss_wait = rss_kb(pid)
    cpu_in = cpu_s(pid)
    window = first_due - 0.1 - all_in
    wait_fraction = None
    if window > 0.3 and len(server.arrivals) >= n:
        await asyncio.sleep(window)
        wait_fraction = (cpu_s(pid) - cpu_in) / window
    answers = await results
    done = time.monotonic()
    cpu = cpu_s(pid) - cpu0
    failed = [a for a in answers if isinstance(a, BaseException)]
    wrong = sum(1 for a in answers if not isinstance(a, BaseException) and "4" not in str(a))
    return {
        "n": n,
        "done_after_last_start_s": round(done - last_start, 3),
        "send_s": round(last_start - started, 3),
        "arrival_spread_s": round(server.arrivals[-1] - server.arrivals[0], 3)
        if server.arrivals else None,
        "daemon_cpu_s": round(cpu, 2),
        "cpu_ms_per_conv": round(cpu / n * 1000, 2),
        "wait_cpu_fraction": None if wait_fraction is None else round(wait_fraction, 3),
        "rss_kb_per_waiting_conv": round((rss_wait - rss0) / n, 1),
        "backend_connections": server.connections,
        "backend_requests": len(server.arrivals),
        "arrival_deciles_s": [round(server.arrivals[min(len(server.arrivals) - 1, i * n // 10)]
                                    - started, 2) for i in range(11)] if server.arrivals else [],
        "wrong_answers": wrong,
        "failed": len(failed),
        "first_failure": str(failed[0])[:200] if failed else None,
    }


async def held_round(client: Any, server: CountingLLM, pid: int, n: int) -> dict[str, Any]:
    """The backend holds every answer until all N calls wait there: the daemon's CPU
    over a second of that wait and its RSS then, whatever the arrival spread."""
    from agentd.platform.demo import MathQuestion

    server.arrivals.clear()
    server.held = asyncio.Event()
    rss0 = rss_kb(pid)
    exchanges = [await client.start(MathQuestion(text=f"What is {i} + 4?"), timeout=300)
                 for i in range(n)]
    results = asyncio.gather(*(e.result() for e in exchanges), return_exceptions=True)
    while len(server.arrivals) < n and not results.done():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # what the last arrivals set going settles
    rss_wait, cpu_in, wall_in = rss_kb(pid), cpu_s(pid), time.monotonic()
    await asyncio.sleep(1.0)
    fraction = (cpu_s(pid) - cpu_in) / (time.monotonic() - wall_in)
    server.held.set()
    server.held = None
    answers = await results
    return {"held_wait_cpu_fraction": round(fraction, 3),
            "held_rss_kb_per_waiting_conv": round((rss_wait - rss0) / n, 1),
            "held_failed": sum(1 for a in answers if isinstance(a, BaseException))}


async def daemon_rounds(args: argparse.Namespace, server: CountingLLM) -> dict[str, Any]:
    from agentd.client import Client
    from tests.daemon_process import DaemonProcess

    with tempfile.TemporaryDirectory(prefix="agentd-inflight-") as tmp:
        home = Path(tmp) / "home"
        make_home(home, server.base_url, args.n, args.backend_concurrency)
        daemon = await DaemonProcess(home).start()
        try:
            assert daemon.proc is not None
            pid = daemon.proc.pid
            async with Client.connect(daemon.url, "alice", secret=daemon.secret,
                                      cafile=daemon.cafile) as client:
                await round_(client, server, pid, 20, args.delay)  # warm up
                result = await round_(client, server, pid, args.n, args.delay)
                result.update(await held_round(client, server, pid, args.n))
        finally:
            await daemon.stop()
        if result["failed"]:
            errors = [line for line in daemon.log if "ERROR" in line or "WARNING" in line]
            print("".join(errors[-10:]), file=sys.stderr)
        return result


# ---- a bare client, in a child process -------------------------------------------------


async def bare(lib: str, url: str, n: int) -> dict[str, Any]:
    body = json.dumps({"model": "fake-1", "messages": [{"role": "user", "content": "hi"}]})
    headers = {"content-type": "application/json"}
    before = resource.getrusage(resource.RUSAGE_SELF)
    if lib == "aiohttp":
        import aiohttp

        conn = aiohttp.TCPConnector(limit=n)
        async with aiohttp.ClientSession(connector=conn) as session:
            async def one() -> int:
                async with session.post(url, data=body, headers=headers) as reply:
                    await reply.read()
                    return reply.status
            t0 = time.monotonic()
            statuses = await asyncio.gather(*(one() for _ in range(n)))
    else:
        import httpx

        # httpx: one pool of n connections; httpx_sharded: 16 clients of n/16 each
        # (its pool's cost grows with connections x waiting requests).
        shards = 16 if lib == "httpx_sharded" else 1
        size = -(-n // shards)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        clients = [httpx.AsyncClient(limits=limits, timeout=120) for _ in range(shards)]

        async def one(i: int) -> int:
            reply = await clients[i % shards].post(url, content=body, headers=headers)
            return reply.status_code
        t0 = time.monotonic()
        statuses = await asyncio.gather(*(one(i) for i in range(n)))
        for client in clients:
            await client.aclose()
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "ok": sum(1 for s in statuses if s == 200)}


async def bare_rounds(args: argparse.Namespace, server: CountingLLM) -> dict[str, Any]:
    out: dict[str, Any] = {}
    url = server.base_url + "/chat/completions"
    for lib in ("aiohttp", "httpx", "httpx_sharded"):
        server.connections = 0
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--bare", lib, url, str(args.n),
            stdout=asyncio.subprocess.PIPE, cwd=ROOT)
        stdout, _ = await proc.communicate()
        figures = json.loads(stdout.decode().strip().splitlines()[-1])
        out.update({f"bare_{lib}_{k}": v for k, v in figures.items()})
        out[f"bare_{lib}_connections"] = server.connections
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    async with CountingLLM(args.delay) as server:
        result: dict[str, Any] = {}
        if not args.bare_only:
            result.update(await daemon_rounds(args, server))
        if not args.no_bare:
            result.update(await bare_rounds(args, server))
    result["loadavg"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 conversations")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--delay", type=float, default=2.0)
    parser.add_argument("--bare-only", action="store_true")
    parser.add_argument("--no-bare", action="store_true", help="the daemon's round only")
    parser.add_argument("--backend-concurrency", type=int, default=None,
                        help="the backend's max_concurrency (default: N)")
    parser.add_argument("--bare", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        lib, url, n = args.bare
        print(json.dumps(run(bare(lib, url, int(n)))))
        return
    args.n = args.n or (200 if args.quick else 1000)
    args.backend_concurrency = args.backend_concurrency or args.n
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    result = run(bench(args))
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
