"""A handler worker's main: import one listener's handler once, then serve calls.

Run by the pool as ``python -E -s -P -m agentd.isolation.worker`` through the
confinement shim, so it starts already confined (rlimits, Landlock, seccomp, no
network unless allowed, empty environment plus the listener's). It speaks the
protocol of `_protocol.py` on descriptors 0 and 1, which it moves out of the way
first: the handler's `print` (or a forged envelope written to stdout) goes to
stderr, which the daemon only logs, never parses.

One call at a time. The worker is as untrusted as the handler it runs: the daemon
checks everything it sends back. An isolated LLM agent's worker runs the
platform's agent loop instead of a handler; its session calls go to the daemon as
requests in the middle of a call (`_agent.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import select
import sys
from typing import Any

from agentd._spin import wait_readable
from agentd.durable.state import DEFAULT_MAX_BYTES, StateBook
from agentd.isolation import _protocol as p


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_frame(fd: int) -> tuple[bytes, dict[str, Any], bytes]:
    return p.decode(_read_exact(fd, p.frame_length(_read_exact(fd, 4))))


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _resolve(ref: str) -> Any:
    """`module:attribute` (already checked by the daemon's configuration loader)."""
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_handler(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """Run a handler's coroutine to its end. Most handlers never suspend: they are
    stepped once without the event loop (`run_until_complete` costs ~45 us a call);
    one that suspends is resumed on the loop, as a task would resume it."""
    try:
        yielded = coro.send(None)
    except StopIteration as done:
        return done.value
    return loop.run_until_complete(_resume(coro, yielded))


async def _resume(coro: Any, yielded: Any) -> Any:
    while True:
        if isinstance(yielded, asyncio.Future):
            yielded._asyncio_future_blocking = False  # we wait on it, as Task.__step does
            with contextlib.suppress(BaseException):
                await yielded  # its outcome reaches the coroutine through result()
        else:  # a bare yield (asyncio.sleep(0)): give the loop one turn
            await asyncio.sleep(0)
        try:
            yielded = coro.send(None)
        except StopIteration as done:
            return done.value


def _payload_bytes(payload: object) -> bytes:
    from agentd import to_xml

    if payload is None:
        return b""
    if isinstance(payload, bytes | bytearray):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, list | tuple):
        return b"".join(_payload_bytes(x) for x in payload)
    to_bytes = getattr(payload, "to_bytes", None)  # core `answer`, for completeness
    return to_xml(payload) if to_bytes is None else bytes(to_bytes())


def _book(max_bytes: int, header: dict[str, Any], entries: Any) -> StateBook:
    """The slice of `meta.state` the daemon sent with a call."""
    book = StateBook(max_bytes)
    listener, thread = str(header["own_name"]), str(header["thread_id"])
    book.load((listener, thread, str(k), str(v)) for k, v in entries.items())
    return book


def serve(fd_in: int, fd_out: int) -> None:
    from agentd import HandlerResponse
    from agentd._core import core_from_element
    from agentd._xml import parse_untrusted
    from agentd._xmlify import spec_of

    kind, init, _ = _read_frame(fd_in)
    if kind != p.INIT:
        raise p.ProtocolError("expected INIT")
    sys.path[:] = [str(x) for x in init["sys_path"]]
    specs = {spec.clark: spec for spec in map(spec_of, map(_resolve, init["payload_classes"]))}
    agent = None
    if init.get("agent") is not None:
        from agentd.isolation._agent import WorkerAgent  # the platform's loop: agents only

        def ask(header: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
            _write(fd_out, p.encode(p.ASK, header, body))
            kind, reply, rest = _read_frame(fd_in)
            if kind != p.REPLY:
                raise p.ProtocolError("expected REPLY")
            return reply, rest

        handler = agent = WorkerAgent(init["agent"], tuple(s.cls for s in specs.values()), ask)
    else:
        handler = _resolve(init["handler"])
    state_max = int(init.get("state_max") or DEFAULT_MAX_BYTES)
    state_book = StateBook(state_max)  # no slice: the handler's view starts empty
    _write(fd_out, p.encode(p.READY, {"pid": os.getpid()}))
    loop = asyncio.new_event_loop()
    poller = select.poll()
    poller.register(fd_in, select.POLLIN)
    spin = False
    while True:
        if spin:  # only when the daemon's pool was not saturated: under load the spin
            wait_readable(poller)  # would take the CPU the daemon needs to feed us
        try:
            kind, header, body = _read_frame(fd_in)
        except EOFError:
            return
        entries = header.get("meta_state")
        book = state_book if entries is None else _book(state_max, header, entries)
        meta = p.decode_call(header, book)
        key = header.get("key")
        spin = header.get("spin") is True  # the daemon's pool had calls to spare
        extra = None
        try:
            spec = specs.get(key) if isinstance(key, str) else None
            if spec is not None:  # the daemon validated it and wrote these bytes itself
                payload: Any = spec.from_own_bytes(body)
            elif key is None:
                payload = core_from_element(parse_untrusted(body))
            else:  # a peer's result for an agent: the daemon records it, not us
                payload = body
            if agent is not None:
                agent.enter(meta.thread_id, header.get("state"))
            result = run_handler(loop, handler(payload, meta))
            if result is not None and not isinstance(result, HandlerResponse):
                raise TypeError(f"handler returned {type(result).__name__}")
            if agent is not None:
                extra = agent.leave(meta.thread_id)
            view = meta._view
            if view is not None and view.overlay:
                extra = {**(extra or {}), "meta_state": view.overlay}
            frame = p.encode_answer(result, _payload_bytes(result.payload if result else None),
                                    extra)
        except MemoryError:
            frame = p.encode(p.FAILED, {"error": "MemoryError"})  # the daemon replaces us
        except Exception as exc:
            frame = p.encode(p.FAILED, {"error": type(exc).__name__})
            print(f"handler raised {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        _write(fd_out, frame)


def main() -> None:
    fd_in, fd_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # stdout is the log, not the protocol
    serve(fd_in, fd_out)


if __name__ == "__main__":
    main()
