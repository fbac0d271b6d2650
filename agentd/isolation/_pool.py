"""A pool of confined worker processes serving one listener's handler.

The pool is the daemon's side of isolation. `WorkerPool.call` has the handler
signature ``(payload, meta) -> HandlerResponse | None``, so an isolated listener
is a listener whose handler is its pool's (`WorkerPool.handler`): the invoker
(slots, timeout watchdog, outcome counting) and the pump's checks of the output are
the same as in process. A pool without a bridge takes the payload element the pump
validated (`call_element`, marked `takes_element`): the worker gets its C14N, and
the daemon builds no object only to serialise it again.

Invariants:
- A worker runs one call at a time, in the order the calls were written to it. A
  call goes to an idle worker; when none is idle, it is queued behind the call of
  a busy worker (at most `PIPELINE` calls written to one worker; one for an
  agent's worker, whose pipe also carries the replies to its requests), so a worker
  under load finds its next call waiting instead of sleeping until the daemon
  wakes it (on a virtual machine a wake-up costs about as much as the call).
- A call queued behind another has not started: when its worker dies, it goes to
  another worker; only the call that was running fails.
- A worker that dies, breaks the protocol, runs out of memory, is cancelled by the
  timeout watchdog or goes over its call or RSS mark is killed with its whole
  process group and replaced; only the call it was serving fails.
- A worker with processes it started still there (running or unreaped: see
  `_children.py`) once it has finished its calls is replaced too, after its answer.
  It is checked whenever nothing is queued behind its last answer, and every
  `CHECK_S` while idle; a busy worker whose last check is older than that gets no
  call queued behind its running one, so it goes idle and is checked even under
  steady load. Nothing a handler starts outlives its call by more than about
  `CHECK_S` plus the calls already queued.
- Callers wait for a worker in turn: one arriving while others wait queues behind
  them.
- Everything a worker sends is decoded by `_protocol.decode_answer` (an agent's
  answer by its bridge, which checks the native call ids it names); its stderr is
  logged (capped per line), never parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from lxml import etree

from agentd import _metrics as metrics
from agentd._handler import HandlerMetadata, HandlerResponse, takes_element
from agentd._schemas import NS_CORE
from agentd._spin import LoopSpin
from agentd._states import step
from agentd._waiters import TurnQueue
from agentd._xml import c14n
from agentd._xmlify import is_xmlified, spec_of
from agentd.confine import kill_group, spawn, tasks_limited
from agentd.isolation import _protocol as p
from agentd.isolation._children import ChildWatch, children_listed
from agentd.isolation._worker import (
    TRANSITIONS,
    Call,
    Frame,
    NotStarted,
    Worker,
    WorkerEvent,
    WorkerFailed,
    WorkerSpec,
    WorkerState,
    drain_stderr,
    exit_reason,
    fail_calls,
    handshake,
    start_failure,
)

log = logging.getLogger("agentd.isolation")

_START_TIMEOUT_S = 60.0
_RESTART_BACKOFF_MAX_S = 5.0
# A worker that dies on its own this soon after READY (a crash at import, a thread
# that exits the process) is restarted after a growing pause, not in a tight loop.
_QUICK_DEATH_S = 1.0
_NOT_SELF_INFLICTED = frozenset({"timeout", "recycle"})
PIPELINE = 2  # calls written to one worker at most (1 running, the rest queued)
_MAX_REDISPATCH = 4  # a call whose worker died before starting it: tries elsewhere
CHECK_S = 1.0  # an idle worker is checked for leftover processes this often
_CORE = "{" + NS_CORE + "}"



# listener -> its pools not yet stopped (a reload's new pool and the one it retired
# while old threads still use it): what `agentd_workers` counts when scraped
_POOLS: dict[str, list[WorkerPool]] = {}


def _count(listener: str, state: WorkerState) -> int:
    return sum(w.state is state for pool in _POOLS.get(listener, ()) for w in pool._workers)


def spins(waiting: bool, workers: int, others: int, cores: int) -> bool:
    """Whether a worker, its call answered, polls for its next call before it
    sleeps: when no call waits for a worker, or when the pool's workers and the
    `others` that want a core under load fit the cores (so a spinning worker takes
    none they need). Why, and what it measured: docs/architecture.md, "Wake-ups
    between processes"."""
    return not waiting or workers + others <= cores


