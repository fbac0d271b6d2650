"""An isolated listener's worker process as the pool sees it: its states, its start
handshake, the calls written to it, when it is worn out, why it ended or did not
start, and the logging of its stderr. The pool (`_pool`) decides which worker
serves a call and when one is replaced."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentd._procfs import stat_fields
from agentd.bus import TokenBucket
from agentd.confine import Policy
from agentd.isolation import _protocol as p
from agentd.isolation._children import ChildWatch

log = logging.getLogger("agentd.isolation")

_STDERR_LINE_MAX = 512
# Lines of a worker's stderr logged per second (and a burst): past it the daemon
# reads more slowly, so a flooding worker blocks on its own pipe, not the daemon.
STDERR_LINES_PER_S = 50.0
_STDERR_BURST = 200
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class WorkerState(enum.Enum):
    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"


class WorkerEvent(enum.Enum):
    READY = "ready"
    CALL = "call"
    DONE = "done"
    DIE = "die"


TRANSITIONS: Mapping[WorkerState, Mapping[WorkerEvent, WorkerState]] = {
    WorkerState.STARTING: {WorkerEvent.READY: WorkerState.IDLE, WorkerEvent.DIE: WorkerState.DEAD},
    WorkerState.IDLE: {WorkerEvent.CALL: WorkerState.BUSY, WorkerEvent.DIE: WorkerState.DEAD},
    WorkerState.BUSY: {WorkerEvent.DONE: WorkerState.IDLE, WorkerEvent.DIE: WorkerState.DEAD},
    WorkerState.DEAD: {WorkerEvent.DIE: WorkerState.DEAD},
}


class NotStarted(Exception):
    """The call was queued in a worker that died before it started it."""


class WorkerFailed(Exception):
    """The worker serving a call failed; the caller gets `huh internal`."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"isolated worker failed: {reason}")
        self.reason = reason


def exit_reason(returncode: int | None, killed_for: str | None) -> str:
    """Why a worker ended, for `agentd_worker_restarts_total{reason}`."""
    if killed_for is not None:
        return killed_for
    if returncode in (-signal.SIGXCPU,):
        return "cpu"
    if returncode is not None and returncode < 0:
        return "crash"
    return "exit"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to start a listener's workers."""

    listener: str
    argv: tuple[str, ...]
    policy: Policy
    init: Mapping[str, Any]  # the INIT frame's header
    workers: int = 1
    max_calls: int | None = None
    max_rss_mb: int | None = None
    spare: bool = True  # keep one more worker ready, to replace a dead one at once


Frame = tuple[bytes, dict[str, Any], bytes]


@dataclass(eq=False)
class Call:
    answer: asyncio.Future[Frame]  # the worker's ANSWER or FAILED frame
    context: Any = None  # an isolated agent's `CallContext` (its requests' scope)


@dataclass(eq=False)
class Worker:
    proc: asyncio.subprocess.Process
    state: WorkerState = WorkerState.STARTING
    calls: int = 0
    killed_for: str | None = None
    pidfd: int = -1
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # the calls written, in order (the head is running)
    inflight: deque[Call] = field(default_factory=deque)
    worn_out: bool = False  # takes no new call; retired once its queue is empty
    last_words: str = ""  # its last stderr line (why a confinement failed, at start)
    asking: asyncio.Future[Any] | None = None  # an agent's request being answered
    ready_at: float = 0.0  # the event loop's time when it said READY
    children: ChildWatch | None = None  # None: not checked (see leftovers_checked)
    checked_at: float = 0.0  # the event loop's time of its last leftover check

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mb(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"VmRSS:"):
                        return int(line.split()[1]) / 1024
        except (OSError, ValueError):
            pass
        return 0.0

    def cpu_s(self) -> float:
        """CPU seconds used so far (what RLIMIT_CPU counts)."""
        try:
            fields = stat_fields(self.proc.pid)
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, ValueError, IndexError):
            return 0.0

    def over_marks(self, spec: WorkerSpec) -> bool:
        """Over its call count, its RSS mark, or half its CPU seconds (RLIMIT_CPU
        counts a worker's whole life: the next call starts with at least half)."""
        cpu = spec.policy.cpu_s
        return ((spec.max_calls is not None and self.calls >= spec.max_calls)
                or (spec.max_rss_mb is not None and self.rss_mb() > spec.max_rss_mb)
                or (cpu is not None and self.cpu_s() >= cpu / 2))


