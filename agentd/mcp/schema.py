"""From an MCP tool's JSON Schema to a payload class, and back to JSON arguments.

Pure: takes a schema, returns `@xmlify` dataclasses (so the payload has an XSD, an
example and a tool-prompt fragment like any listener's), and converts a validated
payload into the JSON arguments the server receives. The mapping:

- an object becomes a class whose elements follow the order of `properties`;
  names in `required` are mandatory, the others optional;
- `string`, `integer`, `number`, `boolean` become text elements; `enum` (strings or
  integers) an enumeration; `array` a repeated element; a nested `object` a nested
  class; `["X", "null"]` is X.

Anything else (`$ref`, `anyOf`, arrays of arrays, property names that are not XML
and Python names) is refused with `Unmappable`, naming the JSON pointer, so the
operator learns at load, never at the first call. The result class `mcp-result`
is fixed and shared by every tool of a server; only its namespace differs.
"""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import field, make_dataclass
from enum import Enum
from typing import Annotated, Any

from lxml import etree

from agentd._xmlify import MaxLen, XmlName, xmlify

NS_BASE = "https://xml-pipeline.org/ns/mcp"
MAX_DEPTH = 8  # nested objects; a deeper schema is refused, not truncated
_SIMPLE: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool}


class Unmappable(ValueError):
    """A JSON Schema construct the payload mapping cannot carry, at `pointer`."""

    def __init__(self, pointer: str, why: str) -> None:
        super().__init__(f"{pointer or '/'}: {why}")
        self.pointer = pointer or "/"
        self.why = why


def namespace_of(listener: str, tool: str) -> str:
    return f"{NS_BASE}/{listener}/{tool}/v1"


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def payload_class(listener: str, tool: str, schema: Any) -> type:
    """The `@xmlify` payload class for `tool`'s `inputSchema`; `Unmappable` if none."""
    namespace = namespace_of(listener, tool)
    try:
        etree.QName("urn:x", tool)
    except ValueError:
        raise Unmappable("", f"tool name {tool!r} is not an XML element name") from None
    return object_class(schema, "", namespace, tool, class_name(tool), depth=0)


def class_name(tag: str) -> str:
    return "".join(part.capitalize() for part in tag.replace("-", "_").split("_") if part) or "T"


def _type_of(schema: dict[str, Any], pointer: str) -> str | None:
    kind = schema.get("type")
    if isinstance(kind, list):
        rest = [k for k in kind if k != "null"]
        if len(rest) != 1:
            raise Unmappable(pointer + "/type", f"a union of types {kind!r}")
        kind = rest[0]
    if kind is None and "enum" in schema:
        return None
    if not isinstance(kind, str):
        raise Unmappable(pointer, "no single `type`")
    return kind


