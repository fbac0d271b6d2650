"""Timer firing lateness: N timers due in the same second, through the real pump,
kernel and deadline scheduler, against bare `loop.call_at` callbacks due at one
instant in the same run.

Each timer is set by a client's `wait` (its row committed with the step that
handled it); lateness is the time from its due instant to the `woke` frame handed to
the client (after the commit of the step that fired it). Target: p99 <= 1,000 ms
for 1,000 timers.

A section of benchmarks/tools.py (`python benchmarks/tools.py [--quick]`).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd._envelope import build_envelope, parse_envelope  # noqa: E402
from agentd._threads import new_uuid  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.config import load_config_text  # noqa: E402
from agentd.durable import Wait  # noqa: E402
from agentd.testing import Harness  # noqa: E402

ORGANISM = """
organism: {name: timers-bench}
profiles:
  public: {listeners: [clock]}
listeners:
  - name: clock
    tool: {kind: timer, max_delay_s: 600, max_pending_per_thread: 16}
"""
LEAD_S = 2.0  # the timers are all due this long after the first is set


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]


async def baseline(n: int) -> list[float]:
    loop = asyncio.get_running_loop()
    due = loop.time() + 0.2
    late: list[float] = []
    done = asyncio.Event()

    def fire() -> None:
        late.append(loop.time() - due)
        if len(late) == n:
            done.set()

    for _ in range(n):
        loop.call_at(due, fire)
    await done.wait()
    return late


async def timers(n: int) -> tuple[list[float], float]:
    config = load_config_text(ORGANISM, base_dir=Path(tempfile.gettempdir()))
    spec = spec_of(Wait)
    with tempfile.TemporaryDirectory(prefix="agentd-timers-") as state:
        delivered: dict[str, float] = {}
        every = asyncio.Event()

        class Timed(Harness):
            """Notes when each `woke` reaches the client."""

            def _deliver(self, client: str, thread: str, data: bytes, oid: int | None) -> None:
                if b"woke" in data and parse_envelope(data).payload.tag.endswith("}woke"):
                    delivered[thread] = time.time()
                    if len(delivered) == n:
                        every.set()
                super()._deliver(client, thread, data, oid)

        async with Timed(config, {"alice": "public"}, state_dir=Path(state)) as h:
            due_at = time.time() + LEAD_S
            started = time.perf_counter()
            sends = []
            for _ in range(n):
                seconds = Decimal(f"{max(0.0, due_at - time.time()):.6f}")
                data = build_envelope("alice", new_uuid(), spec.to_bytes(Wait(seconds=seconds)))
                sends.append(h.pump.submit("alice", data))
            await asyncio.gather(*sends)
            await h.run_until_idle()
            set_s = time.perf_counter() - started
            due = {t.conversation: t.due for t in h.pump.waits.timers.values()}
            if len(due) != n:
                raise SystemExit(f"only {len(due)} of {n} timers were set before they were due")
            await asyncio.wait_for(every.wait(), LEAD_S + 120)
            await h.run_until_idle()
            return [delivered[t] - due[t] for t in due], set_s


async def measure(quick: bool) -> dict[str, float]:
    """Print readable lines and return the figures (a section of benchmarks/tools.py)."""
    del quick  # 1,000 timers is the figure and already runs well under a minute
    n = 1000
    base = await baseline(n)
    late, set_s = await timers(n)
    late_ms = [x * 1000 for x in late]
    base_ms = [x * 1000 for x in base]
    print(f"timers set: {n} in {set_s:.2f} s (each committed with its wait)")
    print(f"fired late: p50 {statistics.median(late_ms):.1f} ms, p99 {p99(late_ms):.1f} ms, "
          f"max {max(late_ms):.1f} ms (target p99 <= 1000 ms)")
    print(f"baseline loop.call_at x{n}: p50 {statistics.median(base_ms):.2f} ms, "
          f"p99 {p99(base_ms):.2f} ms")
    return {
        "timer_fire_late_p99_ms": round(p99(late_ms), 1),
        "timer_fire_late_p50_ms": round(statistics.median(late_ms), 1),
        "baseline_call_at_late_p99_ms": round(p99(base_ms), 2),
    }
