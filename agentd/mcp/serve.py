"""`agentd mcp-serve`: an MCP stdio server that bridges to a running daemon.

It connects to the bus as one authenticated client and offers, as MCP tools,
exactly the listeners that client's profile permits: the list comes from the
bus's own meta introspection (`list-capabilities`, `request-schema`), so the
daemon, not this bridge, decides what is visible. Each tool's `inputSchema` is
derived from the listener's payload XSD (`Shape`); a call shapes the JSON
arguments into the payload element (the daemon validates it like any input),
sends it on a new thread, and returns the answer's C14N XML as text, with
`isError` for a `huh`. Frames are read by one task and handed to the call
waiting on their thread, so calls may run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from lxml import etree
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import AgentdError
from agentd._schemas import NS_CORE
from agentd._threads import new_uuid
from agentd._xml import c14n, escape_text
from agentd.client import BusClient, frame_kind, is_answer

XS = "{http://www.w3.org/2001/XMLSchema}"
_JSON_TYPES = {"boolean": "boolean", "integer": "integer", "double": "number",
               "decimal": "number"}
_OWN_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)


@dataclass
class Shape:
    """A payload element as its XSD declares it: name, namespace and child elements
    in order (each simple, with its JSON type, or nested)."""

    tag: str
    namespace: str
    fields: list[ShapeField] = field(default_factory=list)
    description: str = ""


@dataclass
class ShapeField:
    name: str
    min_occurs: int
    max_occurs: int
    json: dict[str, Any] = field(default_factory=dict)
    nested: Shape | None = None


def shape_of_xsd(xsd: str) -> Shape:
    """The root element's shape in an `@xmlify` XSD (the closed subset it emits)."""
    root = etree.fromstring(xsd.encode(), _OWN_PARSER)
    namespace = root.get("targetNamespace", "")
    types_ = {t.get("name"): t for t in root if t.tag in (XS + "complexType", XS + "simpleType")}
    element = root.find(XS + "element")
    if element is None:
        raise ValueError("schema has no root element")

    def local(ref: str | None) -> str:
        return (ref or "").split(":")[-1]

    def doc(node: Any) -> str:
        text = node.findtext(f"{XS}annotation/{XS}documentation")
        return " ".join((text or "").split())

    def simple(node: Any) -> dict[str, Any]:
        restriction = node.find(XS + "restriction")
        if restriction is None:
            return {"type": "string"}
        base = local(restriction.get("base"))
        out: dict[str, Any] = {"type": _JSON_TYPES.get(base, "string")}
        enum = [e.get("value") for e in restriction.findall(XS + "enumeration")]
        if enum:
            out["enum"] = enum
        length = restriction.find(XS + "maxLength")
        if length is not None:
            out["maxLength"] = int(length.get("value"))
        return out

    def complex_(name: str, tag: str, depth: int) -> Shape:
        if depth > 16:
            raise ValueError("schema nested too deeply")
        node = types_[name]
        shape = Shape(tag, namespace, description=doc(node))
        for child in node.iterfind(f"{XS}sequence/{XS}element"):
            kind = types_.get(local(child.get("type")))
            max_occurs = child.get("maxOccurs", "1")
            one = ShapeField(child.get("name"), int(child.get("minOccurs", "1")),
                             10**6 if max_occurs == "unbounded" else int(max_occurs))
            if kind is not None and kind.tag == XS + "complexType":
                one.nested = complex_(kind.get("name"), one.name, depth + 1)
            elif kind is not None:
                one.json = simple(kind)
            else:
                inline = child.find(XS + "simpleType")
                base = local(child.get("type"))
                one.json = simple(inline) if inline is not None else {
                    "type": _JSON_TYPES.get(base, "string")}
            if doc(child):
                one.json["description"] = doc(child)
            shape.fields.append(one)
        return shape

    shape = complex_(local(element.get("type")), element.get("name"), 0)
    shape.description = doc(element) or shape.description
    return shape


def input_schema(shape: Shape) -> dict[str, Any]:
    """The JSON Schema an MCP client sees for a payload shape."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in shape.fields:
        one = input_schema(f.nested) if f.nested is not None else dict(f.json)
        if f.max_occurs > 1:
            one = {"type": "array", "items": one, "maxItems": f.max_occurs}
        elif f.min_occurs:
            required.append(f.name)
        properties[f.name] = one
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def payload_xml(shape: Shape, arguments: Any) -> bytes:
    """The payload element for JSON `arguments`. Only shapes the text: the daemon
    parses and validates it against the XSD like any other input. `ValueError`
    for arguments that cannot be shaped."""
    return (f'<{shape.tag} xmlns="{shape.namespace}">' + _content(shape, arguments)
            + f"</{shape.tag}>").encode()


def _content(shape: Shape, arguments: Any) -> str:
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    extra = sorted(set(arguments) - {f.name for f in shape.fields})
    if extra:
        raise ValueError(f"unknown argument {extra[0]!r}")
    parts: list[str] = []
    for f in shape.fields:
        raw = arguments.get(f.name)
        if raw is None:
            continue
        items = raw if f.max_occurs > 1 else [raw]
        if not isinstance(items, list):
            raise ValueError(f"argument {f.name!r} must be an array")
        for item in items:
            text = _content(f.nested, item) if f.nested is not None else _text(item, f.name)
            parts.append(f"<{f.name}>{text}</{f.name}>")
    return "".join(parts)


def _text(value: Any, name: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return escape_text(str(value))
    raise ValueError(f"argument {name!r} has the wrong type")


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
