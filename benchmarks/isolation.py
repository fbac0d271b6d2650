"""Handler isolation against the same handler in process, in one process run.

(a) throughput: request/response pairs through the pump (no kernel, so the
    handler path dominates), the same echo handler in process, in a pool of two
    confined workers and in a pool of one (the default). The three pumps are up
    side by side and take turns in short chunks, the order rotated each cycle: this
    machine's speed swings by 2x within seconds, and a chunk of each arm within a
    fraction of a second sees the same machine (`isolated_ratio`,
    `isolated_1w_ratio`: the median of the per-cycle ratios isolated / in process;
    the rates are total requests over total time). On two cores, two workers and
    the daemon share them; one worker and the daemon have one each, and that worker
    spins for its next call instead of sleeping (no kernel writer competes here; a
    journaling daemon needs three cores for that: `agentd/isolation/_pool.py`
    `spins`);
(b) overhead: one 1 KiB round trip through a worker (the pool's handler, given the
    validated payload element as the pump gives it) against the same handler awaited
    in process on the object the pump would build from that element, sequential,
    p50 of the difference; and the
    floor of any worker design on this machine, measured alongside: the same bytes
    through a pipe pair to a bare child process that only echoes them
    (`pipe_floor_p50_us`; `overhead_over_floor` = the isolated round trip over it);
(c) replacement: a worker killed with SIGKILL, then the time until the next call
    is served by its replacement, the pool's ready spare (`worker_replace_ms`,
    median of a few).

Both sides run on uvloop, as the daemon does. Usage: python benchmarks/isolation.py
[--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lxml import etree  # noqa: E402

from agentd._envelope import build_envelope  # noqa: E402
from agentd._handler import HandlerMetadata  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.config import load_config  # noqa: E402
from agentd.testing import Harness  # noqa: E402
from tests.isolated.handlers import Probe, probe  # noqa: E402

TEXT = "x" * 1024
# A child that echoes length-prefixed frames: a round trip with no work at all.
ECHO = """
import os, struct
def read(n):
    b = b""
    while len(b) < n:
        c = os.read(0, n - len(b))
        if not c:
            raise SystemExit
        b += c
    return b
while True:
    head = read(4)
    body = read(struct.unpack(">I", head)[0])
    os.write(1, head + body)
