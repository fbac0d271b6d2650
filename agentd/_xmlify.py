"""The schema layer: `@xmlify` turns a dataclass into a payload contract.

Decoration analyses the class once and keeps, in an `XmlSpec`: the XSD (the
firewall every inbound payload passes), a valid example, a tool-prompt fragment, and
precompiled converters for both directions. Nothing on the hot path reflects on
types again. This module is the public surface and the analysis (a dataclass's
fields, annotations and docstring to `XmlField`s); `_xmlify_spec` holds the compiled
`XmlSpec` (converters, XSD, example, prompt) and `_xmlify_types` the simple types.

Invariants:
- One global element per schema (the payload root); nested classes are named
  complex types, so a nested element is never a valid payload on its own.
- Content models are closed: an `xs:sequence` of the fields in declaration order,
  no `xs:any`, no mixed content, no attributes. Every string, list and number has
  an upper bound in the XSD.
- `from_element` trusts its input only because `validate` ran first; it does no
  checking of its own beyond what a validated tree makes impossible to fail.
- `to_bytes` emits exclusive C14N directly: the template form equals
  `c14n(to_element(obj))` byte for byte. Serialising refuses (`TypeError` for a value
  of the wrong type, `ValueError` for one the schema cannot carry) rather than emit
  a payload that would not validate.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
import weakref
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar, Union, overload
from urllib.parse import quote

from lxml import etree

from agentd._errors import Rejection, ValidationError
from agentd._xml import parse_untrusted
from agentd._xmlify_spec import OWN_OUTPUT_PARSER, XS, Occurs, XmlField, XmlSpec
from agentd._xmlify_types import ILLEGAL_XML_CHAR, MAX_NUMBER_DIGITS, SimpleType, simple_type

__all__ = [
    "DEFAULT_MAX_LIST_LENGTH",
    "DEFAULT_MAX_STRING_LENGTH",
    "ILLEGAL_XML_CHAR",
    "MAX_NUMBER_DIGITS",
    "XS",
    "MaxLen",
    "Occurs",
    "XmlField",
    "XmlName",
    "XmlSpec",
    "class_for",
    "example_of",
    "from_xml",
    "is_xmlified",
    "spec_of",
    "to_xml",
    "xmlify",
    "xsd_of",
]

DEFAULT_MAX_STRING_LENGTH = 16384
DEFAULT_MAX_LIST_LENGTH = 1000
DEFAULT_NAMESPACE_BASE = "https://xml-pipeline.org/ns/py"

_T = TypeVar("_T")

# An absolute URI (C14N refuses relative ones) with nothing that needs escaping in an
# attribute: libxml2's C14N writes namespace URIs unescaped. libxml2 then checks the
# rest of the URI syntax (see _check_namespace).
_NAMESPACE_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\x00-\x20\x7f<>\"&{}|\\^`]+")
_RESERVED_NAMESPACES = frozenset(
    {"http://www.w3.org/XML/1998/namespace", "http://www.w3.org/2000/xmlns/"}
)
_UNION_ORIGINS = (Union, types.UnionType)

_DOC_SECTION = re.compile(r"(Args|Arguments|Fields|Attributes|Parameters|Params):")
_DOC_ENTRY = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")


@dataclasses.dataclass(frozen=True, slots=True)
class MaxLen:
    """`Annotated[str, MaxLen(n)]`: this string field holds at most `n` characters."""

    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"MaxLen needs a positive int, got {self.n!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class XmlName:
    """`Annotated[int, XmlName("exit-code")]`: the field's element has this name, one a
    Python identifier cannot spell (a hyphen), instead of the field's own name."""

    name: str


# --- public functions ---------------------------------------------------------------


@overload
def xmlify(cls: type[_T], /) -> type[_T]: ...


@overload
def xmlify(
    cls: None = None,
    *,
    namespace: str | None = None,
    tag: str | None = None,
    max_string_length: int | None = None,
    max_list_length: int | None = None,
) -> Callable[[type[_T]], type[_T]]: ...


def xmlify(
    cls: type[Any] | None = None,
    *,
    namespace: str | None = None,
    tag: str | None = None,
    max_string_length: int | None = None,
    max_list_length: int | None = None,
) -> Any:
    """Make a dataclass a payload contract (apply above `@dataclass`).

    Sets `cls.__xmlify__` to its `XmlSpec` and returns `cls`. Raises `TypeError` for a
    field type the schema layer cannot carry, `ValueError` for bad arguments.
    """
    # Annotations of a class defined inside a function may name other local classes.
    caller_locals: Mapping[str, Any] = sys._getframe(1).f_locals

    def decorate(target: type[_T]) -> type[_T]:
        spec = _build_spec(
            target,
            namespace=namespace,
            tag=tag,
            max_string_length=_positive(
                "max_string_length", max_string_length, DEFAULT_MAX_STRING_LENGTH
            ),
            max_list_length=_positive("max_list_length", max_list_length, DEFAULT_MAX_LIST_LENGTH),
            localns=caller_locals,
        )
        target.__xmlify__ = spec  # type: ignore[attr-defined]
        _BY_TAG.setdefault(spec.clark, weakref.WeakSet()).add(target)
        return target

    return decorate if cls is None else decorate(cls)


