"""MCP: tools from Model Context Protocol servers, and organisms as MCP servers.

Client side: `describe` turns a `tool: {kind: mcp}` block into one tool per
allowlisted MCP tool (listener `NAME.TOOL`). At load it starts the server once,
lists its tools, pins each allowlisted one (SHA-256 over name, description and
input schema) and generates its payload class from the input schema; a tool the
allowlist does not name is never seen again. `handlers` (the daemon's wiring) makes
the block's one `McpServer`, through which the calls go at run time (one session,
restarted with backoff, pins checked on every start).
Server side: `agentd.mcp.serve` (`agentd mcp-serve`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mcp import types

from agentd import _metrics
from agentd._errors import Denied
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import ILLEGAL_XML_CHAR
from agentd.confine import ConfinementUnavailable, check_enforceable
from agentd.mcp.client import (
    SERVERS,
    CallTimedOut,
    McpServer,
    ServerFailed,
    ServerState,
    connection_for,
    list_offered,
    pin_of,
    stdio_policy,
)
from agentd.mcp.schema import Unmappable, arguments_of, payload_class, result_class
from agentd.tools.kinds import Handler, LoadedTool, ToolUnavailable

log = logging.getLogger("agentd.mcp")

__all__ = [
    "SERVERS",
    "McpServer",
    "McpToolCall",
    "McpUse",
    "ServerFailed",
    "ServerState",
    "close_servers",
    "describe",
    "handlers",
    "pin_of",
    "servers_status",
]

async def close_servers() -> None:
    """End every live server's session and process group (the daemon's stop)."""
    servers = list(SERVERS.values())
    SERVERS.clear()
    for server in servers:
        await server.aclose()


def servers_status() -> list[dict[str, Any]]:
    return [server.status() for _, server in sorted(SERVERS.items())]


@dataclass(frozen=True)
class McpUse:
    """One allowlisted tool of an MCP server, as loaded: the server's settings, the
    pins of every tool the block allows, the tool's name and its result class."""

    server: str  # the `tool:` block's listener name
    config: Any
    pins: tuple[tuple[str, str], ...]  # (tool, pin) for each allowlisted tool
    tool: str
    result_class: type


def describe(config: Any, listener: str) -> Sequence[LoadedTool]:
    """Start the server once, list its tools, pin the allowlisted ones and generate
    their payload classes (the server is ended again: its session is the handlers')."""
    if (config.command is None) == (config.url is None):
        raise ToolUnavailable("an mcp tool needs exactly one of `command` (stdio) or `url`")
    if config.command is not None:
        try:
            check_enforceable(stdio_policy(config))
        except (ConfinementUnavailable, FileNotFoundError) as exc:
            raise ToolUnavailable(f"mcp server {listener}: {exc}") from None
    offered = _probe(config, listener)
    by_name = {t.name: t for t in offered}
    missing = [name for name in config.tools if name not in by_name]
    if missing:
        names = ", ".join(sorted(by_name)) or "none"
        raise ToolUnavailable(f"mcp server {listener} does not offer {', '.join(missing)} "
                              f"(it offers {names})")
    pins = tuple((name, pin_of(by_name[name])) for name in config.tools)
    specs = []
    for name, pin in pins:
        offer = by_name[name]
        try:
            payload = payload_class(listener, name, offer.inputSchema)
        except Unmappable as exc:
            raise ToolUnavailable(f"mcp tool {name!r}: input schema at {exc.pointer}: "
                                  f"{exc.why}") from None
        result = result_class(listener, name, config.max_result_bytes)
        specs.append(LoadedTool(
            "mcp", f"{listener}.{name}", payload_classes=(payload,),
            response_classes=(result,), description=f"MCP tool {name} of server {listener}.",
            runs=McpUse(listener, config, pins, name, result),
            third_party=" ".join((offer.description or "").split()), ref=f"tool:mcp:{pin}"))
    return specs


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    """One `McpServer` per server (its tools' listeners share its session)."""
    servers: dict[str, McpServer] = {}
    built: list[Handler] = []
    for spec in specs:
        use: McpUse = spec.runs
        server = servers.get(use.server)
        if server is None:
            server = servers[use.server] = McpServer(use.server, use.config, dict(use.pins),
                                                     connection_for(use.config))
        built.append(McpToolCall(server, spec.name, use.tool, use.result_class))
    return built