async def handshake(proc: asyncio.subprocess.Process, init: Mapping[str, Any],
                    timeout_s: float) -> None:
    """A new worker's start: INIT written, READY read within `timeout_s` (the
    handler imported); anything else is a `ProtocolError`."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(p.encode(p.INIT, dict(init)))
    await proc.stdin.drain()
    async with asyncio.timeout(timeout_s):
        size = p.frame_length(await proc.stdout.readexactly(4))
        kind, _, _ = p.decode(await proc.stdout.readexactly(size))
    if kind != p.READY:
        raise p.ProtocolError("expected READY")


def start_failure(spec: WorkerSpec, worker: Worker) -> WorkerFailed:
    """Why a worker did not start, for the operator: its exit and last stderr line,
    and what to grant when the confinement refused a file."""
    why = f": {worker.last_words}" if worker.last_words else ""
    if "PermissionError" in why:  # Landlock: a file not granted (see _plan)
        why += (f"; a file the handler reads as it starts (a module it imports "
                f"at run time, data) must be listed in the isolation: read of "
                f"listener {spec.listener}")
    return WorkerFailed(f"worker for {spec.listener} did not start "
                        f"(exit {worker.proc.returncode}){why}")


def fail_calls(worker: Worker, reason: str | None) -> None:
    """The worker is gone: its running call fails, the calls queued behind it (never
    started) go elsewhere."""
    for i, call in enumerate(worker.inflight):
        answer = call.answer
        if not answer.done():
            answer.set_exception(WorkerFailed(reason or "died") if i == 0 else NotStarted())
    worker.inflight.clear()



async def drain_stderr(worker: Worker, listener: str) -> None:
    """Log `worker`'s stderr, a line at most `_STDERR_LINE_MAX` bytes and at most
    `STDERR_LINES_PER_S` lines a second past a burst: beyond, it is read no faster, so
    a flooding worker blocks on its own pipe, not the daemon. What is left once the
    worker is dead is read at once and not logged."""
    stream = worker.proc.stderr
    assert stream is not None
    loop = asyncio.get_running_loop()
    bucket = TokenBucket(STDERR_LINES_PER_S, _STDERR_BURST, loop.time())
    slowed = False
    dropped = 0
    while True:
        try:
            line = await stream.readline()
        except ValueError:  # a line over the stream limit (readline dropped it):
            line = b"(a stderr line over 64 KiB, dropped)"  # charged like any line
        if not line:
            if dropped:
                log.warning("worker stderr listener=%s pid=%s: %d lines dropped after "
                            "it ended", listener, worker.pid, dropped)
            return
        logged = True
        while not bucket.take(loop.time()):
            if worker.state is WorkerState.DEAD:
                logged = False  # what is left in its pipe: read at once, not logged
                break
            if not slowed:
                slowed = True
                log.warning("worker stderr listener=%s pid=%s: over %.0f lines/s; "
                            "read no faster", listener, worker.pid,
                            STDERR_LINES_PER_S)
            await asyncio.sleep(1 / STDERR_LINES_PER_S)
        if not logged:
            dropped += 1
            continue
        text = line[:_STDERR_LINE_MAX].decode("utf-8", "replace").rstrip()
        worker.last_words = text
        log.info("worker stderr listener=%s pid=%s: %s", listener,
                 worker.pid, text)

