"""The YAML reader: text in, plain data and located issues out.

A configuration file is composed (never constructed) with PyYAML's safe loader, so
every value keeps the line and column it came from. `read_document` refuses
anything that is not plain data, turns the node tree into dicts, tuples and scalars,
and keeps an index from each key path to its nodes; `Issues` turns a pydantic
error (or one of our own rules) back into `file:line:col: key.path: message`.

Invariants:
- only plain data: no tags beyond the safe core types, no anchors or aliases (a
  file with `*alias` can be exponentially large once walked), no merge keys, no
  duplicate keys, no keys that are not strings, at most `MAX_DEPTH` levels;
- a key or value that breaks those rules is reported and left out of the data,
  so the rest of the file is still checked in the same pass;
- issues are reported in file order; the wording is ours, never pydantic's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from yaml.constructor import SafeConstructor

from agentd._errors import ConfigError

Loc = tuple[str | int, ...]
_UNKNOWN_KEY = ("unexpected_keyword_argument", "extra_forbidden")
ENTRY_ERROR = "config_entry"  # one of our rules, pointing at the mapping holding its key

_TAG = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
MAP, SEQ, TIMESTAMP, MERGE = (_TAG + t for t in ("map", "seq", "timestamp", "merge"))
# What the safe resolver gives plain scalars; `timestamp` passes here and is then
# refused by type where a string was expected (with a "quote it" hint).
_PLAIN_TAGS = frozenset({STR, INT, FLOAT, BOOL, NULL, MAP, SEQ, TIMESTAMP})
_KIND = {
    STR: "a string",
    INT: "an integer",
    FLOAT: "a number",
    BOOL: "a boolean",
    NULL: "null",
    MAP: "a mapping",
    SEQ: "a list",
    TIMESTAMP: "a date",
}
_CONSTRUCT = SafeConstructor()
MAX_DEPTH = 32  # a real organism.yaml nests about 5 levels


class _Mark(Protocol):
    line: int  # 0-based, like PyYAML's marks
    column: int


def kind_of(node: yaml.Node | None) -> str:
    """How an issue names what was written: "a string", "a list", ..."""
    if node is None:
        return "nothing"
    return _KIND.get(node.tag, f"a {node.tag} value")


def join(path: str, key: str | int) -> str:
    """`a.b`, `a[0]`, or `a['odd key']`: the key path shown in issues."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def path_text(loc: Loc) -> str:
    path = ""
    for part in loc:
        path = join(path, part)
    return path


@dataclass
class Document:
    """Plain data, with the key and value node of every key path."""

    data: Any
    values: dict[Loc, yaml.Node] = field(default_factory=dict)
    keys: dict[Loc, yaml.Node] = field(default_factory=dict)

    def node(self, loc: Loc) -> yaml.Node | None:
        return self.values.get(loc)


_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), 0x7F)}


class Issues:
    """The problems of one file, collected in one pass and reported in file order."""

    def __init__(self, source_name: str) -> None:
        self.source_name = source_name
        self._found: list[tuple[int, int, int, str]] = []

    def where(self, node: yaml.Node) -> str:
        mark = node.start_mark
        return f"{self.source_name}:{mark.line + 1}:{mark.column + 1}"

    def add(self, at: yaml.Node | _Mark | None, path: str, message: str) -> None:
        """A problem at a node (its start) or mark; None: the top of the file."""
        mark = None if at is None else at.start_mark if isinstance(at, yaml.Node) else at
        line, col = (0, 0) if mark is None else (mark.line + 1, mark.column + 1)
        text = f"{self.source_name}:{max(line, 1)}:{max(col, 1)}: {path or '(root)'}: {message}"
        # One issue, one line: a value echoed in a message (a path, a key) may hold
        # a newline or another control character; shown escaped, it cannot forge
        # a second issue line in the output or the log.
        text = text.translate(_ESCAPES)
        self._found.append((line, col, len(self._found), text))

    def __bool__(self) -> bool:
        return bool(self._found)

    def texts(self) -> list[str]:
        """All issues in file order (stable for issues at the same place)."""
        return [text for *_, text in sorted(self._found)]

    def raise_if_any(self) -> None:
        if self._found:
            raise ConfigError(self.texts())

    def add_validation_error(
        self, doc: Document, exc: ValidationError, schema: Mapping[str, Any], prefix: Loc = ()
    ) -> None:
        """Each pydantic error, located at its YAML node and worded by its type."""
        for error in exc.errors(include_url=False):
            loc = _data_loc(doc.data, prefix + tuple(error["loc"]))
            node, path = _locate(doc, loc, error["type"])
            # an unknown key is described by the mapping that holds it
            own = loc[len(prefix) : -1 if error["type"] in _UNKNOWN_KEY else None]
            message = describe(error, node, _schema_at(schema, own))
            self.add(node, path, message)


