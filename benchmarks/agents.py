"""The LLM platform's overhead per call, and many agent conversations at once.

(a) baseline: the pump's cost per hop, measured in this run (client requests to
    the calculator through the real pump, like benchmarks/pump.py);
(b) overhead of one `platform.complete()` call: context assembly (six layers,
    spotlighting), `validate_no_override`, budgets, routing, the provider's wire
    encoding and decoding, audit and history; everything except the time spent
    waiting on the HTTP exchange with a loopback backend that answers at once;
(c) 500 concurrent agent conversations through the pump (task -> model -> tool call
    -> calculator -> model -> answer), each with its own numbers; the fake provider
    checks that no request ever carries another conversation's data, and every
    answer is checked: `isolation_errors` counts both;
(d) the same with the agent isolated (`isolation: {workers: 2}`): its loop in two
    worker processes, every model call a request to the daemon
    (`isolated_agent_ratio` = isolated calls/s over in-process calls/s).

Usage: python benchmarks/agents.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd._envelope import build_envelope, parse_envelope  # noqa: E402
from agentd._routing import Routing  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.config import load_config  # noqa: E402
from agentd.platform import Platform, make_agent_handlers  # noqa: E402
from agentd.platform.demo import MathQuestion  # noqa: E402
from agentd.pump import Pump, PumpOptions  # noqa: E402
from agentd.testing import Harness  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402
from tests.llm_servers import (  # noqa: E402
    FakeLLM,
    Seen,
    add_call,
    load,
    numbers,
    openai_backend,
    organism_yaml,
    values,
)

TASK = ('<mathquestion xmlns="https://xml-pipeline.org/ns/agents/math-tutor/v1"><text>'
        "What is {n} doubled?</text></mathquestion>")
SUM = '<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>{v}</value></sum>'


async def pump_hop_us(n: int) -> float:
    """Microseconds per handler invocation of the real pump (calculator requests)."""
    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    spec = spec_of(Add)
    data = [build_envelope("alice", str(uuid.uuid4()), spec.to_bytes(Add(a=i, b=2)))
            for i in range(n)]
    pump = Pump(Routing.build(config), {"alice": "public"},
                lambda *_: None, PumpOptions(config.pump))
    await pump.start()
    start = time.perf_counter()
    for raw in data:
        await pump.submit("alice", raw)
    await pump.join()
    elapsed = time.perf_counter() - start
    await pump.stop()
    return elapsed / pump.handled * 1e6


def backend(server: FakeLLM) -> str:
    return openai_backend(server, extra=", max_concurrency: 8")


async def call_overhead(n: int) -> tuple[list[float], float]:
    """Per-call platform overhead (us) over `n` two-turn tasks, and calls per second
    of that sequential run."""
    async with FakeLLM("openai", ["<add><a>1</a><b>2</b></add>", "It is 3."]) as server:
        platform = Platform.from_config(load(organism_yaml(backend(server))))
        session = platform.session("tutor")
        overheads: list[float] = []
        calls = 0
        started = time.perf_counter()
        for i in range(n):
            thread = str(uuid.uuid4())
            for turn in range(2):
                t0 = time.perf_counter()
                if turn == 0:
                    session.begin(thread, TASK.format(n=i))
                else:
                    session.record(thread, SUM.format(v=i), source="calculator.add", xml=True)
                done = await session.complete(thread)
                overheads.append((time.perf_counter() - t0 - done.transport_s) * 1e6)
                calls += 1
            session.end(thread)
        elapsed = time.perf_counter() - started
        await platform.aclose()
    return overheads[min(20, n):], calls / elapsed  # the first calls warm caches up


async def conversations(n: int, isolated: bool = False) -> tuple[float, int, int]:
    """`n` concurrent agent conversations: (LLM calls per second, isolation errors,
    LLM calls). `isolated`: the tutor's loop runs in two worker processes."""
    contaminated = 0

    def script(seen: Seen) -> str:
        nonlocal contaminated
        conv = seen.conversation()
        (k,) = numbers(conv.task)[:1]
        for block in conv.blocks:
            for m in re.findall(r"<a>(-?\d+)</a>|<value>(-?\d+)</value>", block.content):
                if int(m[0] or m[1]) not in (k, 2 * k):
                    contaminated += 1
        got = values(conv.results)
        return add_call(k, k) if not got else f"{k} doubled is {got[0]}."

    with tempfile.TemporaryDirectory(prefix="agentd-bench-") as state:
        return await _conversations(n, isolated, state, script, lambda: contaminated)