class WorkerPool:
    def __init__(self, spec: WorkerSpec, bridge: Any = None, others: int = 2) -> None:
        """`bridge`: an isolated agent's `AgentBridge`, which answers its workers'
        requests to the platform (None: a handler's pool; a request is then a
        protocol error). `others`: see `spins`."""
        self.spec = spec
        self.bridge = bridge
        self.others = others
        # An agent's worker reads the daemon's replies to its requests from the pipe
        # its calls come on: a call queued there would come between; none is.
        self.pipeline = 1 if bridge is not None else PIPELINE
        self.restarts = 0
        self._workers: set[Worker] = set()
        self._idle: deque[Worker] = deque()
        self._line = TurnQueue()  # callers waiting for a worker with room
        self._background: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._backoff = 0.0
        self.quick_death_s = _QUICK_DEATH_S  # a worker dead this soon after ready
        self._spare: Worker | None = None  # started and ready, serving nothing yet
        self._spin = LoopSpin()  # the loop polls while a lone call's answer is due
        self._cores = len(os.sched_getaffinity(0))  # the cores the daemon may run on
        # Whether processes a handler leaves behind are found after its call: needs
        # the kernel's /proc children lists (said once, at the pool's start).
        self.leftovers_checked = children_listed()
        # Whether each worker's processes and threads are bounded (`max_tasks`): needs
        # a pids cgroup the daemon can make children in.
        self.tasks_limited = tasks_limited(spec.policy)
        # `agentd_workers{listener,state}` is counted when it is scraped, not kept up
        # to date on every call: a worker of a pool of two goes idle -> busy -> idle
        # for nearly every call, and each gauge update takes the metric's lock.
        _POOLS.setdefault(spec.listener, []).append(self)
        for state in WorkerState:
            if state is not WorkerState.DEAD:
                metrics.workers.labels(spec.listener, state.value).set_function(
                    functools.partial(_count, spec.listener, state))

    # ---- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each has imported the handler."""
        if not self.leftovers_checked:
            log.warning("isolation listener=%s: this kernel does not list a process's "
                        "children in /proc (CONFIG_PROC_CHILDREN): processes a handler "
                        "leaves running after its call are not found; they end only with "
                        "their worker", self.spec.listener)
        roles = [False] * self.spec.workers + ([True] if self.spec.spare else [])
        started = await asyncio.gather(*(self._start_one(spare) for spare in roles),
                                       return_exceptions=True)
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        if self.leftovers_checked:
            task = asyncio.get_running_loop().create_task(self._check_idle())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def stop(self) -> None:
        self._stopping = True
        pools = _POOLS.get(self.spec.listener, [])
        if self in pools:
            pools.remove(self)
            if not pools:
                del _POOLS[self.spec.listener]
        for task in list(self._background):
            task.cancel()
        for worker in list(self._workers):
            await self._kill(worker)
        for task in list(self._background):
            with contextlib.suppress(BaseException):
                await task
        self._line.fail(WorkerFailed("stopped"))

    def status(self) -> dict[str, int]:
        states = [w.state for w in self._workers if w is not self._spare]
        return {"workers": sum(s is not WorkerState.DEAD for s in states),
                "spare": int(self._spare is not None),
                "busy": states.count(WorkerState.BUSY),
                "starting": states.count(WorkerState.STARTING),
                "restarts": self.restarts,
                "leftovers_checked": int(self.leftovers_checked),
                "tasks_limited": int(self.tasks_limited)}

    @property
    def workers(self) -> tuple[Worker, ...]:
        """The worker processes the pool holds now, the spare among them."""
        return tuple(self._workers)

    @property
    def waiting(self) -> int:
        """Calls waiting for a worker with room, to be served in arrival order."""
        return len(self._line)

    @property
    def restart_pause_s(self) -> float:
        """The pause before the next restart: doubled by each worker that dies soon
        after it was ready, 0 again after one that lived."""
        return self._backoff

    # ---- calls ---------------------------------------------------------------

    @property
    def handler(self) -> Callable[[Any, HandlerMetadata], Awaitable[HandlerResponse | None]]:
        """The listener's handler: an agent's bridge renders the payload object the
        pump built; any other pool takes the element."""
        return self.call if self.bridge is not None else self.call_element

    async def call(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse | None:
        """Run the listener's handler in a worker (the handler signature)."""
        if is_xmlified(payload):
            spec = spec_of(payload)
            key: str | None = spec.clark
            body = spec.to_bytes(payload)
        else:  # a core payload (ack, huh, answer) coming back to the listener
            key, body = None, payload.to_bytes()
        return await self._call(key, body, meta, payload)

    @takes_element
    async def call_element(self, element: etree._Element, meta: HandlerMetadata
                           ) -> HandlerResponse | None:
        """`call` for the payload element the pump validated: its C14N is what
        `to_bytes` of the object built from it would read back as (a core payload
        goes without a key, as in `call`)."""
        tag = element.tag
        return await self._call(None if tag.startswith(_CORE) else tag, c14n(element), meta,
                                None)

    async def _call(self, key: str | None, body: bytes, meta: HandlerMetadata, payload: Any
                    ) -> HandlerResponse | None:
        spin = spins(bool(self._line), self.spec.workers, self.others, self._cores)
        extra: dict[str, Any] = {"spin": spin}
        entries = p.state_slice(meta)
        if entries is not None:
            extra["meta_state"] = entries
        bridge, context = self.bridge, None
        if bridge is not None:
            context = bridge.context(meta, key, body, payload)
            extra.update(bridge.call_fields(context))
        frame = p.encode_call(meta, key, body, extra)
        for _ in range(_MAX_REDISPATCH):
            worker, answer = await self._deliver(frame, context)
            if spin and len(worker.inflight) == 1 and not self._line:
                # A lone call: the loop polls for its answer instead of sleeping. Not
                # with calls queued: the loop has their work to do meanwhile.
                self._spin.until(answer)
            try:
                kind, header, rest = await answer
            except NotStarted:
                continue  # its worker died before starting it: another one runs it
            except asyncio.CancelledError:
                # Cancelling the wait cancels `answer` too; unless its answer had come,
                # the call is running or queued, and nothing may run it later.
                if answer.cancelled() or not answer.done():
                    self._retire(worker, "timeout")
                raise
            return self._decoded(worker, kind, header, rest, context, meta)
        raise WorkerFailed("died")

    def _decoded(
        self, worker: Worker, kind: bytes, header: dict[str, Any], rest: bytes, context: Any,
        meta: HandlerMetadata,
    ) -> HandlerResponse | None:
        try:
            if kind == p.ANSWER:
                result = (p.decode_answer(header, rest) if self.bridge is None
                          else self.bridge.answer(context, header, rest))
                writes = p.decode_state_writes(header)
                if writes:  # committed with the output, as an in-process handler's
                    meta.state.overlay.update(writes)
                return result
            if kind == p.FAILED:
                if header.get("error") == "MemoryError":
                    self._retire(worker, "memory")
                    raise WorkerFailed("memory")
                raise WorkerFailed("raised")
            raise p.ProtocolError("unexpected frame kind")
        except p.ProtocolError as exc:
            log.warning("isolated worker broke the protocol listener=%s pid=%s: %s",
                        self.spec.listener, worker.pid, exc)
            self._retire(worker, "protocol")
            raise WorkerFailed("protocol") from None

    async def _deliver(self, frame: bytes, context: Any) -> tuple[Worker, asyncio.Future[Frame]]:
        """Write the call to a worker; returns it and the future of its answer.

        A worker that died while idle (its exit not yet noticed through the pidfd)
        refuses the write with a broken pipe: it never read the call, so the call
        goes to the next worker instead of failing."""
        loop = asyncio.get_running_loop()
        for _ in range(_MAX_REDISPATCH):
            worker = await self._acquire()
            if worker.state is WorkerState.IDLE:
                self._set(worker, WorkerEvent.CALL)
            answer: asyncio.Future[Frame] = loop.create_future()
            worker.inflight.append(Call(answer, context))
            stdin = worker.proc.stdin
            assert stdin is not None
            try:
                stdin.write(frame)
                await stdin.drain()
                if stdin.is_closing():  # the write met a broken pipe; asyncio reports it
                    raise BrokenPipeError  # only a few loop turns later, if ever
            except asyncio.CancelledError:
                self._retire(worker, "timeout")
                raise
            except (ConnectionError, BrokenPipeError):
                # The worker's end was closed before it had the whole frame: it
                # cannot have started the call.
                self._retire(worker, None)
                if answer.done():
                    answer.exception()  # retrieved: it is this call's, and answered here
                continue
            return worker, answer
        raise WorkerFailed("died")

    async def _read_answers(self, worker: Worker) -> None:
        """The worker's answers, in order, to the calls waiting for them; an
        isolated agent's requests, answered for the call it is running."""
        stdout = worker.proc.stdout
        assert stdout is not None
        try:
            while True:
                size = p.frame_length(await stdout.readexactly(4))
                frame = p.decode(await stdout.readexactly(size))
                if not worker.inflight:
                    raise p.ProtocolError("a frame outside any call")
                if frame[0] == p.ASK:
                    await self._answer_request(worker, frame)
                    continue
                answer = worker.inflight.popleft().answer
                if not answer.done():
                    answer.set_result(frame)
                self._answered(worker)
        except p.ProtocolError as exc:
            log.warning("isolated worker broke the protocol listener=%s pid=%s: %s",
                        self.spec.listener, worker.pid, exc)
            self._retire(worker, "protocol")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._retire(worker, None)

    async def _answer_request(self, worker: Worker, frame: Frame) -> None:
        """The running call's request to the platform (its worker waits for the reply:
        reading its next frame can wait too)."""
        if self.bridge is None:
            raise p.ProtocolError("a request from a handler's worker")
        _, header, body = frame
        worker.asking = asyncio.ensure_future(
            self.bridge.ask(worker.inflight[0].context, header, body))
        try:
            reply, rest = await worker.asking
        finally:
            worker.asking = None
        stdin = worker.proc.stdin
        assert stdin is not None
        stdin.write(p.encode(p.REPLY, reply, rest))
        await stdin.drain()

    async def _acquire(self) -> Worker:
        """An idle worker, else a busy one with room in its queue, else wait."""
        behind = self._line.behind  # one arriving while others wait goes behind them
        while True:
            if not behind:
                while self._idle:
                    worker = self._idle.popleft()
                    if worker.state is WorkerState.IDLE and not worker.worn_out:
                        return worker
                # A worker due for its leftover check gets nothing queued: it goes idle.
                due = asyncio.get_running_loop().time() - CHECK_S
                queued = [w for w in self._workers
                          if w.state is WorkerState.BUSY and not w.worn_out
                          and len(w.inflight) < self.pipeline and w is not self._spare
                          and (w.children is None or w.checked_at > due)]
                if queued:
                    return min(queued, key=lambda w: len(w.inflight))
            behind = False
            if self._stopping:
                raise WorkerFailed("stopped")
            await self._line.wait()

    def _answered(self, worker: Worker) -> None:
        worker.calls += 1
        if not worker.worn_out and worker.over_marks(self.spec):
            worker.worn_out = True
        if worker.inflight:
            self._line.wake()  # room in its queue again
            return
        if self._left_over(worker):  # nothing runs in it now: nothing may be left
            return
        if worker.worn_out:
            self._retire(worker, "recycle")
            return
        self._set(worker, WorkerEvent.DONE)
        self._idle.append(worker)
        self._line.wake()

    def _left_over(self, worker: Worker) -> bool:
        """Check a worker running no call for what its handler left behind; replace
        it (True) if anything is."""
        watch = worker.children
        if watch is None:
            return False
        worker.checked_at = asyncio.get_running_loop().time()
        why = watch.leftover()
        if why is None:
            return False
        log.warning("isolated worker replaced after its call: %s listener=%s pid=%s",
                    why, self.spec.listener, worker.pid)
        self._retire(worker, "leftover")
        return True

    async def _check_idle(self) -> None:
        """Every CHECK_S, the idle workers (and the spare): a thread a handler left
        may start a process after its call was answered."""
        loop = asyncio.get_running_loop()
        while not self._stopping:
            await asyncio.sleep(CHECK_S)
            due = loop.time() - CHECK_S
            try:
                for worker in list(self._workers):
                    if worker.state is WorkerState.IDLE and worker.checked_at <= due:
                        self._left_over(worker)
            except Exception:  # a bug here must not end the checks for good
                log.exception("isolation listener=%s: leftover check failed",
                              self.spec.listener)

    # ---- workers -------------------------------------------------------------

    def _set(self, worker: Worker, event: WorkerEvent) -> None:
        worker.state = step("worker", TRANSITIONS, worker.state, event)

    async def _start_one(self, spare: bool = False) -> Worker:
        spec = self.spec
        proc = await spawn(list(spec.argv), spec.policy, check=False)
        worker = Worker(proc)
        self._workers.add(worker)
        worker.tasks.append(asyncio.create_task(drain_stderr(worker, self.spec.listener)))
        try:
            await handshake(proc, spec.init, _START_TIMEOUT_S)
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.IncompleteReadError):  # it exited: hear why
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(worker.tasks[0]), 1.0)
            await self._kill(worker)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise start_failure(spec, worker) from None
        self._set(worker, WorkerEvent.READY)
        worker.ready_at = asyncio.get_running_loop().time()
        if self.leftovers_checked:
            with contextlib.suppress(OSError):  # gone already: its pidfd says so
                worker.children = ChildWatch(worker.pid)
            worker.checked_at = worker.ready_at
        worker.tasks.append(asyncio.create_task(self._read_answers(worker)))
        self._watch(worker)
        if spare:
            self._spare = worker
        else:
            self._idle.append(worker)
            self._line.wake()
        return worker

    def _watch(self, worker: Worker) -> None:
        """Notice the worker's exit at once, through a pidfd. Its pipes are no sign:
        a grandchild may hold them open (and asyncio's `wait()` waits for them too).
        The group is then killed, which closes them, failing a call in progress."""
        try:
            worker.pidfd = os.pidfd_open(worker.pid)
        except (AttributeError, OSError):  # no pidfd (Linux < 5.3): pipes and wait() only
            return
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(worker.pidfd)
            if worker.state is not WorkerState.DEAD:
                self._retire(worker, None)

        loop.add_reader(worker.pidfd, exited)

    def _retire(self, worker: Worker, reason: str | None) -> None:
        """Kill `worker` (its whole group) now and replace it in the background."""
        if worker.state is WorkerState.DEAD:
            return
        worker.killed_for = reason
        self._set(worker, WorkerEvent.DIE)
        fail_calls(worker, reason)
        if worker.asking is not None:  # a model call for it: abandoned now, not later
            worker.asking.cancel()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        task = asyncio.get_running_loop().create_task(self._replace(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _kill(self, worker: Worker) -> None:
        if worker.state is not WorkerState.DEAD:
            self._set(worker, WorkerEvent.DIE)
        fail_calls(worker, "stopped")
        if worker.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(worker.pidfd)
            os.close(worker.pidfd)
            worker.pidfd = -1
        await kill_group(worker.proc)
        if worker.children is not None:
            worker.children.close()
            worker.children = None
        for task in worker.tasks:
            task.cancel()
        self._workers.discard(worker)
        if worker.state is WorkerState.DEAD and worker in self._idle:
            self._idle.remove(worker)

    async def _replace(self, worker: Worker) -> None:
        await self._kill(worker)
        reason = exit_reason(worker.proc.returncode, worker.killed_for)
        self.restarts += 1
        metrics.worker_restarts.labels(self.spec.listener, reason).inc()
        log.warning("isolated worker replaced listener=%s pid=%s reason=%s exit=%s",
                    self.spec.listener, worker.pid, reason, worker.proc.returncode)
        spare = self._spare
        want_spare = spare is not None  # the spare died, or it takes over from `worker`
        self._spare = None
        if spare is not None and spare is not worker:
            self._idle.append(spare)  # serves at once; a new spare starts behind it
            self._line.wake()
        lived = asyncio.get_running_loop().time() - worker.ready_at
        if reason not in _NOT_SELF_INFLICTED and worker.ready_at and lived < self.quick_death_s:
            self._slower()  # it dies as soon as it starts: no tight restart loop
        elif worker.ready_at:
            self._backoff = 0.0
        while not self._stopping:
            if self._backoff:
                await asyncio.sleep(self._backoff)
            try:
                await self._start_one(want_spare)
                return
            except Exception as exc:  # WorkerFailed; or the daemon out of pids, fds
                self._slower()
                log.error("isolated worker restart failed listener=%s: %s",
                          self.spec.listener, exc)

    def _slower(self) -> None:
        self._backoff = min(_RESTART_BACKOFF_MAX_S, max(0.1, self._backoff * 2))
