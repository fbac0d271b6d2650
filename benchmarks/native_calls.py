"""Native tool calling against XML calls: one agent task of three tool calls, end to
end through the pump, with a scripted backend on loopback (OpenAI protocol).

The model adds three numbers in three turns (three calculator calls), then answers.
In `native` mode each call is a provider tool call and each result a `role: tool`
message; in `xml` mode each call is a payload element in the reply's text. Both
run the same tasks on one event loop (uvloop when installed).

Reported per mode, each the median over rounds of the round's median: wall time per
tool call (the whole task, the loopback HTTP included, divided by its three calls),
the CPU time per call of the benchmark's thread (the backend runs on another thread,
so this is agentd's own work, and steadier than wall time on a shared machine), the
platform's time per call (wall time without the waits on the backend), and the
prompt per model call in tokens (the request body's bytes / 4: tool definitions once
per request in native mode, in the system prompt in XML mode). The modes alternate
in rounds (which goes first alternates too); each round gives a native/XML ratio of
the CPU time and of the platform time per call, reported as median, min and max.
`overhead_ratio` is the median round's CPU ratio.

Usage: python benchmarks/native_calls.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd.platform import Platform, make_agent_handlers  # noqa: E402
from agentd.platform.demo import MathQuestion  # noqa: E402
from agentd.testing import Harness  # noqa: E402
from tests.llm_servers import (  # noqa: E402
    FakeLLM,
    Reply,
    Seen,
    add_call,
    load,
    numbers,
    openai_backend,
    organism_yaml,
    values,
)

CALLS = 3


def script(seen: Seen) -> Reply | str:
    """Add a + b, then + c, then + d, then answer; natively when tools are offered."""
    conv = seen.conversation()
    a, b, c, d = numbers(conv.task)[:4]
    got = values(conv.results)
    operands = [(a, b), (got[0] if got else 0, c), (got[1] if len(got) > 1 else 0, d)]
    if len(got) >= CALLS:
        return f"The sum is {got[-1]}."
    x, y = operands[len(got)]
    if "tools" in seen.json:
        return Reply(calls=[(f"call_{len(got)}", "calculator__add",
                             json.dumps({"a": x, "b": y}))])
    return add_call(x, y)


class Backend:
    """The scripted backend on a thread of its own (its own event loop), so the
    benchmark thread's CPU time is agentd's work (pump, platform, HTTP client) only."""

    def __init__(self) -> None:
        self.server = FakeLLM("openai", script)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> FakeLLM:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result()
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def run_mode(server: FakeLLM, mode: str, tasks: int) -> dict[str, Any]:
    """`tasks` tasks in `mode`: medians per tool call of wall time, CPU time of this
    thread, and wall time less the backend's; the mean prompt per model call."""
    agent = f", tool_calling: {mode}, max_iterations: 8"
    config = load(organism_yaml(openai_backend(server), agent=agent))
    waited: list[float] = []  # seconds on the backend, from each llm-call record

    def audit(kind: str, thread: str, fields: Any) -> None:
        if kind == "llm-call":
            waited.append(float(fields.get("latency_ms", 0)) / 1000)

    platform = Platform.from_config(config, audit=audit)
    handlers = make_agent_handlers(config, platform)
    per_call: list[float] = []
    cpu: list[float] = []
    own: list[float] = []
    prompt_tokens: list[int] = []
    async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                       durable=False) as h:
        platform.bind_threads(h.pump.registry)
        for i in range(tasks):
            first = len(server.requests)
            waited.clear()
            started, cpu_started = time.perf_counter(), time.thread_time()
            frames = await h.send("alice", MathQuestion(text=f"Add {i}, 2, 3 and 4."))
            elapsed, cpu_used = time.perf_counter() - started, time.thread_time() - cpu_started
            assert b"The sum is" in frames[-1], frames[-1]
            per_call.append(elapsed / CALLS)
            cpu.append(cpu_used / CALLS)
            own.append((elapsed - sum(waited)) / CALLS)
            prompt_tokens += [len(s.body) // 4 for s in server.requests[first:]]
    await platform.aclose()
    return {
        "per_call_ms": statistics.median(per_call) * 1000,
        "cpu_per_call_ms": statistics.median(cpu) * 1000,
        "platform_per_call_ms": statistics.median(own) * 1000,
        "prompt_tokens_per_model_call": statistics.mean(prompt_tokens),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds."""
    return {k: round(statistics.median(r[k] for r in runs), 3 if "ms" in k else 1)
            for k in runs[0]}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


async def main(quick: bool) -> dict[str, Any]:
    rounds, tasks = (5, 10) if quick else (10, 40)
    with Backend() as server:
        await run_mode(server, "native", 3)  # warm-up: imports, schemas, connections
        await run_mode(server, "xml", 3)
        runs: dict[str, list[dict[str, Any]]] = {"native": [], "xml": []}
        for r in range(rounds):  # the modes alternate, and so does which goes first
            for mode in (("native", "xml") if r % 2 == 0 else ("xml", "native")):
                runs[mode].append(await run_mode(server, mode, tasks))
    ratios = {k: [n[k] / x[k] for n, x in zip(runs["native"], runs["xml"], strict=True)]
              for k in ("cpu_per_call_ms", "platform_per_call_ms")}
    return {
        "benchmark": "native_calls", "rounds": rounds, "tasks_per_round": tasks,
        "calls_per_task": CALLS,
        "native": summary(runs["native"]), "xml": summary(runs["xml"]),
        "cpu_ratio": spread(ratios["cpu_per_call_ms"]),
        "platform_time_ratio": spread(ratios["platform_per_call_ms"]),
        "overhead_ratio": round(statistics.median(ratios["cpu_per_call_ms"]), 3),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(main(args.quick))))
