"""The pump with traces off and on, in one process run: what a `telemetry:`
section costs.

Both arms run `benchmarks/pump.py`'s real pump on the same workload (a request to
a tool that replies, each on its own thread, 256 concurrent submitters), off and
on alternately, twice each; the best of each arm is kept. "On" exports every span
over OTLP/HTTP to a receiver on loopback in a process of its own
(tests/otlp_receiver.py, opentelemetry-proto's message classes), as a collector on
the same host would be; the SDK's batch processor and export thread run in the
pump's process. Each message is two spans (its `agentd.admit` and its handler's; no
journal, so no `agentd.commit`). Spans the bounded queue dropped are counted.

Usage: python benchmarks/telemetry.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from pump import envelopes, real_pump  # noqa: E402

from agentd import telemetry  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd.config import TelemetryConfig  # noqa: E402


def run(data: list[bytes]) -> float:
    rate, _ = asyncio.run(real_pump(data))
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    tune_gc()
    n = 5_000 if args.quick else 50_000
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    data = envelopes(n)
    run(data[:1000])  # warm-up
    off: list[float] = []
    on: list[float] = []
    receiver = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver"], cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert receiver.stdin is not None and receiver.stdout is not None
    try:
        cfg = TelemetryConfig(otlp_endpoint=receiver.stdout.readline().strip())
        for _ in range(2):
            telemetry.configure(None, "bench")
            off.append(run(data))
            telemetry.configure(cfg, "bench")
            on.append(run(data))
            telemetry.shutdown()  # exports what is queued before the next arm
        receiver.stdin.close()
        received = int(receiver.stdout.readline())
    finally:
        receiver.kill()
        receiver.wait()
    best_off, best_on = max(off), max(on)
    expected = 2 * 2 * n  # two "on" runs, each message an agentd.admit and a handler span
    dropped = expected - received
    print(f"messages per arm: {n}")
    print(f"pump, telemetry off: {best_off:,.0f} invocations/s (runs: "
          f"{', '.join(f'{x:,.0f}' for x in off)})")
    print(f"pump, telemetry on (OTLP/HTTP to loopback): {best_on:,.0f} invocations/s (runs: "
          f"{', '.join(f'{x:,.0f}' for x in on)})")
    print(f"on/off: {best_on / best_off:.2f}; spans received {received:,} of {expected:,} "
          f"(dropped by the bounded queue: {dropped:,})")
    print(json.dumps({
        "pump_off_per_s": round(best_off),
        "pump_on_per_s": round(best_on),
        "on_off_ratio": round(best_on / best_off, 3),
        "spans_received": received,
        "spans_dropped": dropped,
    }))


if __name__ == "__main__":
    main()
