"""One MCP server behind a `tool: {kind: mcp}` block: its session, pins and restarts.

`McpServer` owns one session with the server (a confined child over stdio, or
Streamable HTTP to an allowed host), started on the first call and kept open. Its
state is an explicit machine (`SERVER_TRANSITIONS`): a session that ends (the
process exits, writes anything but JSON-RPC, floods its output) moves to
`backoff`, and the next call after the delay starts a new one; calls in between
fail (the pump answers `huh internal`). Every session start lists the server's
tools again and compares each allowlisted tool's pin (SHA-256 over name,
description and input schema, taken at load) with what is offered now: a
differing tool is refused (`huh unroutable`, a security event) until a reload
pins it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from enum import Enum
from typing import Any, TypeVar

import httpx
from mcp import ClientSession, types

from agentd import _metrics
from agentd._errors import AgentdError, Denied, HuhCode
from agentd._states import step
from agentd.config.values import run_as
from agentd.confine import SYSTEM_READ_PATHS, Policy, resolve_executable
from agentd.mcp._stdio import Ending, confined_stdio
from agentd.tools.http import Resolver, system_resolver

T = TypeVar("T")
log = logging.getLogger("agentd.mcp")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 30.0
# Processes and threads of a stdio server and all it starts, without an isolation
# block (with one: its `max_tasks`, the same by default).
MCP_MAX_TASKS = 256


class ServerFailed(AgentdError):
    """The server could not answer (not running, crashed, timed out, answered out
    of bounds). The caller gets `huh internal`; the cause goes to the log."""


class CallTimedOut(ServerFailed):
    """A call past the server's `timeout_s`: the caller gets `huh timeout`, as for an
    exec program or a WASM module."""


class ServerState(Enum):
    IDLE = "idle"  # no session yet
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"  # the last session ended; the next starts after a delay
    CLOSED = "closed"


class ServerEvent(Enum):
    START = "start"  # a call needs a session
    READY = "ready"  # initialized, tools listed, pins checked
    ENDED = "ended"  # the session ended, or failed to start
    CLOSE = "close"  # the configuration that declared it is gone


S, E = ServerState, ServerEvent
SERVER_TRANSITIONS: dict[ServerState, dict[ServerEvent, ServerState]] = {
    S.IDLE: {E.START: S.STARTING, E.CLOSE: S.CLOSED},
    S.STARTING: {E.READY: S.READY, E.ENDED: S.BACKOFF, E.CLOSE: S.CLOSED},
    S.READY: {E.ENDED: S.BACKOFF, E.CLOSE: S.CLOSED},
    S.BACKOFF: {E.START: S.STARTING, E.CLOSE: S.CLOSED},
    S.CLOSED: {},
}


def pin_of(tool: types.Tool) -> str:
    """SHA-256 over the tool's name, description and input schema (canonical JSON)."""
    material = json.dumps([tool.name, tool.description or "", tool.inputSchema],
                          sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(material.encode()).hexdigest()


async def call_tool(session: ClientSession, tool: str, arguments: dict[str, Any],
                    progress: Any = None) -> types.CallToolResult:
    """`tools/call`, without `ClientSession.call_tool`'s check of `structuredContent`
    against the server's `outputSchema`: that schema is the server's (unpinned, it
    may arrive after load), jsonschema runs its patterns on the event loop, and one
    pattern with catastrophic backtracking stalled the daemon for seconds per call.
    agentd reads only a result's content (`result_of`), never `structuredContent`.
    With `progress` the request carries a progress token, and the server's progress
    notifications for it go there."""
    return await session.send_request(
        types.ClientRequest(types.CallToolRequest(
            params=types.CallToolRequestParams(name=tool, arguments=arguments))),
        types.CallToolResult,
        progress_callback=progress,
    )


def max_message_bytes(config: Any) -> int:
    """The most one message from a server may take (a stdio line, an HTTP answer):
    twice the result cap (JSON escaping) and 64 KiB of framing."""
    return 2 * config.max_result_bytes + 65536


def backoff_s(failures: int) -> float:
    """The delay before the next session after `failures` consecutive ends."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, failures - 1))


def stdio_policy(config: Any) -> Policy:
    """The confinement of a stdio server: that of `exec` (empty environment plus
    `env`, rlimits, Landlock, its own process group, network as configured). An
    `isolation:` block's `memory_mb` and `network` have been merged into the tool's
    at load (a contradiction is refused there); its `open_files` and `user` apply
    here (and its `max_tasks`; else `MCP_MAX_TASKS`)."""
    program = resolve_executable(config.command[0], dict(config.env))
    real = os.path.realpath(program)
    reads = (*SYSTEM_READ_PATHS, os.path.dirname(real), *(str(p) for p in config.read))
    root = str(config.root) if config.root is not None else None
    iso = config.isolation
    uid, gid = run_as(iso.user if iso is not None else None, "tool (mcp server)")
    return Policy(memory_mb=config.memory_mb, read_paths=reads,
                  open_files=iso.open_files if iso is not None else 256,
                  max_tasks=iso.max_tasks if iso is not None else MCP_MAX_TASKS,
                  write_paths=(root,) if root else (), network=config.network,
                  env=dict(config.env), cwd=root or "/", uid=uid, gid=gid)


# listener -> the server whose session started last under that name, for
# `agentctl status`. A server is listed once it starts (a dry-run reload builds
# servers that never do); a newer one for the same listener closes the older.
SERVERS: dict[str, McpServer] = {}
_CLOSING: set[asyncio.Task[None]] = set()


def _register(server: McpServer) -> None:
    old = SERVERS.get(server.name)
    SERVERS[server.name] = server
    if old is not None and old is not server:
        task = asyncio.get_running_loop().create_task(old.aclose())
        _CLOSING.add(task)  # a task nobody references may be collected before it runs
        task.add_done_callback(_CLOSING.discard)


class McpServer:
    """The runtime side of one `tool: {kind: mcp}` block."""

    def __init__(self, name: str, config: Any, pins: dict[str, str],
                 connect: Callable[[Any], contextlib.AbstractAsyncContextManager[Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.config = config
        self.pins = pins  # allowlisted tool -> pin taken at load
        self.refused: dict[str, str] = {}  # tool -> its pin as now offered, when it differs
        self.state = ServerState.IDLE
        self.restarts = 0
        self.last_end = ""
        self._connect = connect
        self._clock = clock
        self._failures = 0
        self._retry_at = 0.0
        self._session: ClientSession | None = None
        self._ready: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._ending: Ending | None = None

    def _move(self, event: ServerEvent) -> None:
        self.state = step("mcp server", SERVER_TRANSITIONS, self.state, event)

    def status(self) -> dict[str, Any]:
        return {"server": self.name, "state": self.state.value, "restarts": self.restarts,
                "last_end": self.last_end, "refused": sorted(self.refused)}

    async def call(self, tool: str, arguments: dict[str, Any],
                   on_security: Callable[[str, dict[str, str]], None] | None = None,
                   progress: Any = None) -> types.CallToolResult:
        session = await self._session_for_call()
        if tool in self.refused:
            raise Denied("mcp tool changed since it was pinned", code=HuhCode.UNROUTABLE,
                         server=self.name, tool=tool, pinned=self.pins[tool],
                         offered=self.refused[tool])
        try:
            if self._ending is None:
                return await asyncio.wait_for(call_tool(session, tool, arguments, progress),
                                              self.config.timeout_s)
            # A server that ends mid-call fails the call at once (`internal`), not
            # at its timeout.
            return await _unless_ended(call_tool(session, tool, arguments, progress),
                                       self._ending, self.config.timeout_s)
        except TimeoutError:
            raise CallTimedOut(f"mcp server {self.name}: {tool} did not answer in "
                               f"{self.config.timeout_s}s") from None
        except Exception as exc:
            raise ServerFailed(f"mcp server {self.name}: {tool} failed: {exc}") from exc

    async def _session_for_call(self) -> ClientSession:
        if self.state is ServerState.CLOSED:
            raise ServerFailed(f"mcp server {self.name} is closed")
        if self._ending is not None and self._ending.ended.is_set() \
                and self.state is ServerState.READY:
            raise ServerFailed(f"mcp server {self.name} is restarting ({self._ending.reason})")
        if self.state is ServerState.BACKOFF and self._clock() < self._retry_at:
            raise ServerFailed(f"mcp server {self.name} is restarting ({self.last_end})")
        if self.state in (ServerState.IDLE, ServerState.BACKOFF):
            if self.state is ServerState.BACKOFF:
                self.restarts += 1
                _metrics.mcp_server_restarts.labels(self.name).inc()
            self._move(E.START)
            _register(self)
            self._ready = asyncio.Event()
            self._stop = asyncio.Event()
            self._owner = asyncio.create_task(self._own_session(), name=f"mcp:{self.name}")
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), self.config.timeout_s)
        except TimeoutError:
            raise ServerFailed(f"mcp server {self.name} did not start in time") from None
        if self._session is None:
            raise ServerFailed(f"mcp server {self.name} is not running ({self.last_end})")
        return self._session

    async def _own_session(self) -> None:
        """Enter and leave the session in one task (the SDK's task groups need it)."""
        assert self._ready is not None and self._stop is not None
        ending = Ending()
        try:
            async with self._connect(self.config) as (read, write, ending), \
                    ClientSession(read, write) as session:
                self._ending = ending
                await asyncio.wait_for(session.initialize(), self.config.timeout_s)
                offered = await asyncio.wait_for(session.list_tools(), self.config.timeout_s)
                self._check_pins(offered.tools)
                self._session = session
                self._failures = 0
                self._move(E.READY)
                self._ready.set()
                stop = asyncio.ensure_future(self._stop.wait())
                gone = asyncio.ensure_future(ending.ended.wait())
                await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                gone.cancel()
        except Exception as exc:  # a failed start is an end like any other
            ending.set(f"session failed: {type(exc).__name__}: {exc}")
        finally:
            self._session = None
            self._ready.set()
            if self.state is not ServerState.CLOSED:
                self._failures += 1
                self.last_end = ending.reason or "session ended"
                self._retry_at = self._clock() + backoff_s(self._failures)
                self._move(E.ENDED)
                log.error("mcp server %s: session ended (%s); next start in %.1fs",
                          self.name, self.last_end, backoff_s(self._failures))

    def _check_pins(self, offered: list[types.Tool]) -> None:
        by_name = {t.name: t for t in offered}
        self.refused = {}
        for name, pinned in self.pins.items():
            tool = by_name.get(name)
            now = pin_of(tool) if tool is not None else "absent"
            if now != pinned:
                self.refused[name] = now
                log.warning("mcp server %s: tool %s changed since it was pinned "
                            "(pinned %s, offered %s); refused until a reload",
                            self.name, name, pinned[:12], now[:12])

    async def aclose(self) -> None:
        if self.state is not ServerState.CLOSED:
            self._move(E.CLOSE)
        if self._stop is not None:
            self._stop.set()
        if self._owner is not None:
            with contextlib.suppress(BaseException):
                await self._owner


@contextlib.asynccontextmanager
async def stdio_connection(config: Any) -> AsyncIterator[Any]:
    ending = Ending()
    max_line = max_message_bytes(config)
    async with confined_stdio(list(config.command), stdio_policy(config),
                              max_line=max_line, ending=ending) as (read, write):
        yield read, write, ending


@contextlib.asynccontextmanager
async def http_connection(config: Any, resolver: Resolver = system_resolver
                          ) -> AsyncIterator[Any]:
    """A Streamable HTTP session to the address checked when it starts (`resolver`,
    the system's by default, is asked once; see `agentd.mcp.address`)."""
    from mcp.client.streamable_http import streamable_http_client

    from agentd.mcp.address import PinnedTransport, check_url

    checked = await check_url(str(config.url), config.allow_private, resolver)
    ending = Ending()
    # No proxy from the environment and no redirects: the checked address is the one used.
    transport = BoundedTransport(
        PinnedTransport(checked, httpx.AsyncHTTPTransport(trust_env=False, retries=0)),
        max_bytes=max_message_bytes(config), max_seconds=config.timeout_s + 1.0,
        ending=ending)
    async with httpx.AsyncClient(transport=transport, timeout=config.timeout_s,
                                 trust_env=False, follow_redirects=False) as http, \
            streamable_http_client(str(config.url), http_client=http) as (read, write, _):
        yield read, write, ending


class BoundedTransport(httpx.AsyncBaseTransport):
    """What an MCP server's HTTP answers may cost the daemon (the SDK bounds none):

    - no GET: the SDK opens a standing GET stream for server-initiated messages, which
      agentd never uses; on it a server could send an endless line, notifications
      without end, or `retry: 0` reconnections. It is answered 405 here, as a server
      without that stream answers, without a request leaving the daemon;
    - a response is read up to `max_bytes` (the stdio line cap: twice the result cap
      plus 64 KiB); past that the session ends, as for an over-long stdio line (the
      SDK read a JSON answer whole: 1 GB took the daemon to 7 GB);
    - a response lasts at most `max_seconds` (the call's timeout and a second): a
      server dripping a byte at a time no longer keeps exchanges open past their
      call."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, max_bytes: int,
                 max_seconds: float, ending: Ending) -> None:
        self.inner = inner
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.ending = ending

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(405, request=request)
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code, headers=response.headers, request=request,
            extensions=response.extensions,
            stream=_BoundedStream(response.stream, self, time.monotonic() + self.max_seconds))

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limits: BoundedTransport,
                 deadline: float) -> None:
        self._inner = inner
        self._limits = limits
        self._deadline = deadline

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        limits = self._limits
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > limits.max_bytes:
                limits.ending.set(f"server sent a response over {limits.max_bytes} bytes")
                limits.ending.ended.set()
                raise httpx.ReadError("mcp: a response over the size limit")
            if time.monotonic() > self._deadline:
                raise httpx.ReadTimeout("mcp: a response past its call's timeout")
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def connection_for(config: Any) -> Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]:
    return stdio_connection if config.command is not None else http_connection


async def list_offered(config: Any, endings: list[Any] | None = None) -> list[types.Tool]:
    """Start one session, list the server's tools, end it: what load pins. `endings`
    gets the session's `Ending` (why a server that failed ended, its stderr)."""
    async with connection_for(config)(config) as (read, write, ending), \
            ClientSession(read, write) as session:
        if endings is not None:
            endings.append(ending)
        await _unless_ended(session.initialize(), ending, config.timeout_s)
        offered = await _unless_ended(session.list_tools(), ending, config.timeout_s)
    return list(offered.tools)


async def _unless_ended(request: Awaitable[T], ending: Ending, timeout_s: float) -> T:
    """`request`'s answer; `ServerFailed` as soon as the server has ended (a server
    that exits as it starts fails check-config at once, not after `timeout_s`)."""
    call = asyncio.ensure_future(request)
    gone = asyncio.ensure_future(ending.ended.wait())
    try:
        done, _ = await asyncio.wait({call, gone}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if call in done:
        return call.result()
    call.cancel()
    with contextlib.suppress(BaseException):
        await call
    if gone in done:
        raise ServerFailed(ending.reason or "server ended")
    raise TimeoutError
