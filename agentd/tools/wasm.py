"""WASM tools: a WASI preview 1 command module, run on wasmtime once per call.

The request payload's C14N bytes are the module's stdin; what it writes to stdout is
its response payload, which re-enters the pump and is validated like any handler's
output (stdout is a fresh memory file per call, sealed at 1 MiB: a write past that
fails in the guest). The module sees no filesystem except the configured preopens, no network
(WASI preview 1 has no sockets, and none are linked), no environment, no arguments
beyond its name, and clocks rounded down to the millisecond (the host's clock
functions are replaced, so a module cannot time the host finely); its process and
thread CPU clocks count its own call from its start, not the daemon's CPU time.

Bounds, per call: fuel (instructions; exhausted -> `huh budget-exceeded`), a memory
cap on the store (a `memory.grow` past it fails; a run that fails with its memory at
the cap -> `huh budget-exceeded`; one linear memory, multi-memory off, and tables
capped so that together they hold about `memory_mb` more), and wall time via
wasmtime's epoch interruption (which only interrupts guest code: so the WASI calls
that wait or leave anything behind are not linked as wasmtime has them:
`poll_oneoff` answers `notsup` instead of sleeping, `path_symlink` `perm`):
one ticker thread per process advances the engine's epoch every `TICK_S` while calls
run, and each store's deadline is its `timeout_ms` in ticks (-> `huh timeout`). A
non-zero exit or any other trap -> `huh internal`; stderr is a memory file like
stdout (a write past its 1 MiB fails in the guest), its first 4 KiB logged.

Modules are compiled once per content (keyed by SHA-256) when the configuration is
loaded, and instantiated per call from a pre-linked `InstancePre`. A call runs on one
of its listener's threads, never on the event loop; wasmtime releases the GIL while
guest code runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from ctypes import CFUNCTYPE, POINTER, byref, c_char, c_void_p, cast, create_string_buffer
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

import wasmtime
from wasmtime import _ffi  # the C API, called as wasmtime-py calls it (pinned: 50.x)
from wasmtime._func import maybe_raise_last_exn as _maybe_raise_last_exn

from agentd._errors import HuhCode
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import spec_of, to_xml
from agentd.config.tools import WasmTool
from agentd.tools.kinds import Handler, LoadedTool, ToolUnavailable

log = logging.getLogger("agentd.tools.wasm")

TICK_S = 0.005  # the epoch period: wall-time limits are enforced to within one tick
MAX_STDOUT_BYTES = 1024 * 1024  # more is cut off; the pump then refuses the payload
MAX_STDERR_BYTES = 1024 * 1024  # a write past it fails in the guest
MAX_STDERR_LOG_BYTES = 4096  # of which the log gets this much
WASM_PAGE = 65536
_WASI = "wasi_snapshot_preview1"
_NS_PER_MS = 1_000_000
_ERRNO_SUCCESS, _ERRNO_FAULT, _ERRNO_INVAL, _ERRNO_NOTSUP, _ERRNO_PERM = 0, 21, 28, 58, 63
MAX_TABLES = 4  # a compiler emits one; reference types may add a few
_call = threading.local()  # cpu0: the pool thread's CPU time when its call started


def _call_cpu_ns() -> int:
    """The CPU time of the running call: what a module reads on its process and
    thread CPU clocks. The daemon's own (`process_time`) would tell it how busy
    every other conversation keeps the daemon, and the pool thread's the time of
    the calls that ran on it before."""
    return time.thread_time_ns() - _call.cpu0


_CLOCKS = {0: time.time_ns, 1: time.monotonic_ns, 2: _call_cpu_ns, 3: _call_cpu_ns}


class _EpochTicker:
    """Advances the engine's epoch every `TICK_S` while at least one call runs;
    sleeps otherwise. One thread for the whole process."""

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._engine = engine
        self._active = 0
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> None:
        with self._wake:
            self._active += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="wasm-epoch",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._active -= 1

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._active:
                    self._wake.wait()
            time.sleep(TICK_S)
            self._engine.increment_epoch()


_Job = tuple[Callable[[bytes], "RunOutcome"], bytes, asyncio.AbstractEventLoop,
             "asyncio.Future[RunOutcome]"]


class CallThreads:
    """The threads one listener's calls run on, started as calls need them. A call is
    handed to one idle thread (each waits on a queue of its own) and its outcome set on
    the caller's future from that thread: a `ThreadPoolExecutor` woke every idle thread
    of its shared queue for each call, and its result came back through a second
    future, which cost the call thread hand-overs of the GIL."""

    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self._lock = threading.Lock()
        self._idle: list[SimpleQueue[_Job]] = []
        self._backlog: deque[_Job] = deque()  # calls waiting while every thread is busy
        self._started = 0

    def submit(self, run: Callable[[bytes], RunOutcome],
               stdin: bytes) -> asyncio.Future[RunOutcome]:
        """Start `run(stdin)` on a thread; its outcome is the returned future's."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RunOutcome] = loop.create_future()
        job: _Job = (run, stdin, loop, future)
        with self._lock:
            if self._idle:
                self._idle.pop().put(job)
                return future
            self._backlog.append(job)
            if self._started == self.count:
                return future
            self._started += 1
        threading.Thread(target=self._work, name=self.name, daemon=True).start()
        return future

    def _work(self) -> None:
        inbox: SimpleQueue[_Job] = SimpleQueue()
        while True:
            with self._lock:
                job = self._backlog.popleft() if self._backlog else None
                if job is None:
                    self._idle.append(inbox)
            if job is None:
                job = inbox.get()
            run, stdin, loop, future = job
            if future.cancelled():  # the caller gave up before its turn came
                continue
            try:
                outcome: RunOutcome | BaseException = run(stdin)
            except Exception as exc:
                outcome = exc
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it
                loop.call_soon_threadsafe(_settle, future, outcome)


