"""`agentd mcp-serve`: an MCP stdio server that bridges to a running daemon.

It connects to the bus as one authenticated client and offers, as MCP tools,
exactly the listeners that client's profile permits: the list comes from the
bus's own meta introspection (`list-capabilities`, `request-schema`), so the
daemon, not this bridge, decides what is visible. Each tool's `inputSchema` is
derived from the listener's payload XSD by the mapping native tool calling
uses too (`agentd.llm.tools`); a call shapes the JSON
arguments into the payload element (the daemon validates it like any input),
sends it on a new thread, and returns the answer's C14N XML as text, with
`isError` for a `huh`. Frames are read by one task and handed to the call
waiting on their thread, so calls may run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import AgentdError
from agentd._schemas import NS_CORE
from agentd._threads import new_uuid
from agentd._xml import c14n, escape_text
from agentd.client import BusClient, frame_kind, is_answer
from agentd.llm.tools import Shape, input_schema, payload_xml, shape_of_xsd


class Bridge:
    """One bus connection shared by every MCP call; answers routed by thread."""

    def __init__(self, bus: BusClient, timeout_s: float) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self._waiting: dict[str, asyncio.Future[bytes]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read(), name="mcp-serve:bus")

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader

    async def _read(self) -> None:
        try:
            async for frame in self.bus:
                if not is_answer(frame):
                    continue
                waiter = self._waiting.pop(frame_kind(frame)[2], None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(frame)
        finally:
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionError("the bus connection ended"))

    async def ask(self, payload: bytes, to: str | None = None) -> bytes:
        """Send `payload` on a new thread; the first answer on it (C14N envelope)."""
        thread = new_uuid()
        waiter: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._waiting[thread] = waiter
        try:
            await self.bus.send_raw(build_envelope(self.bus.client, thread, payload, to=to))
            return await asyncio.wait_for(waiter, self.timeout_s)
        finally:
            self._waiting.pop(thread, None)


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
    server: Server = Server("agentd")

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
        frame = await bridge.ask(payload, to=name)
        env = parse_envelope(frame)
        text = c14n(env.payload).decode()
        is_huh = env.sender == "core" and env.payload.tag == "{" + NS_CORE + "}huh"
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    isError=is_huh)

    return server


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                isError=True)


async def serve(bus: BusClient, timeout_s: float = 60.0) -> None:
    """Run the MCP server on this process's stdin/stdout until the client leaves."""
    async with bus:
        bridge = Bridge(bus, timeout_s)
        await bridge.start()
        try:
            offered = await discover(bridge)
            server = mcp_server(bridge, offered)
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())
        finally:
            await bridge.aclose()


__all__ = ["Bridge", "Shape", "discover", "input_schema", "payload_xml", "serve",
           "shape_of_xsd"]
