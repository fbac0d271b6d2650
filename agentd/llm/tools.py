"""Provider tool names for listener names, for native tool calling.

Providers accept tool names matching `^[a-zA-Z0-9_-]{1,64}$`; listener names may
also hold `.` (an MCP server's `NAME.TOOL`) and `:` (a peer organism's
`GATEWAY:LISTENER`). The mapping is fixed (`.` -> `__`, `:` -> `--`) so an operator
can read a tool name back; a name with any other character, or longer than 64
characters once mapped, has no tool name, and two peers of one agent that map to
one tool name are refused at load (`tool_names`), so the way back is a lookup in
the agent's own table, never a guess.

A tool's parameters are the payload's JSON Schema, derived from its XSD (`Shape`,
`input_schema`); a call's JSON arguments become the payload element
(`payload_xml`). `agentd mcp-serve` offers listeners to MCP clients with the same
mapping, so a listener looks the same to a model and to an MCP client.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lxml import etree

from agentd._xml import escape_text

NATIVE, XML, AUTO = "native", "xml", "auto"  # agent.tool_calling
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_LISTENER = re.compile(r"[A-Za-z0-9_.:\-]+")


class ToolNameError(ValueError):
    """A listener name that cannot be offered as a provider tool, with why."""


def tool_name(listener: str) -> str:
    """The provider tool name of `listener` (`ToolNameError` if it has none)."""
    if not _LISTENER.fullmatch(listener):
        raise ToolNameError(
            f"listener {listener!r} cannot be a provider tool: its name may hold letters, "
            "digits, '_', '-', '.' and ':' only (or set agent.tool_calling: xml)")
    name = listener.replace(".", "__").replace(":", "--")
    if not TOOL_NAME.fullmatch(name):
        raise ToolNameError(
            f"listener {listener!r} cannot be a provider tool: its tool name {name!r} has "
            f"{len(name)} characters, at most 64 are allowed (rename it, or set "
            "agent.tool_calling: xml)")
    return name


def tool_names(peers: Iterable[str]) -> dict[str, str]:
    """Tool name -> listener for one agent's peers; `ToolNameError` naming the first
    peer without a tool name, or two peers that map to one."""
    table: dict[str, str] = {}
    for peer in dict.fromkeys(peers):
        name = tool_name(peer)
        other = table.get(name)
        if other is not None:
            raise ToolNameError(
                f"peers {other!r} and {peer!r} both map to the provider tool name {name!r} "
                "('.' becomes '__', ':' becomes '--'): rename one, or set "
                "agent.tool_calling: xml")
        table[name] = peer
    return table


# ---- the payload as JSON: XSD -> JSON Schema, JSON arguments -> payload XML --------

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