def object_class(schema: Any, pointer: str, namespace: str, tag: str, name: str,
                  depth: int) -> type:
    if not isinstance(schema, dict):
        raise Unmappable(pointer, "not a schema object")
    for word in ("$ref", "anyOf", "oneOf", "allOf", "not", "patternProperties"):
        if word in schema:
            raise Unmappable(f"{pointer}/{_escape(word)}", f"`{word}` is not supported")
    if _type_of(schema, pointer) != "object":
        raise Unmappable(pointer, "the top level and nested values must be objects here")
    if depth > MAX_DEPTH:
        raise Unmappable(pointer, f"objects nested deeper than {MAX_DEPTH}")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise Unmappable(pointer + "/properties", "not an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise Unmappable(pointer + "/required", "not a list of names")
    for missing in set(required) - set(properties):
        raise Unmappable(pointer + "/required", f"{missing!r} is required but not a property")
    mandatory: list[tuple[str, Any]] = []
    optional: list[tuple[str, Any, Any]] = []
    docs: list[str] = []
    for prop, sub in properties.items():
        where = f"{pointer}/properties/{_escape(prop)}"
        if not prop.isidentifier() or keyword.iskeyword(prop) or prop.startswith("_"):
            raise Unmappable(where, f"property name {prop!r} is not usable as an element name")
        try:
            etree.QName("urn:x", prop)
        except ValueError:
            raise Unmappable(where, f"property name {prop!r} is not an XML name") from None
        tp, repeated = _field_type(sub, where, namespace, f"{name}_{prop}", depth)
        if isinstance(sub, dict) and isinstance(sub.get("description"), str):
            docs.append(f"    {prop}: {' '.join(sub['description'].split())}")
        if repeated:
            # An empty list is no element at all, whether required or not.
            optional.append((prop, list[tp], field(default_factory=list)))  # type: ignore[valid-type]
        elif prop in required:
            mandatory.append((prop, tp))
        else:
            optional.append((prop, tp | None, field(default=None)))
    cls = make_dataclass(name, [*mandatory, *optional], frozen=True)
    # Fields keep the order of `properties` in the XSD: dataclasses need defaults
    # last, so the order is restored by the element sequence below.
    order = list(properties)
    cls.__dataclass_fields__ = {k: cls.__dataclass_fields__[k] for k in order}  # type: ignore[attr-defined]
    given = schema.get("description")
    description = given if isinstance(given, str) else ""
    cls.__doc__ = (" ".join(description.split()) or f"Arguments of {tag}.") + (
        "\n\nArgs:\n" + "\n".join(docs) if docs else "")
    cls.__module__ = __name__
    try:
        return xmlify(namespace=namespace, tag=tag)(cls)
    except (TypeError, ValueError) as exc:
        raise Unmappable(pointer, str(exc)) from None


def _field_type(sub: Any, pointer: str, namespace: str, name: str,
                depth: int) -> tuple[Any, bool]:
    """(element type, repeated) for one property."""
    if not isinstance(sub, dict):
        raise Unmappable(pointer, "not a schema object")
    for word in ("$ref", "anyOf", "oneOf", "allOf", "not"):
        if word in sub:
            raise Unmappable(f"{pointer}/{_escape(word)}", f"`{word}` is not supported")
    kind = _type_of(sub, pointer)
    if kind == "array":
        items = sub.get("items")
        if not isinstance(items, dict):
            raise Unmappable(pointer + "/items", "an array needs one `items` schema")
        if _type_of(items, pointer + "/items") == "array":
            raise Unmappable(pointer + "/items", "arrays of arrays are not supported")
        tp, _ = _field_type(items, pointer + "/items", namespace, name, depth)
        return tp, True
    if "enum" in sub:
        return _enum(sub["enum"], pointer + "/enum", name), False
    if kind == "object":
        return object_class(sub, pointer, namespace, _tag(name), name, depth + 1), False
    if kind is None or kind not in _SIMPLE:
        raise Unmappable(pointer + "/type", f"type {kind!r} is not supported")
    tp = _SIMPLE[kind]
    max_length = sub.get("maxLength")
    if tp is str and isinstance(max_length, int) and not isinstance(max_length, bool) \
            and max_length >= 1:
        return Annotated[str, MaxLen(max_length)], False
    return tp, False


def _tag(name: str) -> str:
    return name.lower()


def _enum(values: Any, pointer: str, name: str) -> type[Enum]:
    if not isinstance(values, list) or not values:
        raise Unmappable(pointer, "an enum needs a non-empty list of values")
    if all(isinstance(v, str) for v in values) or all(
            isinstance(v, int) and not isinstance(v, bool) for v in values):
        if len(set(values)) != len(values):
            raise Unmappable(pointer, "repeated enum values")
        return Enum(name, [(f"v{i}", v) for i, v in enumerate(values)])  # type: ignore[return-value]
    raise Unmappable(pointer, "enum values must be all strings or all integers")


def arguments_of(payload: Any) -> dict[str, Any]:
    """The JSON arguments for a validated payload: the inverse of the mapping.

    Absent optional elements and empty repeated ones are left out, so the server
    applies its own defaults."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(payload):
        value = getattr(payload, f.name)
        if value is None or (isinstance(value, list) and not value):
            continue
        out[f.name] = [_json(v) for v in value] if isinstance(value, list) else _json(value)
    return out


def _json(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return arguments_of(value)
    return value


def result_class(listener: str, tool: str, max_bytes: int) -> type:
    """The `mcp-result` class in `tool`'s namespace: `content`* {`type`, `text`? |
    `data`? (base64) + `mime-type`?}, `is-error`. Strings are capped at `max_bytes`
    (the tool's `max_result_bytes`) so the XSD refuses what the cap refuses."""
    namespace = namespace_of(listener, tool)
    cap = Annotated[str, MaxLen(max(1, max_bytes))]

    @xmlify(namespace=namespace, tag="content")
    @dataclasses.dataclass(frozen=True)
    class McpContent:
        """One item of a tool's result: text, or base64 data with its MIME type."""

        type: Annotated[str, MaxLen(64)]
        text: cap | None = None
        data: cap | None = None
        mime_type: Annotated[Annotated[str, MaxLen(255)] | None, XmlName("mime-type")] = None

    @xmlify(namespace=namespace, tag="mcp-result")
    @dataclasses.dataclass(frozen=True)
    class McpResult:
        """What an MCP server answered: its content items, and whether it reports an
        error."""

        content: list[McpContent]
        is_error: Annotated[bool, XmlName("is-error")] = False

    return McpResult
