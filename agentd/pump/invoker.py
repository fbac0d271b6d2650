"""The invoker: runs one handler call, bounded by its listener's slots and timeout.

This is the seam between the pump and handler code: the pump decides what to call
and what the outcome turns into; the invoker only runs the call and reports its
outcome (the handler's return value, or a `CallFailed`). A handler that runs
elsewhere (an isolation pool's worker) is a listener whose handler is swapped for
its pool's: the invoker runs it like any other.

Timeouts: one watchdog task scans the running calls' deadlines a few times per
timeout period and cancels the expired ones (again on each tick while a handler
swallows the cancel). `asyncio.timeout()` per call costs ~5 us a hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

from agentd._errors import Denied, HuhCode
from agentd._handler import ChainStopped, HandlerMetadata
from agentd._routing import Listener
from agentd._threads import log_ids

log = logging.getLogger("agentd.pump")


class CallFailed:
    """A call's outcome when the handler did not return: raised, or timed out."""

    __slots__ = ("code", "event")

    def __init__(self, code: HuhCode, event: dict[str, str] | None = None) -> None:
        self.code = code
        # A refusal that is a security event (a tool's confinement said no): its
        # fields, for the pump to journal. None for crashes and timeouts.
        self.event = event

    def __repr__(self) -> str:
        return f"<CallFailed {self.code.value}>"


RAISED = CallFailed(HuhCode.INTERNAL)
TIMED_OUT = CallFailed(HuhCode.TIMEOUT)


class Invoker:
    """Runs handler calls on the calling task. `tick_s()` gives the watchdog's
    period, read again each tick (listeners and their timeouts change on reload)."""

    def __init__(self, tick_s: Callable[[], float]) -> None:
        self._tick_s = tick_s
        self.calls = 0  # handler invocations, for benchmarks and status
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        # Kept: asyncio.get_running_loop() costs a getpid() system call on every call.
        self._loop = loop
        self._watchdog = loop.create_task(self._watch(), name="pump-watchdog")

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None

    async def call(
        self, listener: Listener, payload: Any, meta: HandlerMetadata, conversation: str = ""
    ) -> object:
        """Run `listener`'s handler on `payload`: its return value, or `RAISED` /
        `TIMED_OUT`. Counts the outcome and the handler's time for the listener.
        `conversation`: the client's thread UUID the call serves, for the logs."""
        handler = listener.handler
        assert handler is not None
        self.calls += 1
        loop = self._loop
        assert loop is not None  # handlers run on the pump's workers, after start()
        task = asyncio.current_task(loop)
        assert task is not None
        if listener.active >= listener.max_concurrency:
            await listener.wait_for_slot()
        listener.active += 1
        started = time.perf_counter()
        self._deadlines[task] = loop.time() + listener.timeout_s
        result: object = RAISED
        try:
            result = await handler(payload, meta)
        except asyncio.CancelledError:
            if task not in self._expired:
                raise  # the pump is stopping
        except Exception as exc:
            result = _failed(exc, listener, meta, conversation)
        finally:
            listener.release_slot()
            del self._deadlines[task]
            if task in self._expired:  # also when the handler swallowed the cancel
                self._expired.discard(task)
                task.uncancel()
                log.warning("handler timed out listener=%s %s", listener.name,
                            log_ids(conversation or meta.thread_id, meta.thread_id))
                result = TIMED_OUT
        return _counted(listener, result, started)

    def call_now(
        self, listener: Listener, payload: Any, meta: HandlerMetadata, conversation: str = ""
    ) -> object:
        """`call` for a handler that never suspends (`Listener.immediate`), on the
        caller's stack: its coroutine is stepped once and has returned. No deadline:
        nothing could cancel it before it returns, on a task or not. It runs in a copy
        of the caller's context, as on a task of its own: what it sets in a context
        variable stays its own. The caller has checked the listener has a free slot."""
        handler = listener.handler
        assert handler is not None
        self.calls += 1
        listener.active += 1
        started = time.perf_counter()
        result: object = RAISED
        try:
            coroutine = handler(payload, meta)
            try:
                contextvars.copy_context().run(coroutine.send, None)
            except StopIteration as returned:
                result = returned.value
            else:  # pragma: no cover - `never_suspends` said it has no await
                coroutine.close()
                raise RuntimeError(f"handler of {listener.name} suspended")
        except Exception as exc:
            result = _failed(exc, listener, meta, conversation)
        finally:
            listener.release_slot()
        return _counted(listener, result, started)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick_s())
            now = loop.time()
            for task, deadline in list(self._deadlines.items()):
                if now >= deadline:
                    self._expired.add(task)
                    task.cancel()


def _failed(exc: Exception, listener: Listener, meta: HandlerMetadata,
            conversation: str) -> object:
    """What a handler's exception comes to: a refusal (`Denied`) its `CallFailed`,
    anything else logged with its traceback and `RAISED`."""
    if isinstance(exc, Denied):
        return CallFailed(exc.code, {**exc.fields, "cause": exc.cause,
                                     "listener": listener.name})
    log.exception("handler raised listener=%s %s", listener.name,
                  log_ids(conversation or meta.thread_id, meta.thread_id))
    return RAISED


def _counted(listener: Listener, result: object, started: float) -> object:
    """Count `result` for `listener` (and observe its time if it returned)."""
    if result is RAISED:
        listener.count("error")
    elif result.__class__ is CallFailed:
        listener.count("denied")
    elif result is TIMED_OUT:
        listener.count("timeout")
    else:
        listener.observe(time.perf_counter() - started)
        listener.count("ok")
    return result


def outcome_of(result: object) -> tuple[str, str]:
    """A call's outcome and huh code, for its span."""
    if result is RAISED:
        return "error", "internal"
    if result is TIMED_OUT:
        return "timeout", "timeout"
    if result.__class__ is CallFailed or result.__class__ is ChainStopped:
        code = getattr(result, "code", "denied")
        outcome = "denied" if result.__class__ is CallFailed else "stopped"
        return outcome, str(getattr(code, "value", code))
    return "ok", ""
