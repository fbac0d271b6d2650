"""The schema layer: `@xmlify` turns a dataclass into a payload contract.

Decoration analyses the class once and keeps, in an `XmlSpec`: the XSD (the
firewall every inbound payload passes), a valid example, a tool-prompt fragment, and
precompiled converters for both directions. Nothing on the hot path reflects on
types again.

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
from datetime import datetime, timedelta
from decimal import Decimal
from enum import Enum
from operator import attrgetter
from typing import Annotated, Any, TypeVar, Union, overload
from urllib.parse import quote

from lxml import etree

from agentd._errors import Rejection, ValidationError
from agentd._xml import escape_text, parse_untrusted

__all__ = [
    "DEFAULT_MAX_LIST_LENGTH",
    "DEFAULT_MAX_STRING_LENGTH",
    "MAX_NUMBER_DIGITS",
    "MaxLen",
    "Occurs",
    "XmlField",
    "XmlSpec",
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
# Digits (plus '.') an xs:integer or xs:decimal may carry, on input and output. Keeps
# int() far from CPython's 4300-digit limit and a Decimal from formatting to megabytes.
MAX_NUMBER_DIGITS = 1000
DEFAULT_NAMESPACE_BASE = "https://xml-pipeline.org/ns/py"

XS = "http://www.w3.org/2001/XMLSchema"
_XS = "{" + XS + "}"

_T = TypeVar("_T")

# Characters XML 1.0 cannot carry at all, not even as a character reference.
ILLEGAL_XML_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# An absolute URI (C14N refuses relative ones) with nothing that needs escaping in an
# attribute: libxml2's C14N writes namespace URIs unescaped. libxml2 then checks the
# rest of the URI syntax (see _check_namespace).
_NAMESPACE_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\x00-\x20\x7f<>\"&{}|\\^`]+")
_RESERVED_NAMESPACES = frozenset(
    {"http://www.w3.org/XML/1998/namespace", "http://www.w3.org/2000/xmlns/"}
)

_INT_PATTERN = rf"[+\-]?[0-9]{{1,{MAX_NUMBER_DIGITS}}}"
_DECIMAL_PATTERN = rf"[+\-]?[0-9.]{{1,{MAX_NUMBER_DIGITS}}}"
# Timezone required; year 0001-9999, hour 00-23 and at most 9 fractional digits
# (sub-microsecond digits are truncated): exactly what `datetime` can hold.
_DATETIME_PATTERN = (
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}T([01][0-9]|2[0-3]):[0-9]{2}:[0-9]{2}"
    r"(\.[0-9]{1,9})?(Z|[+\-][0-9]{2}:[0-9]{2})"
)
_INT_BOUND = 10**MAX_NUMBER_DIGITS
_MAX_UTC_OFFSET = timedelta(hours=14)
_FLOAT_SPECIAL = {"inf": "INF", "-inf": "-INF", "nan": "NaN"}
_XSD_TRUE = frozenset({"true", "1"})
_UNION_ORIGINS = (Union, types.UnionType)

_DOC_SECTION = re.compile(r"(Args|Arguments|Fields|Attributes|Parameters|Params):")
_DOC_ENTRY = re.compile(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")

# Parses only bytes this module produced (to_element); never untrusted input.
_OWN_OUTPUT_PARSER = etree.XMLParser(
    resolve_entities=False, no_network=True, load_dtd=False, remove_blank_text=False
)


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


class Occurs(Enum):
    REQUIRED = "required"
    OPTIONAL = "optional"  # `X | None`: None <-> element absent
    REPEATED = "repeated"  # `list[X]`: zero or more elements, bounded


@dataclasses.dataclass(frozen=True, slots=True)
class _Simple:
    """A simple (text-only) XSD type with its two precompiled converters."""

    label: str  # for the tool prompt
    base: str  # XSD built-in the element's type restricts
    facets: tuple[tuple[str, str], ...]
    fmt: Callable[[Any], str]  # Python value -> C14N-escaped text; raises on misfit
    read: Callable[[Any], Any]  # validated element -> Python value
    sample: Any  # a value for the example payload


@dataclasses.dataclass(frozen=True, slots=True)
class XmlField:
    """One field of a payload class, as the schema sees it."""

    name: str
    occurs: Occurs
    doc: str
    has_default: bool  # a REQUIRED field with a default may be omitted on input
    max_occurs: int
    default_text: str  # the default as element text, for the prompt ("" if none)
    simple: _Simple | None = None
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
            self._schema = etree.XMLSchema(etree.fromstring(self.xsd.encode(), _OWN_OUTPUT_PARSER))
        return self._schema

    def to_bytes(self, obj: Any) -> bytes:
        if obj.__class__ is not self.cls and not isinstance(obj, self.cls):
            raise TypeError(f"expected {self.cls.__qualname__}, got {type(obj).__qualname__}")
        return (self._root_open + self._write_content(obj) + self._root_close).encode()

    def to_element(self, obj: Any) -> etree._Element:
        return etree.fromstring(self.to_bytes(obj), _OWN_OUTPUT_PARSER)

    def from_element(self, el: etree._Element) -> Any:
        """Build the dataclass from `el`, which `validate` has already accepted."""
        return self._read_root(el)

    def from_own_bytes(self, data: bytes) -> Any:
        """Build the dataclass from bytes `to_bytes` produced, or the C14N of an
        element that `validate` accepted (in this process, or in the daemon that hands
        them to its worker): no hostile-input checks, no validation. Never for bytes
        from anyone else."""
        return self._read_root(etree.fromstring(data, _OWN_OUTPUT_PARSER))

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
            etree.fromstring(f'<x xmlns="{namespace}"/>'.encode(), _OWN_OUTPUT_PARSER)
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
    simple: _Simple | None = None
    default_text = ""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not is_xmlified(tp):
            raise TypeError(
                f"@xmlify {where}: nested dataclass {tp.__qualname__} must be @xmlify too"
            )
        nested = spec_of(tp)
    else:
        simple = _simple_type(where, hint, tp, maxlen[-1].n if maxlen else max_string_length)
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


def _simple_type(where: str, hint: Any, tp: Any, max_length: int) -> _Simple:
    if tp is str:
        return _str_type(where, max_length)
    if tp is bool:
        return _Simple(
            "boolean (true or false)", "xs:boolean", (), _bool_fmt(where), _read_bool, True
        )
    if tp is int:
        return _Simple(
            "integer", "xs:integer", (("pattern", _INT_PATTERN),), _int_fmt(where), _read_int, 42
        )
    if tp is float:
        return _Simple(
            "number (xs:double; INF, -INF and NaN allowed)",
            "xs:double",
            (),
            _float_fmt(where),
            _read_float,
            1.5,
        )
    if tp is Decimal:
        return _Simple(
            "decimal number (plain notation, no exponent)",
            "xs:decimal",
            (("pattern", _DECIMAL_PATTERN),),
            _decimal_fmt(where),
            _read_decimal,
            Decimal("9.99"),
        )
    if tp is datetime:
        return _Simple(
            "date-time with timezone (e.g. 2026-01-01T12:00:00Z or ...+02:00)",
            "xs:dateTime",
            (("pattern", _DATETIME_PATTERN),),
            _datetime_fmt(where),
            _read_datetime,
            datetime.fromisoformat("2026-01-01T12:00:00+00:00"),
        )
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum_type(where, tp)
    raise TypeError(f"@xmlify {where}: unsupported type {hint!r}")


# --- converters: one closure per field, built once -----------------------------------


def _str_type(where: str, max_length: int) -> _Simple:
    def fmt(v: Any) -> str:
        if v.__class__ is not str:
            if not isinstance(v, str):
                raise TypeError(f"{where}: expected str, got {type(v).__qualname__}")
            v = str.__str__(v)  # str subclass, e.g. a str-valued enum member
        if len(v) > max_length:
            raise ValueError(f"{where}: string of {len(v)} characters exceeds {max_length}")
        bad = ILLEGAL_XML_CHAR.search(v)
        if bad is not None:
            raise ValueError(
                f"{where}: character {bad.group()!r} at index {bad.start()} "
                "cannot be represented in XML"
            )
        return escape_text(v)

    return _Simple(
        f"string (at most {max_length} characters)",
        "xs:string",
        (("maxLength", str(max_length)),),
        fmt,
        _read_str,
        "text"[:max_length],
    )


def _read_str(el: Any) -> str:
    return el.text or ""


def _bool_fmt(where: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        if v is True:
            return "true"
        if v is False:
            return "false"
        raise TypeError(f"{where}: expected bool, got {type(v).__qualname__}")

    return fmt


def _read_bool(el: Any) -> bool:
    return el.text.strip() in _XSD_TRUE


def _int_fmt(where: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        if v.__class__ is int and -_INT_BOUND < v < _INT_BOUND:
            return str(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{where}: expected int, got {type(v).__qualname__}")
        if not -_INT_BOUND < v < _INT_BOUND:
            raise ValueError(f"{where}: integer has more than {MAX_NUMBER_DIGITS} digits")
        return int.__repr__(v)  # an int subclass (IntEnum, ...) as plain digits

    return fmt


def _read_int(el: Any) -> int:
    return int(el.text)


def _float_fmt(where: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        if v.__class__ is not float:
            if isinstance(v, bool) or not isinstance(v, (float, int)):
                raise TypeError(f"{where}: expected float, got {type(v).__qualname__}")
            try:
                v = float(v)
            except OverflowError:
                raise ValueError(f"{where}: {v!r} is out of range for a double") from None
        text = repr(v)
        return _FLOAT_SPECIAL.get(text, text)

    return fmt


def _read_float(el: Any) -> float:
    return float(el.text)  # float() reads INF, -INF and NaN too


def _decimal_fmt(where: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        if not isinstance(v, Decimal):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{where}: expected Decimal, got {type(v).__qualname__}")
            v = Decimal(v)
        exponent = v.as_tuple().exponent
        if not isinstance(exponent, int):
            raise ValueError(f"{where}: {v!r} has no xs:decimal representation")
        if abs(exponent) > MAX_NUMBER_DIGITS:
            raise ValueError(f"{where}: {v!r} has more than {MAX_NUMBER_DIGITS} digits")
        text = format(v, "f")  # plain notation: xs:decimal has no exponent
        if len(text) - text.startswith("-") > MAX_NUMBER_DIGITS:
            raise ValueError(f"{where}: {v!r} has more than {MAX_NUMBER_DIGITS} digits")
        return text

    return fmt


def _read_decimal(el: Any) -> Decimal:
    return Decimal(el.text)  # Decimal() ignores surrounding whitespace


def _datetime_fmt(where: str) -> Callable[[Any], str]:
    def fmt(v: Any) -> str:
        if not isinstance(v, datetime):
            raise TypeError(f"{where}: expected datetime, got {type(v).__qualname__}")
        offset = v.utcoffset()
        if offset is None:
            raise ValueError(f"{where}: naive datetime {v!r}; a timezone is required")
        if offset.seconds % 60 or offset.microseconds or abs(offset) > _MAX_UTC_OFFSET:
            raise ValueError(f"{where}: UTC offset {offset} has no xs:dateTime representation")
        text = v.isoformat()
        return text[:-6] + "Z" if text.endswith("+00:00") else text

    return fmt


def _read_datetime(el: Any) -> datetime:
    return datetime.fromisoformat(el.text.strip())


def _enum_type(where: str, tp: type[Enum]) -> _Simple:
    members = list(tp)
    if not members:
        raise TypeError(f"@xmlify {where}: enum {tp.__qualname__} has no members")
    to_text: dict[Any, str] = {}
    from_text: dict[str, Any] = {}
    for m in members:
        value = m.value
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TypeError(
                f"@xmlify {where}: enum {tp.__qualname__} value {value!r} is not str or int"
            )
        text = str.__str__(value) if isinstance(value, str) else int.__repr__(value)
        if text in from_text or ILLEGAL_XML_CHAR.search(text):
            raise TypeError(f"@xmlify {where}: enum {tp.__qualname__} value {text!r} is unusable")
        to_text[m] = escape_text(text)
        from_text[text] = m

    def fmt(v: Any) -> str:
        try:
            return to_text[v]
        except (KeyError, TypeError):
            raise TypeError(f"{where}: {v!r} is not a member of {tp.__qualname__}") from None

    def read(el: Any) -> Any:
        return from_text[el.text or ""]

    return _Simple(
        "one of: " + ", ".join(from_text),
        "xs:string",
        tuple(("enumeration", t) for t in from_text),
        fmt,
        read,
        members[0],
    )


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
