"""Folds on and off, side by side: two pumps of the demo organism, each over a kernel
of its own (SQLite WAL, the writer process), one with `Kernel.fold` (the default) and
one without, in one process, taking turns in short chunks.

    python benchmarks/fold.py [--quick]

Lone conversations: each envelope is sent once the previous answer arrived (the
light load folds are for); the figure is the median over cycles of the per-cycle
ratio of p50 round trips, fold on over off (below 1: folds help). Then 64 concurrent
conversations (where folds rarely apply): the median per-cycle ratio of pairs/s.
Delivery marks go through the daemon's `KernelOutbox`, as on the bus. Chunks
alternate in order each cycle, so a machine whose speed drifts skews both alike.
The last line is one JSON object: fold_lone_p50_ratio, fold_lone_p50_us,
nofold_lone_p50_us, fold_w64_ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import uvloop  # noqa: E402
from pump import envelopes  # noqa: E402

from agentd._daemon import KernelOutbox  # noqa: E402
from agentd._routing import Routing  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._xml import parse_untrusted  # noqa: E402
from agentd.config import load_config  # noqa: E402
from agentd.kernel import Kernel  # noqa: E402
from agentd.pump import Pump, PumpOptions  # noqa: E402

CONCURRENT = 64


class Arm:
    """A pump over its own kernel; `answered[thread]` is set when its answer arrives."""

    def __init__(self, pump: Pump, kernel: Kernel) -> None:
        self.pump = pump
        self.kernel = kernel
        self.answered: dict[str, asyncio.Event] = {}

    @classmethod
    async def start(cls, state_dir: Path, fold: bool) -> Arm:
        config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
        kernel = await Kernel.open(state_dir)
        kernel.fold = fold
        outbox = KernelOutbox(kernel)
        arm: Arm

        def deliver(client: str, thread: str, frame: bytes, oid: int | None) -> None:
            if oid is not None:
                outbox.delivered(client, oid)  # as the bus does once the frame is sent
            if b"<from>core</from>" not in frame:
                arm.answered.pop(thread).set()

        pump = Pump(Routing.build(config), {"alice": "public"}, deliver, PumpOptions(config.pump),
                    kernel)
        arm = cls(pump, kernel)
        await pump.start()
        return arm

    async def converse(self, raw: bytes) -> float:
        thread = parse_untrusted(raw)[0][-1].text or ""
        self.answered[thread] = done = asyncio.Event()
        t0 = time.perf_counter()
        result = await self.pump.submit("alice", raw)
        assert result.accepted, result
        await done.wait()
        return time.perf_counter() - t0

    async def lone(self, data: Iterator[bytes], n: int) -> float:
        """p50 of `n` conversations one at a time."""
        return statistics.median([await self.converse(next(data)) for _ in range(n)])

    async def concurrent(self, data: Iterator[bytes], n: int) -> float:
        """Pairs per second of `n` conversations, CONCURRENT at a time."""
        work = iter([next(data) for _ in range(n)])

        async def client() -> None:
            for raw in work:
                await self.converse(raw)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONCURRENT)))
        return n / (time.perf_counter() - t0)

    async def stop(self) -> None:
        await self.pump.stop()
        await self.kernel.close()


async def cycles_of(on: Arm, off: Arm, cycles: int, chunk: int, data: Iterator[bytes],
                    lone: bool) -> tuple[list[float], list[float]]:
    ons: list[float] = []
    offs: list[float] = []
    for c in range(cycles):
        for arm in (on, off) if c % 2 == 0 else (off, on):
            figure = await (arm.lone(data, chunk) if lone else arm.concurrent(data, chunk))
            (ons if arm is on else offs).append(figure)
    return ons, offs


async def bench(quick: bool) -> dict[str, float]:
    lone_chunk, lone_cycles = (100, 10) if quick else (200, 20)
    load_chunk, load_cycles = (500, 8) if quick else (1000, 16)
    total = 2 * (lone_chunk * lone_cycles + load_chunk * load_cycles) + 400
    data = iter(envelopes(total))
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        on, off = await Arm.start(Path(a), True), await Arm.start(Path(b), False)
        try:
            for arm in (on, off):  # warm-up
                await arm.lone(data, 100)
            lone_on, lone_off = await cycles_of(on, off, lone_cycles, lone_chunk, data, True)
            rate_on, rate_off = await cycles_of(on, off, load_cycles, load_chunk, data, False)
        finally:
            await on.stop()
            await off.stop()
    lone = [x / y for x, y in zip(lone_on, lone_off, strict=True)]
    load = [x / y for x, y in zip(rate_on, rate_off, strict=True)]
    q = statistics.quantiles(lone, n=4)
    print(f"lone p50, fold on/off per cycle: median {statistics.median(lone):.3f}, quartiles "
          f"{q[0]:.3f}..{q[2]:.3f}; p50 on {statistics.median(lone_on) * 1e6:.0f} us, off "
          f"{statistics.median(lone_off) * 1e6:.0f} us")
    q = statistics.quantiles(load, n=4)
    print(f"{CONCURRENT} concurrent, pairs/s fold on/off per cycle: median "
          f"{statistics.median(load):.3f}, quartiles {q[0]:.3f}..{q[2]:.3f}; on "
          f"{statistics.median(rate_on):,.0f}/s, off {statistics.median(rate_off):,.0f}/s")
    return {
        "fold_lone_p50_ratio": round(statistics.median(lone), 3),
        "fold_lone_p50_us": round(statistics.median(lone_on) * 1e6, 1),
        "nofold_lone_p50_us": round(statistics.median(lone_off) * 1e6, 1),
        "fold_w64_ratio": round(statistics.median(load), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes (seconds)")
    args = parser.parse_args()
    tune_gc()
    print(json.dumps(uvloop.run(bench(args.quick))))


if __name__ == "__main__":
    main()
