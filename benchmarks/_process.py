"""What the benchmarks measure of a process, and how they run their loop: the CPU
seconds of a process and its descendants (the daemon's writer, its workers), the same
in nanoseconds with the process's own threads apart from its descendants, and a
process's resident memory, from /proc; `run` on uvloop, as the daemon runs, when it
is installed."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def _pids(pid: int) -> list[int]:
    """`pid` and its descendants (the daemon's writer, workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_s(pid: int) -> float:
    """CPU seconds (user and system) of `pid` and its descendants so far."""
    total = 0
    for p in _pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / TICKS


def _task_ns(pid: int) -> tuple[int, list[int]]:
    """CPU nanoseconds run by `pid`'s threads (the scheduler's count: finer than
    /proc/PID/stat's ticks), and its child processes' ids."""
    ns, children = 0, []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            ns += int((task / "schedstat").read_text().split()[0])
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return ns, children


def tree_cpu_ns(pid: int) -> tuple[int, int]:
    """CPU nanoseconds of a process (all its threads) and of all its descendants (a
    daemon's writer)."""
    main, todo = _task_ns(pid)
    rest = 0
    while todo:
        ns, more = _task_ns(todo.pop())
        rest += ns
        todo += more
    return main, rest


def rss_kb(pid: int | str = "self") -> int:
    """The resident set of `pid` in KiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)
