"""WASM tool benchmark: per-call cost of a cached module against a plain Python
handler doing the same work, and how fast a runaway module is stopped.

A section of benchmarks/tools.py (`python benchmarks/tools.py [--quick]`).

`wasm_call_p50_us`: the tool's handler awaited on the event loop (the payload to
C14N, a fresh store and instance from the pre-linked module, stdin and stdout, the
thread hop) echoing a 1 KiB payload; `wasm_call_cpu_us`, the process's CPU per such
call (every thread: the loop's, the pool's, wasmtime's), steadier than the wall
time on a shared machine. `python_call_p50_us`: an async Python handler
that serialises the same payload and answers with it. `wasm_runaway_stop_ms`: a
module in an infinite loop with `timeout_ms: 100`, from the call to its `timeout`
answer (the target is the limit plus a tick or two). Both kinds alternate in rounds.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import wasmtime  # noqa: E402

from agentd import HandlerMetadata, HandlerResponse, xmlify  # noqa: E402
from agentd._xmlify import to_xml  # noqa: E402
from agentd.config import load_config_text  # noqa: E402
from agentd.tools import tool_handlers  # noqa: E402

ECHO_WAT = (ROOT / "benchmarks" / "data" / "echo.wat").read_text()
SPIN_WAT = '(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))'


@xmlify(namespace="https://xml-pipeline.org/ns/bench/wasm/v1")
@dataclass
class Blob:
    """A payload of about 1 KiB."""

    text: str


async def python_echo(payload: Blob, meta: HandlerMetadata) -> HandlerResponse:
    del meta
    return HandlerResponse.respond(to_xml(payload))


def handler(directory: Path, name: str, wat: str, **keys: object) -> object:
    module = directory / f"{name}.wasm"
    module.write_bytes(wasmtime.wat2wasm(wat))
    block = {"kind": "wasm", "module": str(module), "payload_class": "_tools_wasm:Blob",
             "response_class": "_tools_wasm:Blob", **keys}
    text = (f"organism: {{name: bench}}\npython_path: [{json.dumps(str(ROOT / 'benchmarks'))}]\n"
            f"listeners:\n  - name: {name}\n    tool: {json.dumps(block)}\n")
    loaded = load_config_text(text, base_dir=directory).listener(name).loaded_tool
    assert loaded is not None
    return tool_handlers([loaded])[name]


async def p50_us(call: object, payload: Blob, n: int) -> float:
    meta = HandlerMetadata("00000000-0000-4000-8000-000000000000", "bench", "echo")
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await call(payload, meta)  # type: ignore[operator]
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e6


async def measure(quick: bool) -> dict[str, float]:
    """Run the rounds, print readable lines, return the figures."""
    logging.getLogger("agentd").setLevel(logging.ERROR)  # the runaway calls log a warning
    calls, rounds, runaways = (200, 3, 3) if quick else (2000, 5, 10)
    payload = Blob(text="x" * 1000)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        echo = handler(directory, "echo", ECHO_WAT)
        spin = handler(directory, "spin", SPIN_WAT, timeout_ms=100, fuel=10**15)
        await p50_us(echo, payload, 20)  # warm-up: the pool's threads, the ticker
        wasm, python, cpu = [], [], []
        for i in range(rounds):
            python.append(await p50_us(python_echo, payload, calls))
            cpu0 = time.process_time()
            wasm.append(await p50_us(echo, payload, calls))
            cpu.append((time.process_time() - cpu0) / calls * 1e6)
            print(f"round {i + 1}: wasm echo p50 {wasm[-1]:.0f} us ({cpu[-1]:.0f} us of "
                  f"CPU a call), python echo p50 {python[-1]:.1f} us")
        stops = []
        meta = HandlerMetadata("00000000-0000-4000-8000-000000000000", "bench", "spin")
        for _ in range(runaways):
            started = time.perf_counter()
            answer = await spin(payload, meta)  # type: ignore[operator]
            stops.append((time.perf_counter() - started) * 1000)
            assert answer.error_code is not None and answer.error_code.value == "timeout"
        print(f"runaway (timeout_ms 100) stopped after {statistics.median(stops):.1f} ms "
              f"(max {max(stops):.1f})")
    result = {
        "wasm_call_p50_us": round(statistics.median(wasm), 1),
        "wasm_call_cpu_us": round(statistics.median(cpu), 1),
        "python_call_p50_us": round(statistics.median(python), 1),
        "wasm_over_python_p50": round(
            statistics.median(w / p for w, p in zip(wasm, python, strict=True)), 1),
        "wasm_runaway_stop_ms": round(statistics.median(stops), 1),
    }
    return result