# ------------------------------------------------------------------------ composing


def read_document(text: str, issues: Issues) -> Document | None:
    """Compose `text` into plain data; None if it is not YAML we accept."""
    depth = 0
    try:
        # Lazily: the depth limit must stop the scanner early, as PyYAML's cost per
        # token grows with the flow nesting depth and its composer recurses.
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                issues.add(event.start_mark, "", f"aliases (*{event.anchor}) are not allowed")
            elif isinstance(event, yaml.NodeEvent) and event.anchor is not None:
                issues.add(event.start_mark, "", f"anchors (&{event.anchor}) are not allowed")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    issues.add(event.start_mark, "", f"nested more than {MAX_DEPTH} levels deep")
                    return None
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        issues.add(_mark(exc), "", f"invalid YAML: {_yaml_message(exc)}")
        return None
    except yaml.YAMLError as exc:
        issues.add(None, "", f"invalid YAML: {exc}")
        return None
    if issues:  # never walk a graph with aliases: it can be exponentially large
        return None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        issues.add(_mark(exc), "", f"invalid YAML: {_yaml_message(exc)}")
        return None
    if root is None:
        issues.add(None, "", "the configuration is empty")
        return None
    doc = Document(None)
    doc.data = _plain(root, (), doc, issues)
    return doc


def _mark(exc: yaml.MarkedYAMLError) -> Any:
    return exc.problem_mark or exc.context_mark


def _yaml_message(exc: yaml.MarkedYAMLError) -> str:
    return ", ".join(part for part in (exc.context, exc.problem) if part)


def _plain(node: yaml.Node, loc: Loc, doc: Document, issues: Issues) -> Any:
    doc.values[loc] = node
    path = path_text(loc)
    if node.tag == MERGE:
        issues.add(node, "", "merge keys (<<) are not allowed")
        return None
    if node.tag not in _PLAIN_TAGS:
        issues.add(node, "", f"YAML tag {node.tag!r} is not allowed (plain data only)")
        return None
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                issues.add(key_node, "", "merge keys (<<) are not allowed")
                continue
            if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == STR):
                issues.add(key_node, path, f"keys must be strings, got {kind_of(key_node)}")
                continue
            key = key_node.value
            if key in out:
                first = doc.keys[(*loc, key)].start_mark.line + 1
                message = f"duplicate key (first given on line {first})"
                issues.add(key_node, join(path, key), message)
                continue
            doc.keys[(*loc, key)] = key_node
            out[key] = _plain(value_node, (*loc, key), doc, issues)
        return out
    if isinstance(node, yaml.SequenceNode):
        return tuple(_plain(item, (*loc, i), doc, issues) for i, item in enumerate(node.value))
    return _CONSTRUCT.construct_object(node)


# ----------------------------------------------------------------- errors to issues


def _data_loc(data: Any, loc: Loc) -> Loc:
    """The part of a pydantic location that names keys and indexes of `data`.

    Pydantic adds segments of its own (a union member's tag, `[key]` for a bad
    dict key); they are dropped, except `[key]`, which `_locate` points at the key."""
    out: list[str | int] = []
    here: Any = data
    for part in loc:
        if part == "[key]":
            out.append(part)
            break
        if isinstance(here, Mapping) and isinstance(part, str):
            out.append(part)
            here = here.get(part)
        elif isinstance(here, tuple) and isinstance(part, int) and 0 <= part < len(here):
            out.append(part)
            here = here[part]
        elif here is None or not isinstance(here, Mapping | tuple):
            out.append(part)  # below a missing value: a required key, kept for the path
            here = None
    return tuple(out)