# Every @xmlify class of this process by its element's Clark name, so a client can
# read an answer back into its class (`class_for`). Weak: a class that goes away
# (a test's local class) leaves.
_BY_TAG: dict[str, weakref.WeakSet[type]] = {}


def class_for(clark: str) -> type | None:
    """The @xmlify class for element `clark` ("{ns}tag") if exactly one is defined
    in this process, else None."""
    found = _BY_TAG.get(clark)
    if not found or len(found) != 1:
        return None
    return next(iter(found))


def spec_of(cls_or_obj: Any) -> XmlSpec:
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    spec = getattr(cls, "__xmlify__", None)
    # A subclass inherits the attribute but is not the class the spec describes.
    if not isinstance(spec, XmlSpec) or spec.cls is not cls:
        raise TypeError(f"{cls.__qualname__} is not an @xmlify class")
    return spec


def is_xmlified(cls_or_obj: Any) -> bool:
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    spec = getattr(cls, "__xmlify__", None)
    return isinstance(spec, XmlSpec) and spec.cls is cls


def to_xml(obj: Any) -> bytes:
    """The payload element of `obj` as exclusive C14N bytes."""
    return spec_of(obj).to_bytes(obj)


def from_xml(cls: type[_T], data: bytes) -> _T:
    """Parse, check the root, validate, build. Every failure is a `ValidationError`."""
    spec = spec_of(cls)
    if isinstance(data, str):
        data = data.encode()
    try:
        el = parse_untrusted(data)
    except Rejection as exc:
        raise ValidationError(exc.detail, code=exc.code) from None
    if el.tag != spec.clark:
        raise ValidationError(f"root element is {el.tag!r}, expected {spec.clark!r}")
    spec.validate(el)
    try:
        obj: _T = spec.from_element(el)
    except Exception as exc:  # e.g. the class's own __post_init__ refusing a value
        raise ValidationError(f"{cls.__qualname__}: {type(exc).__name__}: {exc}") from exc
    return obj


def xsd_of(cls: type) -> str:
    return spec_of(cls).xsd


def example_of(cls: type) -> bytes:
    return spec_of(cls).example


# --- analysis -----------------------------------------------------------------------


def _positive(what: str, value: int | None, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


def _check_ncname(what: str, name: str, error: type[Exception] = TypeError) -> None:
    try:
        etree.QName("urn:x", name)
    except ValueError:
        raise error(f"{what}: {name!r} is not a valid XML element name") from None


def _check_namespace(qual: str, namespace: str) -> None:
    usable = _NAMESPACE_RE.fullmatch(namespace) and namespace not in _RESERVED_NAMESPACES
    if usable:
        try:  # libxml2 refuses what it deems an invalid URI; ask it now, not per message
            etree.fromstring(f'<x xmlns="{namespace}"/>'.encode(), OWN_OUTPUT_PARSER)
        except etree.XMLSyntaxError:
            usable = False
    if not usable:
        raise ValueError(f"@xmlify {qual}: {namespace!r} is not a usable namespace URI")


def _build_spec(
    cls: type,
    *,
    namespace: str | None,
    tag: str | None,
    max_string_length: int,
    max_list_length: int,
    localns: Mapping[str, Any],
) -> XmlSpec:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"@xmlify applies to a dataclass (put it above @dataclass), got {cls!r}")
    qual = cls.__qualname__
    if tag is None:
        tag = cls.__name__.lower()
    _check_ncname(f"@xmlify {qual} tag", tag, ValueError)
    if namespace is None:
        namespace = f"{DEFAULT_NAMESPACE_BASE}/{quote(cls.__module__)}/{quote(tag)}/v1"
    _check_namespace(qual, namespace)
    try:
        hints = typing.get_type_hints(
            cls, localns=ChainMap({cls.__name__: cls}, dict(localns)), include_extras=True
        )
    except Exception as exc:  # NameError for an unresolvable forward reference, mostly
        raise TypeError(f"@xmlify {qual}: cannot resolve field annotations: {exc}") from None

    description, field_docs = _docstring_parts(cls)
    fields: list[XmlField] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue  # derived in __post_init__; not part of the payload
        where = f"{qual}.{f.name}"
        _check_ncname(f"@xmlify {where}", f.name)
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        element = _element_name(hints[f.name], f.name)
        _check_ncname(f"@xmlify {where}", element)
        analysed = _analyse_field(
            cls,
            where,
            f.name,
            hints[f.name],
            has_default=has_default,
            default=f.default,
            doc=field_docs.get(f.name, ""),
            max_string_length=max_string_length,
            max_list_length=max_list_length,
        )
        fields.append(dataclasses.replace(analysed, tag=element))
    names = {f.name for f in fields}
    for p in inspect.signature(cls).parameters.values():
        if p.name not in names and p.default is inspect.Parameter.empty:
            raise TypeError(
                f"@xmlify {qual}: __init__ parameter {p.name!r} (an InitVar?) has no "
                "field to come from"
            )
    return XmlSpec(cls, namespace, tag, description, tuple(fields))


