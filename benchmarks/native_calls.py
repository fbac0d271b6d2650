"""Native tool calling against XML calls: one agent task of three tool calls, end to
end through the pump, with a scripted backend on loopback (OpenAI protocol).

The model adds three numbers in three turns (three calculator calls), then answers.
In `native` mode each call is a provider tool call and each result a `role: tool`
message; in `xml` mode each call is a payload element in the reply's text. Both
run the same tasks, alternating, on one event loop (uvloop when installed).

Reported per mode: wall time per tool call (the whole task, the loopback HTTP
included, divided by its three calls), the platform's own time per call (the same
without the time spent waiting on the backend), and the prompt per model call in
tokens (the request body's bytes / 4: tool definitions once per request in native
mode, in the system prompt in XML mode). `overhead_ratio` is native's platform time
per call over XML's.

Usage: python benchmarks/native_calls.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
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


async def run_mode(server: FakeLLM, mode: str, tasks: int) -> dict[str, Any]:
    backend = (f"{{name: primary, provider: openai, base_url: \"{server.base_url}\", "
               "model: fake-1}")
    config = load(organism_yaml(backend, agent=f", tool_calling: {mode}, max_iterations: 8"))
    waited: list[float] = []  # seconds on the backend, from each llm-call record

    def audit(kind: str, thread: str, fields: Any) -> None:
        if kind == "llm-call":
            waited.append(float(fields.get("latency_ms", 0)) / 1000)

    platform = Platform.from_config(config, audit=audit)
    handlers = make_agent_handlers(config, platform)
    per_call: list[float] = []
    own: list[float] = []
    prompt_tokens: list[int] = []
    async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                       durable=False) as h:
        platform.bind_threads(h.pump.registry)
        for i in range(tasks):
            first = len(server.requests)
            waited.clear()
            started = time.perf_counter()
            frames = await h.send("alice", MathQuestion(text=f"Add {i}, 2, 3 and 4."))
            elapsed = time.perf_counter() - started
            assert b"The sum is" in frames[-1], frames[-1]
            per_call.append(elapsed / CALLS)
            own.append((elapsed - sum(waited)) / CALLS)
            prompt_tokens += [len(s.body) // 4 for s in server.requests[first:]]
    await platform.aclose()
    return {
        "per_call_ms": round(statistics.median(per_call) * 1000, 3),
        "platform_per_call_ms": round(statistics.median(own) * 1000, 3),
        "prompt_tokens_per_model_call": round(statistics.mean(prompt_tokens), 1),
    }


async def main(quick: bool) -> dict[str, Any]:
    tasks = 20 if quick else 200
    async with FakeLLM("openai", script) as server:
        await run_mode(server, "native", 3)  # warm-up: imports, schemas, connections
        await run_mode(server, "xml", 3)
        native = await run_mode(server, "native", tasks)
        xml = await run_mode(server, "xml", tasks)
    return {
        "benchmark": "native_calls", "tasks": tasks, "calls_per_task": CALLS,
        "native": native, "xml": xml,
        "overhead_ratio": round(native["platform_per_call_ms"]
                                / xml["platform_per_call_ms"], 3),
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
