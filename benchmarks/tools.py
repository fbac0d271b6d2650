"""Tools benchmark: each tool kind's per-call cost against a plain Python handler
doing the same work, measured in the same run.

    python benchmarks/tools.py [--quick]

- file-read: the `file-read` tool's handler reading a 4 KiB file (path resolved
  beneath the root with openat2 or the O_NOFOLLOW walk, fstat, pread, in a worker
  thread) against a plain handler that `open()`s and reads the same file.
  `file_read_us` is the tool's mean per call; `file_read_baseline_us` the plain one.
- exec: the `exec` tool running `/bin/true` with confinement on (the compiled
  launcher: rlimits, Landlock, network denied, seccomp; own process group and pids
  cgroup killed after exit) against `asyncio.create_subprocess_exec("/bin/true")`.
  `exec_spawn_p50_ms` is the tool's median; target <= 8 ms.
  `exec_python_shim_p50_ms` is the same tool through the Python shim (what a
  machine without a C compiler uses), `exec_python_start_p50_ms` a bare
  `python -I -S` start, that shim's floor.

Each kind is one function in SECTIONS returning its figures; a new kind adds one.
Baseline and tool alternate per round; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _tools_timers
import _tools_wasm

from agentd._handler import HandlerMetadata, HandlerResponse
from agentd.config.tools import ExecTool, FileReadTool
from agentd.confine import landlock_status
from agentd.confine._launcher import python_shim
from agentd.tools import exec as exec_tool
from agentd.tools import files
from agentd.tools.beneath import OPENAT2
from agentd.tools.exec import Run
from agentd.tools.files import Encoding, FileContent, ReadFile

META = HandlerMetadata(thread_id="bench", from_id="bench", own_name="bench")
ROUNDS = 5


async def timed(call: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    """Seconds per call, one sample per call."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - start)
    return samples


async def file_read(quick: bool) -> dict[str, float]:
    n = 500 if quick else 5000
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "4k.txt").write_text("x" * 4096)
        (tool,) = files.handlers(files.describe(FileReadTool(kind="file-read", root=root),
                                                "bench"))
        request = ReadFile(path="4k.txt")

        async def plain(payload: ReadFile, meta: HandlerMetadata) -> HandlerResponse:
            data = (root / payload.path).read_text()
            return HandlerResponse.respond(FileContent(
                path=payload.path, size=len(data), encoding=Encoding.UTF8, data=data))

        tool_s: list[float] = []
        base_s: list[float] = []
        for _ in range(ROUNDS):
            base_s += await timed(lambda: plain(request, META), n // ROUNDS)
            tool_s += await timed(lambda: tool(request, META), n // ROUNDS)
    tool_us = statistics.fmean(tool_s) * 1e6
    base_us = statistics.fmean(base_s) * 1e6
    print(f"file-read 4 KiB ({'openat2' if OPENAT2 else 'O_NOFOLLOW walk'}): "
          f"tool {tool_us:.1f} us/call, plain handler {base_us:.1f} us/call, "
          f"x{tool_us / base_us:.1f}")
    return {"file_read_us": round(tool_us, 1), "file_read_baseline_us": round(base_us, 1)}


async def exec_spawn(quick: bool) -> dict[str, float]:
    n = 40 if quick else 300
    (tool,) = exec_tool.handlers(exec_tool.describe(ExecTool(kind="exec", argv=("/bin/true",)),
                                                    "bench"))

    async def plain() -> None:
        proc = await asyncio.create_subprocess_exec("/bin/true")
        await proc.wait()

    async def interpreter() -> None:
        # The floor of any shim written in Python: starting the interpreter.
        proc = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", "")
        await proc.wait()

    async def confined() -> None:
        response = await tool(Run(arg=[]), META)
        assert response is not None and response.payload.exit_code == 0

    async def through_python_shim() -> None:
        with python_shim():
            await confined()

    tool_s: list[float] = []
    base_s: list[float] = []
    python_s: list[float] = []
    shim_s: list[float] = []
    cpu = {"tool": 0.0, "shim": 0.0, "base": 0.0}  # the children's CPU, on a shared machine

    async def children_cpu(key: str, call: Callable[[], Awaitable[Any]]) -> list[float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        samples = await timed(call, n // ROUNDS)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[key] += (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        return samples

    await confined()  # the first spawn builds the launcher (the compiler's CPU is a child's)
    for _ in range(ROUNDS):
        base_s += await children_cpu("base", plain)
        python_s += await timed(interpreter, n // ROUNDS)
        tool_s += await children_cpu("tool", confined)
        shim_s += await children_cpu("shim", through_python_shim)
    tool_ms = statistics.median(tool_s) * 1e3
    base_ms = statistics.median(base_s) * 1e3
    python_ms = statistics.median(python_s) * 1e3
    shim_ms = statistics.median(shim_s) * 1e3
    status = landlock_status()
    print(f"exec /bin/true (landlock ABI {status.abi}, seccomp {status.seccomp}): tool p50 "
          f"{tool_ms:.2f} ms, plain subprocess p50 {base_ms:.2f} ms, bare `python -I -S` "
          f"p50 {python_ms:.2f} ms, the tool through the Python shim p50 {shim_ms:.2f} ms "
          f"(target <= 8 ms: {'met' if tool_ms <= 8 else 'MISSED'})")
    return {"exec_spawn_p50_ms": round(tool_ms, 2),
            "exec_spawn_baseline_p50_ms": round(base_ms, 2),
            "exec_python_start_p50_ms": round(python_ms, 2),
            "exec_python_shim_p50_ms": round(shim_ms, 2),
            "exec_spawn_over_baseline": round(tool_ms / base_ms, 2),
            "exec_spawn_child_cpu_ms": round(cpu["tool"] / len(tool_s) * 1e3, 2),
            "exec_python_shim_child_cpu_ms": round(cpu["shim"] / len(shim_s) * 1e3, 2),
            "exec_spawn_baseline_child_cpu_ms": round(cpu["base"] / len(base_s) * 1e3, 2)}


SECTIONS: list[Callable[[bool], Awaitable[dict[str, float]]]] = [
    file_read, exec_spawn, _tools_wasm.measure, _tools_timers.measure,
]


async def main(quick: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    for section in SECTIONS:
        figures.update(await section(quick))
    return figures


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.quick))))