def _settle(future: asyncio.Future[RunOutcome], outcome: RunOutcome | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


class WasmRuntime:
    """The process's one engine, its compiled modules, the epoch ticker and the
    threads calls run on: each listener has threads of its own, so a listener whose
    modules run long delays its own calls, never another listener's."""

    def __init__(self, threads: int = 2) -> None:
        config = wasmtime.Config()
        config.consume_fuel = True
        config.epoch_interruption = True
        config.wasm_multi_memory = False  # one memory, the one `memory_mb` caps
        self.engine = wasmtime.Engine(config)
        self.ticker = _EpochTicker(self.engine)
        self.threads = threads
        self._executors: dict[str, CallThreads] = {}  # by listener, kept by reloads
        # Kept while a listener's module uses it (a reload that drops or changes a
        # module lets its compiled code go; a dry run keeps nothing).
        self._compiled: weakref.WeakValueDictionary[str, wasmtime.InstancePre] = (
            weakref.WeakValueDictionary())
        self._lock = threading.Lock()

    def executor(self, listener: str) -> CallThreads:
        """The threads `listener`'s calls run on."""
        found = self._executors.get(listener)
        if found is None:
            found = self._executors[listener] = CallThreads(f"wasm-{listener}"[:15],
                                                            self.threads)
        return found

    def prepare(self, data: bytes, digest: str) -> wasmtime.InstancePre:
        """The module compiled and linked against our WASI; once per content. Raises
        ValueError for a module that is no WASI command (no `_start() -> ()`)."""
        with self._lock:
            pre = self._compiled.get(digest)
            if pre is None:
                module = wasmtime.Module(self.engine, data)
                start = next((e.type for e in module.exports if e.name == "_start"), None)
                if not (isinstance(start, wasmtime.FuncType) and not start.params
                        and not start.results):
                    raise ValueError("it is not a WASI command: no `_start` function "
                                     "taking and returning nothing")
                pre = _linker(self.engine).instantiate_pre(module)
                self._compiled[digest] = pre
            return pre

    def holds(self, digest: str) -> bool:
        """Whether the module with this content is compiled in memory: only while a
        tool built on it is alive."""
        with self._lock:
            return digest in self._compiled


_runtime: WasmRuntime | None = None


def runtime() -> WasmRuntime:
    global _runtime
    if _runtime is None:
        _runtime = WasmRuntime()
    return _runtime


def _linker(engine: wasmtime.Engine) -> wasmtime.Linker:
    """WASI preview 1, with the clocks replaced by millisecond-grained ones."""
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    linker.allow_shadowing = True
    i32, i64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
    linker.define_func(_WASI, "clock_time_get", wasmtime.FuncType([i32, i64, i32], [i32]),
                       _clock_time_get, access_caller=True)
    linker.define_func(_WASI, "clock_res_get", wasmtime.FuncType([i32, i32], [i32]),
                       _clock_res_get, access_caller=True)
    # Waiting inside a WASI call uses no fuel and no epoch: a module could sleep past
    # its timeout on a pool thread nothing can interrupt.
    linker.define_func(_WASI, "poll_oneoff", wasmtime.FuncType([i32] * 4, [i32]),
                       lambda *_: _ERRNO_NOTSUP)
    # A symbolic link made in a preopen may point out of it (wasmtime refuses only
    # absolute targets): harmless to the module, not to whoever reads that folder next.
    linker.define_func(_WASI, "path_symlink", wasmtime.FuncType([i32] * 5, [i32]),
                       lambda *_: _ERRNO_PERM)
    return linker


def _store_u64(caller: wasmtime.Caller, address: int, value: int) -> int:
    memory = caller.get("memory")
    if not isinstance(memory, wasmtime.Memory) or address < 0:
        return _ERRNO_FAULT
    try:
        memory.write(caller, value.to_bytes(8, "little"), address)
    except IndexError:
        return _ERRNO_FAULT
    return _ERRNO_SUCCESS


def _clock_time_get(caller: wasmtime.Caller, clock: int, precision: int, out: int) -> int:
    del precision
    read = _CLOCKS.get(clock)
    if read is None:
        return _ERRNO_INVAL
    return _store_u64(caller, out, read() // _NS_PER_MS * _NS_PER_MS)


def _clock_res_get(caller: wasmtime.Caller, clock: int, out: int) -> int:
    if clock not in _CLOCKS:
        return _ERRNO_INVAL
    return _store_u64(caller, out, _NS_PER_MS)


@dataclass(frozen=True)
class RunOutcome:
    """What one run came to: stdout on success, else the huh code and why."""

    stdout: bytes = b""
    failure: HuhCode | None = None
    reason: str = ""


def _output_file(wasi: Any, set_file: Callable[[Any, bytes], bool], stream: str,
                 cap: int) -> int:
    """A memory file as the module's `stream` ("stdout" or "stderr"), sized `cap` + 1:
    wasmtime opens (and truncates) it first, then it is sized and sealed against
    growing, so a write past the cap fails in the guest and memory stays bounded.
    Unwritten bytes read as zeros. A file, not a Python callback: wasmtime runs each
    callback stream on a task of its runtime, and creating and dropping one costs
    thread hand-overs (~200 us of CPU a call, whether the module writes or not)."""
    fd = os.memfd_create(f"agentd-wasm-{stream}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        if not set_file(wasi, f"/proc/self/fd/{fd}".encode()):
            raise wasmtime.WasmtimeError(f"cannot open the {stream} file")
        os.ftruncate(fd, cap + 1)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _written(fd: int, limit: int) -> bytes:
    """What the module wrote to an output file, at most `limit` bytes: a stream, so a
    prefix of the file, up to the first hole (page-grained) and less its trailing
    zero bytes (a response payload is XML text, in which a NUL character has no
    place)."""
    data = os.pread(fd, min(os.lseek(fd, 0, os.SEEK_HOLE), limit), 0)
    cut = data.find(0)  # memchr; `rstrip` tests the up to 4 KiB of zeros one by one
    if cut < 0:
        return data
    if data.count(0, cut) == len(data) - cut:
        return data[:cut]
    return data.rstrip(b"\0")  # a NUL written before the end: kept, and refused later


class WasmModule:
    """One configured module: its limits and its pre-linked code."""

    def __init__(self, config: WasmTool, pre: wasmtime.InstancePre, rt: WasmRuntime) -> None:
        self.config = config
        self.pre = pre
        self.rt = rt
        self.memory_bytes = config.memory_mb * 1024 * 1024
        # Each table element takes 8-16 bytes: MAX_TABLES full tables ~ memory_mb.
        self.table_elements = max(10_000, self.memory_bytes // (16 * MAX_TABLES))
        self.deadline_ticks = max(1, math.ceil(config.timeout_ms / 1000 / TICK_S))

    def run(self, stdin: bytes) -> RunOutcome:
        """One call, on the calling thread (its listener's, never the event loop).

        Straight on wasmtime's C API, as wasmtime-py calls it: its Python classes
        (a `Store`, a `WasiConfig`, an object for each of the instance's exports,
        the function's type checked on each call) cost more CPU than wasmtime's own
        work for a short call."""
        config = self.config
        store = _ffi.wasmtime_store_new(self.rt.engine.ptr(), None, _NO_FINALIZER)
        try:
            ctx = _ffi.wasmtime_store_context(store)
            _ffi.wasmtime_store_limiter(store, self.memory_bytes, self.table_elements, 1,
                                        MAX_TABLES, 1)
            _check(_ffi.wasmtime_context_set_fuel(ctx, config.fuel))
            out, err = self._set_wasi(ctx, stdin)
            try:
                with self.rt.ticker:
                    _ffi.wasmtime_context_set_epoch_deadline(ctx, self.deadline_ticks)
                    _call.cpu0 = time.thread_time_ns()
                    outcome = self._start(ctx)
                stdout = _written(out, MAX_STDOUT_BYTES) if outcome is None else b""
                stderr = _written(err, MAX_STDERR_LOG_BYTES)
            finally:
                os.close(err)
                os.close(out)
        finally:
            _ffi.wasmtime_store_delete(store)
        if stderr:
            log.info("wasm stderr module=%s: %r", config.module.name, stderr)
        if outcome is None:
            return RunOutcome(stdout=stdout)
        return outcome

    def _set_wasi(self, ctx: Any, stdin: bytes) -> tuple[int, int]:
        """The call's WASI context: `argv` its name, the preopens, stdin from memory;
        stdout and stderr into anonymous memory files that nothing else can open (a
        Python callback, or a file for stdin, costs wasmtime a hand-over to a thread
        of its own: ~100 us each). Returns the two files."""
        wasi = _ffi.wasi_config_new()
        fds: list[int] = []
        try:
            _ffi.wasi_config_set_argv(wasi, 1, _ARGV)
            for guest, host in self.config.preopens.items():
                if not _ffi.wasi_config_preopen_dir(wasi, os.fsencode(host), guest.encode(),
                                                    True):
                    raise wasmtime.WasmtimeError(f"cannot preopen {host}")
            _ffi.wasi_config_set_stdin_bytes(wasi, byref(_ffi.bytes_to_capi(stdin)))
            fds.append(_output_file(wasi, _ffi.wasi_config_set_stdout_file, "stdout",
                                    MAX_STDOUT_BYTES))
            fds.append(_output_file(wasi, _ffi.wasi_config_set_stderr_file, "stderr",
                                    MAX_STDERR_BYTES))
        except BaseException:
            _ffi.wasi_config_delete(wasi)
            for fd in fds:
                os.close(fd)
            raise
        try:
            _check(_ffi.wasmtime_context_set_wasi(ctx, wasi))  # takes the config
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds[0], fds[1]

    def _start(self, ctx: Any) -> RunOutcome | None:
        instance = _ffi.wasmtime_instance_t()
        trap = POINTER(_ffi.wasm_trap_t)()
        try:
            _enter(_ffi.wasmtime_instance_pre_instantiate(self.pre.ptr(), ctx, byref(instance),
                                                          byref(trap)), trap)
        except _RAN as exc:
            return self._failed(ctx, None, exc)
        start = _export(ctx, instance, b"_start", _EXTERN_FUNC)  # checked at load
        if start is None:
            return RunOutcome(failure=HuhCode.INTERNAL, reason="_start is no function")
        try:
            _enter(_ffi.wasmtime_func_call(ctx, byref(start.of.func), None, 0, None, 0,
                                           byref(trap)), trap)
        except _RAN as exc:
            return self._failed(ctx, instance, exc)
        return None

    def _failed(self, ctx: Any, instance: Any, exc: Exception) -> RunOutcome | None:
        """What a run that raised came to. One that failed with its memory at the cap
        failed for want of memory."""
        if isinstance(exc, wasmtime.ExitTrap):
            if exc.code == 0:
                return None
            code, reason = HuhCode.INTERNAL, f"exit code {exc.code}"
        elif isinstance(exc, wasmtime.Trap):
            if exc.trap_code is wasmtime.TrapCode.OUT_OF_FUEL:
                return RunOutcome(failure=HuhCode.BUDGET_EXCEEDED, reason="fuel exhausted")
            if exc.trap_code is wasmtime.TrapCode.INTERRUPT:
                return RunOutcome(failure=HuhCode.TIMEOUT, reason="wall time exceeded")
            code, reason = HuhCode.INTERNAL, f"trap: {exc.message}"
        else:
            code, reason = HuhCode.INTERNAL, f"error: {exc}"
        if instance is None:  # not instantiated: over the caps, or its start section failed
            if "exceeds memory limits" in reason or "exceeds table limits" in reason:
                return RunOutcome(failure=HuhCode.BUDGET_EXCEEDED, reason=f"{reason} (memory)")
            return RunOutcome(failure=code, reason=reason)
        memory = _export(ctx, instance, b"memory", _EXTERN_MEMORY)
        at_cap = (memory is not None and _ffi.wasmtime_memory_data_size(
            ctx, byref(memory.of.memory)) + WASM_PAGE > self.memory_bytes)
        if at_cap:
            return RunOutcome(failure=HuhCode.BUDGET_EXCEEDED,
                              reason=f"{reason} (memory cap reached)")
        return RunOutcome(failure=code, reason=reason)


_NO_FINALIZER = cast(0, CFUNCTYPE(None, c_void_p))
_NAME = create_string_buffer(b"module")
_ARGV = (POINTER(c_char) * 1)(cast(_NAME, POINTER(c_char)))
_RAN = (wasmtime.WasmtimeError, wasmtime.Trap)  # what a call into wasm raises
_EXTERN_FUNC, _EXTERN_MEMORY = _ffi.WASMTIME_EXTERN_FUNC.value, _ffi.WASMTIME_EXTERN_MEMORY.value


def _check(error: Any) -> None:
    if error:
        raise wasmtime.WasmtimeError._from_ptr(error)


def _enter(error: Any, trap: Any) -> None:
    """Raise what a call into wasm came to, as wasmtime-py's own calls do: its trap,
    its error (`ExitTrap` for `proc_exit`), or first an exception a host function
    raised."""
    if trap:
        found: Exception = wasmtime.Trap._from_ptr(trap)
    elif error:
        found = wasmtime.WasmtimeError._from_ptr(error)
    else:
        return
    _maybe_raise_last_exn()
    raise found


def _export(ctx: Any, instance: Any, name: bytes, kind: int) -> Any:
    """The instance's export `name` if it is of `kind`, else None."""
    item = _ffi.wasmtime_extern_t()
    found = _ffi.wasmtime_instance_export_get(ctx, byref(instance), name, len(name),
                                              byref(item))
    return item if found and item.kind == kind else None


class WasmHandler:
    """The listener's handler: the payload to the module, its stdout back."""

    def __init__(self, module: WasmModule, listener: str) -> None:
        self.module = module
        self.listener = listener

    async def __call__(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse:
        outcome = await self.module.rt.executor(self.listener).submit(self.module.run,
                                                                      to_xml(payload))
        if outcome.failure is not None:
            log.warning("wasm call failed listener=%s thread=%s reason=%s", self.listener,
                        meta.thread_id, outcome.reason)
            return HandlerResponse.error(outcome.failure)
        return HandlerResponse.respond(outcome.stdout)


@dataclass(frozen=True)
class WasmCode:
    """A `wasm` listener's module as checked at load: its settings, the SHA-256 of its
    content, and its code compiled and linked (immutable; kept while a listener's
    description holds it, and compared by content)."""

    config: WasmTool
    digest: str
    pre: wasmtime.InstancePre = field(compare=False, repr=False)


def describe(config: WasmTool, listener: str) -> Sequence[LoadedTool]:
    """Read, check and compile the module (once per content) for one listener."""
    try:
        with open(config.module, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ToolUnavailable(f"cannot read module {config.module}: {exc.strerror}") from None
    digest = hashlib.sha256(data).hexdigest()
    if config.sha256 is not None and digest != config.sha256:
        raise ToolUnavailable(f"module {config.module} has SHA-256 {digest}, "
                              f"not the configured {config.sha256}")
    try:
        pre = runtime().prepare(data, digest)
    except (wasmtime.WasmtimeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else "invalid module"
        raise ToolUnavailable(f"module {config.module} cannot be loaded: {first}") from None
    payloads = tuple(ref.value for ref in config.payload_class)
    responses = tuple(ref.value for ref in config.response_class)
    return (LoadedTool("wasm", listener, payloads, responses, spec_of(payloads[0]).description,
                     WasmCode(config, digest, pre)),)


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    rt = runtime()
    return [WasmHandler(WasmModule(spec.runs.config, spec.runs.pre, rt), spec.name)
            for spec in specs]
