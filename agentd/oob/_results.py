"""Command results as XML, and back to JSON values for `agentctl --json`.

A `<result>` may hold any XML (privileged.xsd: `xs:any`). So that clients get a
stable, typed JSON shape, results built from Python values with `result_element`
mark their collections and their non-string scalars, and `element_to_json` reads
any element by these rules, in order:

1. `type="list"` -> a JSON array of the converted children (whatever their names);
2. `type="map"` -> an object (used for an empty mapping, or one whose keys are all
   `item`, which rule 5 would otherwise read as a list);
3. `type="int"`, `"float"`, `"bool"` (text `true`/`false`), `"null"` -> that scalar;
4. no attributes and no child elements -> its text, a string ("" when empty);
5. child elements all named `item`, no attributes -> an array;
6. otherwise an object: attributes -> `"name": "value"`; child elements -> by local
   name, an array when the name repeats; an attribute whose name a child also has
   becomes `"@name"`; non-blank text beside children -> `"#text"`.

Namespaces are dropped (local names). `element_to_json(result_element(tag, v))`
equals `v` with tuples as lists (a property test checks it); times are sent as
ISO 8601 strings (`format_time`), so they stay strings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lxml import etree

from agentd._schemas import NS_PRIV

TYPE_ATTR = "type"


def result_element(tag: str, value: Any, *, namespace: str | None = NS_PRIV) -> etree._Element:
    """Encode a JSON-like value (dict, list/tuple, str, int, float, bool, None) as
    an element named `tag`. Keys must be XML names (ValueError otherwise)."""
    q = "" if namespace is None else f"{{{namespace}}}"
    root = etree.Element(q + tag, nsmap=None if namespace is None else {None: namespace})
    _fill(root, value, q)
    return root


def _fill(el: etree._Element, value: Any, q: str) -> None:
    if isinstance(value, Mapping):
        keys = [str(k) for k in value]
        if not keys or all(k == "item" for k in keys):
            el.set(TYPE_ATTR, "map")
        for key, item in value.items():
            _fill(etree.SubElement(el, q + str(key)), item, q)
    elif isinstance(value, list | tuple):
        el.set(TYPE_ATTR, "list")
        for item in value:
            _fill(etree.SubElement(el, q + "item"), item, q)
    elif value is None:
        el.set(TYPE_ATTR, "null")
    elif isinstance(value, bool):
        el.set(TYPE_ATTR, "bool")
        el.text = "true" if value else "false"
    elif isinstance(value, int | float):
        el.set(TYPE_ATTR, "int" if isinstance(value, int) else "float")
        el.text = repr(value)
    else:
        el.text = str(value)


# Scalar types `result_element` marks, and how `element_to_json` reads them back.
_SCALARS: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": lambda text: text == "true",
    "null": lambda _text: None,
}


def local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _children(el: etree._Element) -> list[etree._Element]:
    return [c for c in el if isinstance(c.tag, str)]


def element_to_json(el: etree._Element) -> Any:
    children = _children(el)
    attrs = {local(str(k)): str(v) for k, v in el.attrib.items()}
    marker = attrs.get(TYPE_ATTR)
    if marker == "list":
        return [element_to_json(c) for c in children]
    if marker in _SCALARS and len(attrs) == 1 and not children:
        try:
            return _SCALARS[marker]((el.text or "").strip())
        except ValueError:
            pass  # not a value of its declared type: read it as untyped XML
    if marker == "map":
        del attrs[TYPE_ATTR]
    elif not attrs and not children:
        return el.text or ""
    elif not attrs and all(local(c.tag) == "item" for c in children):
        return [element_to_json(c) for c in children]
    names = [local(c.tag) for c in children]
    out: dict[str, Any] = {}
    for key, value in attrs.items():
        out["@" + key if key in names else key] = value
    for name, child in zip(names, children, strict=True):
        converted = element_to_json(child)
        if names.count(name) > 1:
            out.setdefault(name, []).append(converted)
        else:
            out[name] = converted
    text = "".join([el.text or ""] + [c.tail or "" for c in el])
    if children and text.strip():
        out["#text"] = text.strip()
    elif not children and text:
        out["#text"] = text
    return out


def result_to_json(result: etree._Element | None) -> Any:
    """The JSON value of a `<result>` element (None when there is none)."""
    if result is None:
        return None
    return element_to_json(result)