def _locate(doc: Document, loc: Loc, error_type: str) -> tuple[yaml.Node | None, str]:
    """The node an issue points at, and its key path."""
    if loc and loc[-1] == "[key]":
        return doc.keys.get(loc[:-1]), path_text(loc[:-1])
    path = path_text(loc)
    if error_type in _UNKNOWN_KEY and loc in doc.keys:
        return doc.keys[loc], path
    node = doc.values.get(loc)
    if node is not None and error_type not in ("missing", ENTRY_ERROR):
        return node, path
    for end in range(len(loc) - 1, -1, -1):  # a missing key: point at its mapping
        node = doc.values.get(loc[:end])
        if node is not None:
            return node, path
    return None, path


def _schema_at(schema: Mapping[str, Any], loc: Loc) -> Mapping[str, Any]:
    """The JSON Schema of the value at `loc` ({} when it cannot be followed)."""
    defs = schema.get("$defs", {})
    here: Mapping[str, Any] = schema
    for part in (*loc, None):
        here = _resolve(here, defs)
        if part is None or part == "[key]":
            break
        if isinstance(part, int):
            here = here.get("items", {})
        elif part in here.get("properties", {}):
            here = here["properties"][part]
        else:
            extra = here.get("additionalProperties")
            here = extra if isinstance(extra, Mapping) else {}
    return here


def _resolve(schema: Mapping[str, Any], defs: Mapping[str, Any]) -> Mapping[str, Any]:
    if "$ref" in schema:
        return _resolve(defs.get(schema["$ref"].rsplit("/", 1)[-1], {}), defs)
    for branch in schema.get("anyOf", ()):
        resolved = _resolve(branch, defs)
        if resolved.get("type") != "null":
            return resolved
    return schema


_EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dataclass_type": "a mapping",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "tuple_type": "a list",
    "list_type": "a list",
}


def describe(error: ErrorDetails, node: yaml.Node | None, schema: Mapping[str, Any]) -> str:
    """Our sentence for one pydantic error (custom errors carry ours already)."""
    kind = error["type"]
    if kind in _EXPECTED:
        hint = (
            " (quote it to make it a string)"
            if kind == "string_type" and isinstance(node, yaml.ScalarNode)
            else ""
        )
        return f"expected {_EXPECTED[kind]}, got {kind_of(node)}{hint}"
    if kind == "missing":
        return "required key is missing"
    if kind in _UNKNOWN_KEY:
        return "unknown key; expected one of: " + ", ".join(schema.get("properties", {}))
    if kind in ("greater_than_equal", "less_than_equal"):
        ctx = error.get("ctx") or {}  # the bound itself, where the schema path is lost
        lo, hi = schema.get("minimum", ctx.get("ge")), schema.get("maximum", ctx.get("le"))
        if lo is not None and hi is not None:
            return f"must be between {lo!s} and {hi!s}"
        return f"must be at least {lo!s}" if lo is not None else f"must be at most {hi}"
    if kind == "greater_than":
        return f"must be greater than {schema.get('exclusiveMinimum', 0)!s}"
    if kind == "finite_number":
        return "must be a finite number"
    if kind == "literal_error":
        if not isinstance(error["input"], str):
            return f"expected a string, got {kind_of(node)}"
        choices = ", ".join(str(c) for c in schema.get("enum", ()))
        return f"expected one of {choices}; got {error['input']!r}"
    if kind == ENTRY_ERROR:
        return error["msg"]
    if kind == "value_error":
        return str(error.get("ctx", {}).get("error", error["msg"]))
    message = error["msg"]
    return message[:1].lower() + message[1:]


def nulls_as_empty(data: Any, schema: Mapping[str, Any]) -> Any:
    """`key:` with no value where a mapping or list is expected reads as empty
    (`bus:` keeps every default); where null is allowed it stays null."""
    return _fill(data, schema, schema.get("$defs", {}))


def _fill(data: Any, schema: Mapping[str, Any], defs: Mapping[str, Any]) -> Any:
    nullable = any(branch.get("type") == "null" for branch in schema.get("anyOf", ()))
    resolved = _resolve(schema, defs)
    if data is None:
        if nullable:
            return None
        return (
            {}
            if resolved.get("type") == "object"
            else ()
            if resolved.get("type") == "array"
            else None
        )
    if isinstance(data, dict):
        props = resolved.get("properties", {})
        extra = resolved.get("additionalProperties")
        return {
            k: _fill(v, props.get(k, extra if isinstance(extra, Mapping) else {}), defs)
            for k, v in data.items()
        }
    if isinstance(data, tuple) and isinstance(resolved.get("items"), Mapping):
        return tuple(_fill(v, resolved["items"], defs) for v in data)
    return data