def _probe(config: Any, listener: str) -> list[types.Tool]:
    """List the server's tools from synchronous load code, in a thread of its own
    (load may run inside the daemon's event loop, during a reload)."""
    box: list[Any] = []
    endings: list[Any] = []

    def run() -> None:
        try:
            box.append(asyncio.run(asyncio.wait_for(list_offered(config, endings),
                                                    config.timeout_s)))
        except BaseException as exc:  # reported below, in the loading thread
            box.append(exc)

    thread = threading.Thread(target=run, name=f"mcp-probe:{listener}")
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        exc = box[0]
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # anyio task groups
            exc = exc.exceptions[0]
        ending = endings[0] if endings else None
        if isinstance(exc, TimeoutError):
            why = f"no answer within timeout_s ({config.timeout_s:g}s)"
        elif ending is not None and ending.reason:
            why = ending.reason
        else:
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if ending is not None and ending.stderr:  # what the server said, last
            why += f"; its stderr ends with: {ending.stderr.splitlines()[-1]}"
        raise ToolUnavailable(f"mcp server {listener} could not be listed: {why}") from None
    return list(box[0])


class McpToolCall:
    """The handler of one MCP tool's listener: payload -> JSON arguments -> the
    server -> a capped, validated `mcp-result`."""

    def __init__(self, server: McpServer, listener: str, tool: str, result_cls: type) -> None:
        self.server = server
        self.listener = listener
        self.tool = tool
        self.result_cls = result_cls

    async def __call__(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse:
        count = _metrics.mcp_calls
        try:
            answer = await self.server.call(self.tool, arguments_of(payload),
                                            progress=_reporter(meta._progress))
        except Denied:
            count.labels(self.listener, "refused").inc()
            raise
        except CallTimedOut as exc:
            count.labels(self.listener, "failed").inc()
            log.warning("%s", exc)
            return HandlerResponse.error("timeout", "the tool did not answer in time")
        except ServerFailed:
            count.labels(self.listener, "failed").inc()
            raise
        try:
            response = result_of(answer, self.result_cls, self.server.config.max_result_bytes)
        except ServerFailed:
            count.labels(self.listener, "too-large").inc()
            raise
        count.labels(self.listener, "error" if answer.isError else "ok").inc()
        return HandlerResponse.respond(response)


def _reporter(report: Any) -> Any:
    """The SDK's progress callback for a call whose conversation's owner asked to
    see steps (`report`, from the pump); None: the server is not asked for any."""
    if report is None:
        return None

    async def progress(value: float, total: float | None, message: str | None) -> None:
        report(value, total, message)

    return progress


def result_of(answer: types.CallToolResult, result_cls: type, cap: int) -> Any:
    """The `mcp-result` for a server's answer; `ServerFailed` when it is over `cap`
    bytes of content. Characters XML cannot carry are dropped."""
    content_cls = _content_class(result_cls)
    items = []
    total = 0
    for item in answer.content:
        text = data = mime = None
        if isinstance(item, types.TextContent):
            text = item.text
        elif isinstance(item, (types.ImageContent, types.AudioContent)):
            data, mime = item.data, item.mimeType
        elif isinstance(item, types.EmbeddedResource):
            res = item.resource
            if isinstance(res, types.TextResourceContents):
                text = res.text
            else:
                data = res.blob
            mime = res.mimeType
        elif isinstance(item, types.ResourceLink):
            text = str(item.uri)
        else:
            text = ""
        total += len(text or "") + len(data or "")
        if total > cap:
            raise ServerFailed(f"mcp result over {cap} bytes")
        if data is not None:
            base64.b64decode(data, validate=True)  # binascii.Error: not base64
        items.append(content_cls(type=item.type[:64],
                                 text=None if text is None else ILLEGAL_XML_CHAR.sub("", text),
                                 data=data, mime_type=mime))
    return result_cls(content=items, is_error=bool(answer.isError))


def _content_class(result_cls: type) -> type:
    from agentd._xmlify import spec_of

    nested = spec_of(result_cls).fields[0].nested
    assert nested is not None
    return nested.cls