"""


async def floor_child() -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", ECHO, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE)


async def floor_round_trip(proc: asyncio.subprocess.Process, frame: bytes) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(frame)
    await proc.stdin.drain()
    await proc.stdout.readexactly(len(frame))


def organism(folder: Path, isolation: str | None) -> Path:
    path = folder / f"organism-{uuid.uuid4().hex[:6]}.yaml"
    iso = f"\n    isolation: {isolation}" if isolation else ""
    path.write_text(textwrap.dedent("""
        organism: {name: isolation-bench}
        pump: {max_concurrency: 64}
        listeners:
          - name: prober
            payload_class: tests.isolated.handlers:Probe
            response_class: tests.isolated.handlers:Outcome
            handler: tests.isolated.handlers:probe
            description: Echoes.""") + iso + "\nprofiles:\n  public: {listeners: all}\n")
    return path


class Arm:
    """One pump (in process, or with its handler in a pool), up for the whole run."""

    def __init__(self, name: str, config_path: Path) -> None:
        self.name = name
        self.config = load_config(config_path)
        self.elapsed = 0.0
        self.requests = 0
        self.rates: list[float] = []
        self._spec = spec_of(Probe)

    def data(self, n: int) -> list[bytes]:
        return [build_envelope("alice", str(uuid.uuid4()), self._spec.to_bytes(Probe("echo", TEXT)))
                for _ in range(n)]

    async def chunk(self, h: Harness, data: list[bytes]) -> None:
        """`data` through the pump until every answer is delivered, timed."""
        before = h.pump.handled
        t0 = time.perf_counter()
        for d in data:
            await h.pump.submit("alice", d)
        await h.run_until_idle()
        elapsed = time.perf_counter() - t0
        assert h.pump.handled - before == len(data), "not every request was handled"
        self.elapsed += elapsed
        self.requests += len(data)
        self.rates.append(len(data) / elapsed)

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed


async def throughput(arms: list[Arm], cycles: int, chunk: int) -> None:
    async with contextlib.AsyncExitStack() as stack:
        pumps = [await stack.enter_async_context(
            Harness(arm.config, {"alice": "public"}, durable=False)) for arm in arms]
        for arm, h in zip(arms, pumps, strict=True):  # warm-up, untimed
            for d in arm.data(200):
                await h.pump.submit("alice", d)
            await h.run_until_idle()
        for cycle in range(cycles):
            batches = [arm.data(chunk) for arm in arms]  # built before any is timed
            order = list(range(len(arms)))
            order = order[cycle % len(order):] + order[:cycle % len(order)]
            for i in order:
                await arms[i].chunk(pumps[i], batches[i])


async def overhead_and_replace(folder: Path, rounds: int, replaces: int
                               ) -> tuple[float, float, float, float]:
    config = load_config(organism(folder, "{workers: 1}"))
    meta = HandlerMetadata(str(uuid.uuid4()), "alice", "prober")
    spec = spec_of(Probe)
    element = etree.fromstring(spec.to_bytes(Probe("echo", TEXT)))
    echo = await floor_child()
    frame = len(TEXT).to_bytes(4, "big") + TEXT.encode()
    async with Harness(config, {"alice": "public"}, durable=False) as h:
        pool = h.isolation.pools["prober"]
        handler = pool.handler
        for _ in range(50):
            await handler(element, meta)
            await floor_round_trip(echo, frame)
        inproc, isolated, floor = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await probe(spec.from_element(element), meta)
            t1 = time.perf_counter()
            await handler(element, meta)
            t2 = time.perf_counter()
            await floor_round_trip(echo, frame)
            t3 = time.perf_counter()
            inproc.append(t1 - t0)
            isolated.append(t2 - t1)
            floor.append(t3 - t2)
        echo.kill()
        await echo.wait()
        overhead_us = (statistics.median(isolated) - statistics.median(inproc)) * 1e6
        floor_us = statistics.median(floor) * 1e6
        print(f"round trip 1 KiB: in process p50 {statistics.median(inproc) * 1e6:.1f} us, "
              f"isolated p50 {statistics.median(isolated) * 1e6:.1f} us, bare pipe echo "
              f"p50 {floor_us:.1f} us")
        print(f"worker RSS: {pool._idle[0].rss_mb():.1f} MiB")
        times = []
        for _ in range(replaces):
            while not pool.status()["spare"]:  # a spare is ready again
                await asyncio.sleep(0.01)
            worker = pool._idle[0]
            t0 = time.perf_counter()
            os.kill(worker.pid, signal.SIGKILL)
            while worker.state.value != "dead":  # the pool notices through the pidfd
                await asyncio.sleep(0.0005)
            await handler(element, meta)  # waits for the replacement
            times.append((time.perf_counter() - t0) * 1000)
        print("worker replaced and next call served (ms): "
              + ", ".join(f"{t:.0f}" for t in times))
    return overhead_us, statistics.median(times), floor_us, statistics.median(isolated) * 1e6


async def main(quick: bool) -> dict[str, float]:
    tune_gc()  # the daemon's process tuning (agentd/_runtime.py), for every arm
    cycles, chunk = (16, 500) if quick else (60, 1_000)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        inproc = Arm("in process", organism(folder, None))
        two = Arm("2 workers", organism(folder, "{workers: 2}"))
        one = Arm("1 worker", organism(folder, "{workers: 1}"))
        await throughput([inproc, two, one], cycles, chunk)
        ratios = [a / b for a, b in zip(two.rates, inproc.rates, strict=True)]
        single_ratios = [a / b for a, b in zip(one.rates, inproc.rates, strict=True)]
        for arm in (inproc, two, one):
            print(f"{arm.name}: {arm.rate:,.0f} pairs/s ({arm.requests} requests in "
                  f"{cycles} chunks; chunks {min(arm.rates):,.0f}..{max(arm.rates):,.0f})")
        for name, rs in (("2 workers", ratios), ("1 worker", single_ratios)):
            q = statistics.quantiles(rs, n=4)
            print(f"isolated/in-process per cycle, {name}: median {statistics.median(rs):.3f}, "
                  f"quartiles {q[0]:.3f}..{q[2]:.3f}, range {min(rs):.3f}..{max(rs):.3f}")
        overhead, replace, floor, round_trip = await overhead_and_replace(
            folder, 500 if quick else 5_000, 3 if quick else 10)
    return {
        "isolated_pairs_per_s": round(two.rate, 1),
        "inprocess_pairs_per_s": round(inproc.rate, 1),
        "isolated_ratio": round(statistics.median(ratios), 3),
        "isolated_1w_pairs_per_s": round(one.rate, 1),
        "isolated_1w_ratio": round(statistics.median(single_ratios), 3),
        "isolated_overhead_p50_us": round(overhead, 1),
        "worker_replace_ms": round(replace, 1),
        "pipe_floor_p50_us": round(floor, 1),
        "overhead_over_floor": round(round_trip / floor, 2),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    import uvloop  # the daemon's loop (agentd run installs it)

    result = uvloop.run(main(ap.parse_args().quick))
    print(json.dumps(result))