def _element_name(hint: Any, name: str) -> str:
    """The field's element name: an `XmlName` in its outermost `Annotated`, else its
    own name."""
    if typing.get_origin(hint) is Annotated:
        for meta in hint.__metadata__:
            if isinstance(meta, XmlName):
                return meta.name
    return name


def _strip_annotated(tp: Any, docs: list[str], maxlen: list[MaxLen]) -> Any:
    while typing.get_origin(tp) is Annotated:
        for meta in tp.__metadata__:
            if isinstance(meta, str):
                docs.append(_clean_doc(meta))
            elif isinstance(meta, MaxLen):
                maxlen.append(meta)
        tp = tp.__origin__
    while hasattr(tp, "__supertype__"):  # typing.NewType
        tp = tp.__supertype__
    return tp


def _analyse_field(
    cls: type,
    where: str,
    name: str,
    hint: Any,
    *,
    has_default: bool,
    default: Any,
    doc: str,
    max_string_length: int,
    max_list_length: int,
) -> XmlField:
    docs: list[str] = []
    maxlen: list[MaxLen] = []
    tp = _strip_annotated(hint, docs, maxlen)
    occurs = Occurs.REQUIRED
    if typing.get_origin(tp) in _UNION_ORIGINS:
        args = typing.get_args(tp)
        inner = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(inner) != 1:
            raise TypeError(f"@xmlify {where}: unsupported type {hint!r} (only `X | None`)")
        occurs = Occurs.OPTIONAL
        tp = _strip_annotated(inner[0], docs, maxlen)
    if typing.get_origin(tp) is list:
        if occurs is Occurs.OPTIONAL:
            raise TypeError(
                f"@xmlify {where}: unsupported type {hint!r}: `list[X] | None` is ambiguous "
                "(an empty list is already no element); use list[X]"
            )
        (item,) = typing.get_args(tp) or (None,)
        occurs = Occurs.REPEATED
        tp = _strip_annotated(item, docs, maxlen)
        if typing.get_origin(tp) in (*_UNION_ORIGINS, list):
            raise TypeError(
                f"@xmlify {where}: unsupported type {hint!r} (list items must be plain)"
            )
    if doc and not docs:
        docs.append(doc)
    if tp is cls:
        raise TypeError(f"@xmlify {where}: recursive payload types are not supported")
    if maxlen and tp is not str:
        raise TypeError(f"@xmlify {where}: MaxLen applies to str fields only, not {tp!r}")
    has_default = has_default and occurs is Occurs.REQUIRED
    nested: XmlSpec | None = None
    simple: SimpleType | None = None
    default_text = ""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not is_xmlified(tp):
            raise TypeError(
                f"@xmlify {where}: nested dataclass {tp.__qualname__} must be @xmlify too"
            )
        nested = spec_of(tp)
    else:
        simple = simple_type(where, hint, tp, maxlen[-1].n if maxlen else max_string_length)
        if has_default and default is not dataclasses.MISSING:
            try:
                default_text = simple.fmt(default)
            except (TypeError, ValueError):
                raise TypeError(
                    f"@xmlify {where}: default {default!r} does not fit the field"
                ) from None
    return XmlField(
        name=name,
        occurs=occurs,
        doc=" ".join(d for d in docs if d),
        has_default=has_default,
        max_occurs=max_list_length if occurs is Occurs.REPEATED else 1,
        default_text=default_text,
        simple=simple,
        nested=nested,
    )


# --- docstrings -----------------------------------------------------------------------


def _clean_doc(text: str) -> str:
    return ILLEGAL_XML_CHAR.sub("", " ".join(text.split()))


def _docstring_parts(cls: type) -> tuple[str, dict[str, str]]:
    """The first paragraph of the class docstring, and `name: text` entries of an
    `Args:`/`Fields:`/`Attributes:` section (best effort, Google style)."""
    doc = cls.__dict__.get("__doc__")
    if not doc or _is_generated_doc(cls, doc):
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    first: list[str] = []
    for line in lines:
        if not line.strip() or _DOC_SECTION.fullmatch(line.strip()):
            break
        first.append(line)
    field_docs: dict[str, str] = {}
    in_section, current, entry_indent = False, "", -1
    for line in lines:
        stripped = line.strip()
        if _DOC_SECTION.fullmatch(stripped):
            in_section, current, entry_indent = True, "", -1
            continue
        if not in_section:
            continue
        if not stripped:
            in_section = False
            continue
        indent = len(line) - len(line.lstrip())
        entry = _DOC_ENTRY.fullmatch(stripped)
        if entry and (entry_indent < 0 or indent <= entry_indent):
            current, entry_indent = entry.group(1), indent
            field_docs[current] = entry.group(2)
        elif current and indent > entry_indent:
            field_docs[current] += " " + stripped
    return _clean_doc(" ".join(first)), {k: _clean_doc(v) for k, v in field_docs.items()}


def _is_generated_doc(cls: type, doc: str) -> bool:
    # @dataclass writes "Name(a: int, b: int)" into a class that has no docstring.
    try:
        generated = cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")
    except (TypeError, ValueError):
        return False
    return doc == generated
