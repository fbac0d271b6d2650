"""The simple (text-only) types of the schema layer: for each Python scalar a payload
field may hold (str, bool, int, float, Decimal, datetime, an Enum), its XSD base type
and facets, and two converters built once per field.

Invariants:
- `fmt` writes C14N-escaped text the type's XSD accepts, or raises (`TypeError` for a
  value of the wrong type, `ValueError` for one the schema cannot carry).
- `read` trusts its element: the XSD has already bounded and checked the text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal
from enum import Enum
from typing import Any

from agentd._xml import escape_text

__all__ = ["ILLEGAL_XML_CHAR", "MAX_NUMBER_DIGITS", "SimpleType", "simple_type"]

# Digits (plus '.') an xs:integer or xs:decimal may carry, on input and output. Keeps
# int() far from CPython's 4300-digit limit and a Decimal from formatting to megabytes.
MAX_NUMBER_DIGITS = 1000

# Characters XML 1.0 cannot carry at all, not even as a character reference.
ILLEGAL_XML_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

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


@dataclasses.dataclass(frozen=True, slots=True)
class SimpleType:
    """A simple (text-only) XSD type with its two precompiled converters."""

    label: str  # for the tool prompt
    base: str  # XSD built-in the element's type restricts
    facets: tuple[tuple[str, str], ...]
    fmt: Callable[[Any], str]  # Python value -> C14N-escaped text; raises on misfit
    read: Callable[[Any], Any]  # validated element -> Python value
    sample: Any  # a value for the example payload


def simple_type(where: str, hint: Any, tp: Any, max_length: int) -> SimpleType:
    if tp is str:
        return _str_type(where, max_length)
    if tp is bool:
        return SimpleType(
            "boolean (true or false)", "xs:boolean", (), _bool_fmt(where), _read_bool, True
        )
    if tp is int:
        return SimpleType(
            "integer", "xs:integer", (("pattern", _INT_PATTERN),), _int_fmt(where), _read_int, 42
        )
    if tp is float:
        return SimpleType(
            "number (xs:double; INF, -INF and NaN allowed)",
            "xs:double",
            (),
            _float_fmt(where),
            _read_float,
            1.5,
        )
    if tp is Decimal:
        return SimpleType(
            "decimal number (plain notation, no exponent)",
            "xs:decimal",
            (("pattern", _DECIMAL_PATTERN),),
            _decimal_fmt(where),
            _read_decimal,
            Decimal("9.99"),
        )
    if tp is datetime:
        return SimpleType(
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


def _str_type(where: str, max_length: int) -> SimpleType:
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

    return SimpleType(
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


def _enum_type(where: str, tp: type[Enum]) -> SimpleType:
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

    return SimpleType(
        "one of: " + ", ".join(from_text),
        "xs:string",
        tuple(("enumeration", t) for t in from_text),
        fmt,
        read,
        members[0],
    )
