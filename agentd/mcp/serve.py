"""`agentd mcp-serve`: an MCP stdio server that bridges to a running daemon.

It connects to the bus as one authenticated client and offers, as MCP tools,
exactly the listeners that client's profile permits: the list comes from the
bus's own meta introspection (`list-capabilities`, `request-schema`), so the
daemon, not this bridge, decides what is visible. Each tool's `inputSchema` is
derived from the listener's payload XSD by the mapping native tool calling
uses too (`agentd.llm.tools`); a call shapes the JSON
arguments into the payload element (the daemon validates it like any input),
sends it on a new thread through `agentd.client.Client` (so calls run
concurrently, wait through an approval gate, and survive a dropped connection), and
returns the answer's C14N XML as text, with `isError` for a `huh`. When the MCP
client gives a progress token, the call asks for previews and each `partial` of an
agent's text and each `step` of what it does becomes a `notifications/progress`
(progress: the notifications so far; message: the piece, or the step in words).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

import agentd
from agentd._envelope import parse_envelope
from agentd._errors import AgentdError
from agentd._schemas import NS_CORE
from agentd._xml import c14n, escape_text
from agentd.client import Answer, Client, Event, Huh, Partial, Step
from agentd.llm.tools import Shape, input_schema, payload_xml, shape_of_xsd


class Bridge:
    """The MCP tools' calls over one `Client`: each waits for its outcome (through an
    approval gate too) and returns that frame."""

    def __init__(self, client: Client, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def ask(self, payload: bytes, to: str | None = None,
                  on_event: Callable[[Event], Awaitable[None]] | None = None) -> bytes:
        """Send `payload` on a new thread; its outcome (C14N envelope: the answer, or
        the `huh`). With `on_event`, previews are asked for and every event before
        the outcome goes there."""
        exchange = await self.client.start(payload, to=to, timeout=self.timeout_s,
                                           previews=on_event is not None)
        try:
            async for event in exchange.events():
                if isinstance(event, Answer):
                    return event.frame
                if on_event is not None:
                    await on_event(event)
        except Huh as huh:
            return huh.frame
        raise ConnectionError("the call ended without an outcome")  # pragma: no cover


class NotOffered(AgentdError):
    """The daemon tells this client nothing it could offer as MCP tools."""


@dataclass
class Offered:
    name: str
    description: str
    shape: Shape


async def discover(bridge: Bridge) -> dict[str, Offered]:
    """The listeners this client's profile permits, with their payload shapes."""
    answer = parse_envelope(await bridge.ask(
        f'<list-capabilities xmlns="{NS_CORE}"/>'.encode()))
    core = "{" + NS_CORE + "}"
    if answer.payload.tag != core + "capabilities":
        raise NotOffered("the daemon does not answer list-capabilities for this client "
                         "(it needs meta.allow_list_capabilities and allow_schema_requests)")
    offered: dict[str, Offered] = {}
    for cap in answer.payload.iterfind(core + "capability"):
        name = cap.findtext(core + "name") or ""
        schema = parse_envelope(await bridge.ask(
            f'<request-schema xmlns="{NS_CORE}"><name>{escape_text(name)}</name>'
            "</request-schema>".encode()))
        xsds = [x.text or "" for x in schema.payload.iterfind(core + "xsd")]
        if not xsds:
            continue  # no schema given out for it: not offered
        # One MCP tool per listener: its first payload class is the one offered.
        offered[name] = Offered(name, cap.findtext(core + "description") or "",
                                shape_of_xsd(xsds[0]))
    return offered


def mcp_server(bridge: Bridge, offered: dict[str, Offered]) -> Server:
    server: Server = Server("agentd", version=agentd.__version__)  # not the SDK's

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return [types.Tool(name=o.name, description=o.description,
                           inputSchema=input_schema(o.shape)) for o in offered.values()]

    @server.call_tool(validate_input=True)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        one = offered.get(name)
        if one is None:
            return _error("unknown tool")
        try:
            payload = payload_xml(one.shape, arguments)
        except ValueError as exc:
            return _error(f"invalid arguments: {exc}")
        frame = await bridge.ask(payload, to=name, on_event=_progress(server))
        env = parse_envelope(frame)
        text = c14n(env.payload).decode()
        is_huh = env.sender == "core" and env.payload.tag == "{" + NS_CORE + "}huh"
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    isError=is_huh)

    return server


def _progress(server: Server) -> Callable[[Event], Awaitable[None]] | None:
    """What turns a call's partials into MCP progress, when its client gave a token."""
    ctx = server.request_context
    token = ctx.meta.progressToken if ctx.meta is not None else None
    if token is None:
        return None
    sent = 0

    async def notify(event: Event) -> None:
        nonlocal sent
        if isinstance(event, Partial | Step):
            sent += 1
            text = event.text if isinstance(event, Partial) else event.describe()
            await ctx.session.send_progress_notification(
                token, float(sent), message=text, related_request_id=str(ctx.request_id))

    return notify


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                isError=True)


async def serve(client: Client, timeout_s: float = 60.0) -> None:
    """Run the MCP server on this process's stdin/stdout until the client leaves."""
    async with client:
        bridge = Bridge(client, timeout_s)
        offered = await discover(bridge)
        server = mcp_server(bridge, offered)
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())


__all__ = ["Bridge", "Shape", "discover", "input_schema", "payload_xml", "serve",
           "shape_of_xsd"]