async def _conversations(n: int, isolated: bool, state: str, script: Any,
                         contaminated: Any) -> tuple[float, int, int]:
    async with FakeLLM("openai", script) as server:
        extra = "\n    isolation: {workers: 2, memory_mb: 2048}" if isolated else ""
        # the state folder apart from the code a worker may read
        config = load(f"state_dir: {state}\n"
                      + organism_yaml(backend(server), tutor_extra=extra))
        handlers = make_agent_handlers(config)
        async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                           durable=False) as h:
            handlers.platform.bind_threads(h.pump.registry)
            start = time.perf_counter()
            results = await asyncio.gather(
                *(h.send("alice", MathQuestion(text=f"What is {k} doubled?")) for k in range(n))
            )
            elapsed = time.perf_counter() - start
        await handlers.platform.aclose()
    wrong = 0
    for k, frames in enumerate(results):
        env = parse_envelope(frames[-1])
        text = env.payload[0].text if env.payload.tag.endswith("}answer") else None
        if env.sender != "tutor" or text != f"{k} doubled is {2 * k}.":
            wrong += 1
    calls = len(server.requests)
    return calls / elapsed, contaminated() + wrong, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:  # pragma: no cover
        loop_name = "asyncio"
    hops = 5_000 if args.quick else 50_000
    samples = 500 if args.quick else 5_000
    concurrent = 500
    asyncio.run(pump_hop_us(1000))  # warm-up
    hop = min(asyncio.run(pump_hop_us(hops)), asyncio.run(pump_hop_us(hops)))
    overheads, seq_rate = asyncio.run(call_overhead(samples))
    rate, isolation_errors, calls = asyncio.run(conversations(concurrent))
    iso_rate, iso_errors, iso_calls = asyncio.run(conversations(concurrent, isolated=True))
    isolation_errors += iso_errors
    ordered = sorted(overheads)
    p50 = statistics.median(ordered)
    p99 = ordered[max(0, int(len(ordered) * 0.99) - 1)]
    print(f"loop: {loop_name}")
    print(f"pump: {hop:.1f} us per hop ({hops} calculator requests)")
    print(f"platform overhead per LLM call (assembly + validate_no_override + budgets + "
          f"routing + wire, without the HTTP wait): p50 {p50:.0f} us, p99 {p99:.0f} us "
          f"= {p50 / hop:.1f} pump hops ({len(ordered)} calls; {seq_rate:,.0f} calls/s "
          "sequential, loopback HTTP included)")
    print(f"{concurrent} concurrent agent conversations: {calls} LLM calls at "
          f"{rate:,.0f} calls/s; the same with the agent in 2 workers: {iso_calls} calls "
          f"at {iso_rate:,.0f} calls/s ({iso_rate / rate:.2f} of in process); "
          f"isolation errors: {isolation_errors}")
    print(json.dumps({
        "calls_per_s": round(rate),
        "isolated_agent_calls_per_s": round(iso_rate),
        "isolated_agent_ratio": round(iso_rate / rate, 3),
        "overhead_p50_us": round(p50),
        "overhead_p99_us": round(p99),
        "overhead_vs_hop": round(p50 / hop, 2),
        "isolation_errors": isolation_errors,
        "pump_hop_us": round(hop, 1),
        "sequential_calls_per_s": round(seq_rate),
        "conversations": concurrent,
    }))


if __name__ == "__main__":
    main()
