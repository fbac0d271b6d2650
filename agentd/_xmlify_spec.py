"""The compiled form of one payload contract: an `XmlSpec` holds a class's fields as
the schema sees them, the converters built from them for both directions, and the
documents derived from them (the XSD, a valid example, the tool-prompt fragment).

`agentd._xmlify` builds specs by analysing a dataclass; this module only turns the
analysed fields into converters and documents, and reflects on no type.

Invariants:
- One global element per schema (the payload root); nested classes are named
  complex types, so a nested element is never a valid payload on its own.
- Content models are closed: an `xs:sequence` of the fields in declaration order,
  no `xs:any`, no mixed content, no attributes.
- `from_element` trusts its input only because `validate` ran first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from operator import attrgetter
from typing import Any

from lxml import etree

from agentd._errors import ValidationError
from agentd._xmlify_types import SimpleType

__all__ = ["OWN_OUTPUT_PARSER", "XS", "Occurs", "XmlField", "XmlSpec"]

XS = "http://www.w3.org/2001/XMLSchema"
_XS = "{" + XS + "}"

# Parses only bytes this layer produced (to_element); never untrusted input.
OWN_OUTPUT_PARSER = etree.XMLParser(
    resolve_entities=False, no_network=True, load_dtd=False, remove_blank_text=False
)


class Occurs(Enum):
    REQUIRED = "required"
    OPTIONAL = "optional"  # `X | None`: None <-> element absent
    REPEATED = "repeated"  # `list[X]`: zero or more elements, bounded


@dataclasses.dataclass(frozen=True, slots=True)
class XmlField:
    """One field of a payload class, as the schema sees it."""

    name: str
    occurs: Occurs
    doc: str
    has_default: bool  # a REQUIRED field with a default may be omitted on input
    max_occurs: int
    default_text: str  # the default as element text, for the prompt ("" if none)
    simple: SimpleType | None = None
    nested: XmlSpec | None = None
    tag: str = ""  # the element's name: the field's name unless XmlName says otherwise

    @property
    def min_occurs(self) -> int:
        return 1 if self.occurs is Occurs.REQUIRED and not self.has_default else 0


class XmlSpec:
    """Everything agentd knows about one `@xmlify` class, built once at decoration."""

    def __init__(
        self,
        cls: type,
        namespace: str,
        tag: str,
        description: str,
        fields: tuple[XmlField, ...],
    ) -> None:
        self.cls = cls
        self.namespace = namespace
        self.tag = tag
        self.key: tuple[str, str] = (namespace, tag)
        self.clark = f"{{{namespace}}}{tag}"
        self.description = description
        self.fields = fields
        self._schema: etree.XMLSchema | None = None
        self._readers: dict[str, Callable[[Any], Any]] = {}
        self._write_content = _content_writer(cls, fields)
        self._root_open = f'<{tag} xmlns="{namespace}">'
        self._root_close = f"</{tag}>"
        self._read_root = self._reader(namespace)
        self.xsd = _build_xsd(self)
        self.example = (self._root_open + _example_content(fields) + self._root_close).encode()
        self.prompt = _build_prompt(self)

    def __repr__(self) -> str:
        return f"<XmlSpec {self.cls.__qualname__} {self.clark}>"

    @property
    def schema(self) -> etree.XMLSchema:
        if self._schema is None:
            self._schema = etree.XMLSchema(etree.fromstring(self.xsd.encode(), OWN_OUTPUT_PARSER))
        return self._schema

    def to_bytes(self, obj: Any) -> bytes:
        if obj.__class__ is not self.cls and not isinstance(obj, self.cls):
            raise TypeError(f"expected {self.cls.__qualname__}, got {type(obj).__qualname__}")
        return (self._root_open + self._write_content(obj) + self._root_close).encode()

    def to_element(self, obj: Any) -> etree._Element:
        return etree.fromstring(self.to_bytes(obj), OWN_OUTPUT_PARSER)

    def from_element(self, el: etree._Element) -> Any:
        """Build the dataclass from `el`, which `validate` has already accepted."""
        return self._read_root(el)

    def from_own_bytes(self, data: bytes) -> Any:
        """Build the dataclass from bytes `to_bytes` produced, or the C14N of an
        element that `validate` accepted (in this process, or in the daemon that hands
        them to its worker): no hostile-input checks, no validation. Never for bytes
        from anyone else."""
        return self._read_root(etree.fromstring(data, OWN_OUTPUT_PARSER))

    def validate(self, el: etree._Element) -> None:
        schema = self.schema
        if not schema.validate(el):
            raise ValidationError(_describe_errors(schema.error_log))

    def _reader(self, namespace: str) -> Callable[[Any], Any]:
        """The reader of this class's content model with its elements in `namespace`
        (a nested class takes the namespace of the payload it is nested in)."""
        reader = self._readers.get(namespace)
        if reader is None:
            reader = self._readers[namespace] = _content_reader(self.cls, self.fields, namespace)
        return reader


# --- converters of content: one closure per field, built once -----------------------


def _field_writer(cls: type, f: XmlField) -> Callable[[Any], str]:
    get = attrgetter(f.name)
    open_, close = f"<{f.tag}>", f"</{f.tag}>"
    where = f"{cls.__qualname__}.{f.name}"
    item: Callable[[Any], str]
    if f.nested is not None:
        nested_cls, write_nested = f.nested.cls, f.nested._write_content

        def nested_item(v: Any) -> str:
            if v.__class__ is not nested_cls and not isinstance(v, nested_cls):
                raise TypeError(
                    f"{where}: expected {nested_cls.__qualname__}, got {type(v).__qualname__}"
                )
            return write_nested(v)

        item = nested_item
    else:
        assert f.simple is not None
        item = f.simple.fmt

    if f.occurs is Occurs.REQUIRED:

        def write(obj: Any) -> str:
            return open_ + item(get(obj)) + close

    elif f.occurs is Occurs.OPTIONAL:

        def write(obj: Any) -> str:
            v = get(obj)
            return "" if v is None else open_ + item(v) + close

    else:
        limit = f.max_occurs

        def write(obj: Any) -> str:
            v = get(obj)
            if v.__class__ is not list and not isinstance(v, (list, tuple)):
                raise TypeError(f"{where}: expected list, got {type(v).__qualname__}")
            if len(v) > limit:
                raise ValueError(f"{where}: {len(v)} items exceed {limit}")
            return "".join([open_ + item(x) + close for x in v])

    return write


def _content_writer(cls: type, fields: tuple[XmlField, ...]) -> Callable[[Any], str]:
    writers = tuple(_field_writer(cls, f) for f in fields)
    if len(writers) == 1:
        return writers[0]

    def write(obj: Any) -> str:
        return "".join([w(obj) for w in writers])

    return write


def _content_reader(
    cls: type, fields: tuple[XmlField, ...], namespace: str
) -> Callable[[Any], Any]:
    table: dict[str, tuple[str, Callable[[Any], Any], bool]] = {}
    for f in fields:
        if f.nested is not None:
            read_one = f.nested._reader(namespace)
        else:
            assert f.simple is not None
            read_one = f.simple.read
        table[f"{{{namespace}}}{f.tag}"] = (f.name, read_one, f.occurs is Occurs.REPEATED)
    optional = tuple(f.name for f in fields if f.occurs is Occurs.OPTIONAL)
    repeated = tuple(f.name for f in fields if f.occurs is Occurs.REPEATED)
    lookup = table.get

    def read(el: Any) -> Any:
        kw: dict[str, Any] = dict.fromkeys(optional) if optional else {}
        for name in repeated:
            kw[name] = []
        for child in el:
            entry = lookup(child.tag)  # comments and PIs have no entry
            if entry is not None:
                name, read_child, many = entry
                if many:
                    kw[name].append(read_child(child))
                else:
                    kw[name] = read_child(child)
        return cls(**kw)

    return read


# --- documents: XSD, example, prompt -------------------------------------------------


def _build_xsd(spec: XmlSpec) -> str:
    ns = spec.namespace
    type_names: dict[XmlSpec, str] = {}
    order: list[XmlSpec] = []

    def collect(s: XmlSpec) -> None:
        if s in type_names:
            return
        base = s.cls.__name__
        try:
            etree.QName(ns, base)
        except ValueError:
            base = "type"
        name, n = base, 1
        while name in type_names.values():
            n += 1
            name = f"{base}{n}"
        type_names[s] = name
        order.append(s)
        for f in s.fields:
            if f.nested is not None:
                collect(f.nested)

    collect(spec)
    root = etree.Element(_XS + "schema", nsmap={"xs": XS, "tns": ns})
    root.set("targetNamespace", ns)
    root.set("elementFormDefault", "qualified")
    element = etree.SubElement(root, _XS + "element", name=spec.tag)
    element.set("type", "tns:" + type_names[spec])
    _annotate(element, spec.description)
    for s in order:
        ctype = etree.SubElement(root, _XS + "complexType", name=type_names[s])
        if s is not spec:  # the root's description is on its element already
            _annotate(ctype, s.description)
        sequence = etree.SubElement(ctype, _XS + "sequence")
        for f in s.fields:
            el = etree.SubElement(sequence, _XS + "element", name=f.tag)
            if f.min_occurs == 0:
                el.set("minOccurs", "0")
            if f.max_occurs != 1:
                el.set("maxOccurs", str(f.max_occurs))
            _annotate(el, f.doc)
            if f.nested is not None:
                el.set("type", "tns:" + type_names[f.nested])
            elif f.simple is not None and f.simple.facets:
                restriction = etree.SubElement(
                    etree.SubElement(el, _XS + "simpleType"), _XS + "restriction"
                )
                restriction.set("base", f.simple.base)
                for facet, value in f.simple.facets:
                    etree.SubElement(restriction, _XS + facet, value=value)
            elif f.simple is not None:
                el.set("type", f.simple.base)
    return etree.tostring(root, encoding="unicode", pretty_print=True)


def _annotate(parent: etree._Element, doc: str) -> None:
    if doc:
        annotation = etree.SubElement(parent, _XS + "annotation")
        etree.SubElement(annotation, _XS + "documentation").text = doc


def _example_content(fields: tuple[XmlField, ...]) -> str:
    parts = []
    for f in fields:
        if f.nested is not None:
            text = _example_content(f.nested.fields)
        else:
            assert f.simple is not None
            text = f.simple.fmt(f.simple.sample)
        parts.append(f"<{f.tag}>{text}</{f.tag}>")
    return "".join(parts)


def _build_prompt(spec: XmlSpec) -> str:
    head = f"<{spec.tag}>" + (f": {spec.description}" if spec.description else "")
    lines = [head, f"Namespace: {spec.namespace}"]
    if spec.fields:
        lines.append("Child elements, in this order:")
        _prompt_fields(spec.fields, lines, "")
    else:
        lines.append("No child elements.")
    lines += ["Example:", spec.example.decode()]
    return "\n".join(lines)


def _prompt_fields(fields: tuple[XmlField, ...], lines: list[str], indent: str) -> None:
    for f in fields:
        if f.occurs is Occurs.REPEATED:
            card = f"repeated 0 to {f.max_occurs} times"
        elif f.default_text:
            card = f"optional, default {f.default_text}"
        elif f.min_occurs == 0:
            card = "optional"
        else:
            card = "required"
        kind = "element with children" if f.nested is not None else f.simple.label  # type: ignore[union-attr]
        doc = f" - {f.doc}" if f.doc else ""
        lines.append(f"{indent}- <{f.tag}> {kind}, {card}{doc}")
        if f.nested is not None:
            _prompt_fields(f.nested.fields, lines, indent + "  ")


def _describe_errors(log: Any) -> str:
    errors = list(log)
    text = "; ".join(f"line {e.line}: {e.message}" for e in errors[:5])
    if len(errors) > 5:
        text += f"; and {len(errors) - 5} more"
    return text or "invalid"
