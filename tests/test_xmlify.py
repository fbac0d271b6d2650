"""The schema layer (`@xmlify`, docs/schema-layer.md).

The XSD is the firewall; these tests pin what it lets through and what it refuses,
and that what we emit is C14N, validates, and round-trips."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Optional

import pytest
import xmlschema
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from agentd._errors import HuhCode, ValidationError
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import (
    DEFAULT_MAX_LIST_LENGTH,
    DEFAULT_MAX_STRING_LENGTH,
    MAX_NUMBER_DIGITS,
    MaxLen,
    XmlSpec,
    example_of,
    from_xml,
    is_xmlified,
    spec_of,
    to_xml,
    xmlify,
    xsd_of,
)

NS = "https://xml-pipeline.org/ns/test/everything/v1"


class Color(Enum):
    RED = "red"
    GREEN = "green"
    AMP = "a&b <c>"


class Level(Enum):
    LOW = 1
    HIGH = 10


@xmlify
@dataclass
class Point:
    """A point in the plane.

    Fields:
        x: Horizontal coordinate.
        y: Vertical coordinate,
            measured upwards.
    """

    x: int
    y: int


@xmlify(namespace=NS, tag="everything")
@dataclass
class Everything:
    """One field of every supported type."""

    text: str
    number: int
    real: float
    flag: bool
    money: Decimal
    when: datetime
    color: Color
    level: Level
    point: Point
    maybe_text: str | None
    maybe_number: Optional[int]  # noqa: UP045 -- the typing spelling must work too
    maybe_point: Point | None
    words: list[str]
    points: list[Point]
    colors: list[Color]


@xmlify(namespace="https://xml-pipeline.org/ns/calculator/add/v1")
@dataclass
class Add:
    """Adds two integers.

    The result comes back as a sum.
    """

    a: Annotated[int, "The first addend."]
    b: Annotated[int, "The second addend."]


@xmlify(max_string_length=8, max_list_length=3)
@dataclass
class Bounded:
    name: str
    code: Annotated[str, MaxLen(2), "A two-letter code."]
    tags: list[str] = field(default_factory=list)


@xmlify
@dataclass
class Measurement:
    value: float
    samples: list[float]


@xmlify
@dataclass
class Stamp:
    at: datetime


@xmlify
@dataclass
class Search:
    """Searches the catalogue.

    Args:
        query: What to look for.
        limit (int): How many results at most.
    """

    query: str
    limit: int = 10


ALL_CLASSES = [Point, Everything, Add, Bounded, Measurement, Stamp, Search]


# --- strategies --------------------------------------------------------------------

xml_chars = st.one_of(
    st.sampled_from("&<>\"'\r\n\t ]]>"),
    st.characters(min_codepoint=0x20, codec="utf-8").filter(lambda c: c not in "\ufffe\uffff"),
)
xml_text = st.text(xml_chars, max_size=30)
big_ints = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**MAX_NUMBER_DIGITS) + 1, max_value=10**MAX_NUMBER_DIGITS - 1),
)
offsets = st.integers(min_value=-14 * 60, max_value=14 * 60).map(
    lambda m: timezone(timedelta(minutes=m))
)
aware_datetimes = st.datetimes(timezones=st.one_of(st.just(UTC), offsets))


def _plain_fits(d: Decimal) -> bool:
    return len(format(d, "f").lstrip("-")) <= MAX_NUMBER_DIGITS


decimals = st.decimals(allow_nan=False, allow_infinity=False).filter(_plain_fits)
points = st.builds(Point, x=big_ints, y=big_ints)

everything = st.builds(
    Everything,
    text=xml_text,
    number=big_ints,
    real=st.floats(allow_nan=False),
    flag=st.booleans(),
    money=decimals,
    when=aware_datetimes,
    color=st.sampled_from(Color),
    level=st.sampled_from(Level),
    point=points,
    maybe_text=st.none() | xml_text,
    maybe_number=st.none() | big_ints,
    maybe_point=st.none() | points,
    words=st.lists(xml_text, max_size=3),
    points=st.lists(points, max_size=3),
    colors=st.lists(st.sampled_from(Color), max_size=3),
)


def sample_everything(**changes: Any) -> Everything:
    values: dict[str, Any] = {
        "text": "hello",
        "number": 7,
        "real": 2.5,
        "flag": True,
        "money": Decimal("12.30"),
        "when": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "color": Color.GREEN,
        "level": Level.HIGH,
        "point": Point(1, 2),
        "maybe_text": None,
        "maybe_number": 3,
        "maybe_point": None,
        "words": ["a", "b"],
        "points": [Point(3, 4)],
        "colors": [],
    }
    values.update(changes)
    return Everything(**values)


def assert_payload_rejected(cls: type, data: bytes, match: str = "") -> ValidationError:
    with pytest.raises(ValidationError) as info:
        from_xml(cls, data)
    assert info.value.code is HuhCode.INVALID_PAYLOAD
    assert re.search(match, info.value.detail), info.value.detail
    return info.value


def add_xml(body: str, ns: str = spec_of(Add).namespace) -> bytes:
    return f'<add xmlns="{ns}">{body}</add>'.encode()


# --- round trip ------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(everything)
def test_every_field_type_round_trips(obj: Everything) -> None:
    spec = spec_of(Everything)
    data = spec.to_bytes(obj)
    el = parse_untrusted(data)
    spec.validate(el)
    assert spec.from_element(el) == obj
    assert from_xml(Everything, data) == obj
    assert spec.from_own_bytes(data) == obj  # what an isolation worker reads


@settings(max_examples=150, deadline=None)
@given(everything)
def test_to_bytes_is_the_exclusive_c14n_of_to_element(obj: Everything) -> None:
    spec = spec_of(Everything)
    assert spec.to_bytes(obj) == c14n(spec.to_element(obj)) == to_xml(obj)


def _xmlschema_reads(d: Decimal) -> bool:
    # xmlschema (the cross-check, not the hot path) reads xs:decimal through a float
    # and refuses values past the float range (about 308 digits); libxml2 does not.
    return abs(d.adjusted()) < 300


@settings(max_examples=15, deadline=None)
@given(everything.filter(lambda o: _xmlschema_reads(o.money)))
def test_emitted_payloads_also_validate_with_xmlschema(obj: Everything) -> None:
    assert _xmlschema(Everything).is_valid(to_xml(obj).decode())


@settings(max_examples=100, deadline=None)
@given(st.floats(), st.lists(st.floats(), max_size=4))
def test_floats_round_trip_exactly_including_inf_nan_and_negative_zero(
    value: float, samples: list[float]
) -> None:
    back = from_xml(Measurement, to_xml(Measurement(value, samples)))
    for got, want in zip([back.value, *back.samples], [value, *samples], strict=True):
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def test_special_floats_use_the_xsd_spelling() -> None:
    data = to_xml(Measurement(float("inf"), [float("-inf"), float("nan")]))
    assert b"<value>INF</value><samples>-INF</samples><samples>NaN</samples>" in data


@settings(max_examples=100, deadline=None)
@given(aware_datetimes)
def test_datetimes_keep_their_instant_and_offset(when: datetime) -> None:
    back = from_xml(Stamp, to_xml(Stamp(when))).at
    assert back == when and back.utcoffset() == when.utcoffset()


def test_utc_is_written_with_z() -> None:
    when = datetime(2026, 11, 22, 6, 0, tzinfo=UTC)
    assert b"<at>2026-11-22T06:00:00Z</at>" in to_xml(Stamp(when))


def test_decimals_are_written_without_exponent() -> None:
    data = to_xml(sample_everything(money=Decimal("1E+5")))
    assert b"<money>100000</money>" in data
    data = to_xml(sample_everything(money=Decimal("-1E-7")))
    assert b"<money>-0.0000001</money>" in data


def test_optional_none_is_an_absent_element() -> None:
    data = to_xml(sample_everything(maybe_text=None, maybe_number=None))
    assert b"maybe_text" not in data and b"maybe_number" not in data
    assert from_xml(Everything, data).maybe_number is None


def test_fields_are_children_in_declaration_order() -> None:
    obj = sample_everything(maybe_text="x", maybe_point=Point(0, 0), colors=[Color.RED])
    el = spec_of(Everything).to_element(obj)
    names = [etree.QName(child).localname for child in el]
    declared = [f.name for f in dataclasses.fields(Everything)]
    assert [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n] == declared
    assert {etree.QName(child).namespace for child in el.iter()} == {NS}


def test_nested_elements_are_named_after_the_field_in_the_outer_namespace() -> None:
    data = to_xml(sample_everything())
    assert b"<point><x>1</x><y>2</y></point><maybe_number>" in data
    assert spec_of(Point).namespace not in data.decode()


# --- input forms the schema accepts ----------------------------------------------------


def test_insignificant_whitespace_and_prefixes_are_accepted() -> None:
    data = (
        f'<p:add xmlns:p="{spec_of(Add).namespace}">\n  <p:a> +2 </p:a>\n'
        "  <!-- a comment -->\n  <p:b>3</p:b>\n</p:add>"
    ).encode()
    assert from_xml(Add, data) == Add(2, 3)


def test_booleans_accept_one_and_zero_and_emit_true_false() -> None:
    spec = spec_of(Everything)
    data = to_xml(sample_everything(flag=False))
    assert b"<flag>false</flag>" in data
    for text, want in [("1", True), ("0", False), (" true ", True), ("false", False)]:
        changed = data.replace(b"<flag>false</flag>", f"<flag>{text}</flag>".encode())
        assert from_xml(Everything, changed).flag is want
    assert spec.from_element(spec.to_element(sample_everything(flag=True))).flag is True


def test_sub_microsecond_digits_are_truncated() -> None:
    ns = spec_of(Stamp).namespace
    data = f'<stamp xmlns="{ns}"><at>2026-01-01T00:00:00.123456789+01:00</at></stamp>'
    at = from_xml(Stamp, data.encode()).at
    assert at.microsecond == 123456 and at.utcoffset() == timedelta(hours=1)


def test_a_field_with_a_default_may_be_omitted() -> None:
    ns = spec_of(Search).namespace
    got = from_xml(Search, f'<search xmlns="{ns}"><query>cats</query></search>'.encode())
    assert got == Search("cats", 10)
    assert b"<limit>10</limit>" in to_xml(got)


def test_payload_validates_in_place_inside_an_envelope() -> None:
    env = (
        b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>alice</from>'
        b"</meta>" + to_xml(Add(1, 2)) + b"</message>"
    )
    payload = parse_untrusted(env)[1]
    spec_of(Add).validate(payload)
    assert spec_of(Add).from_element(payload) == Add(1, 2)


# --- what the schema rejects ----------------------------------------------------------


def test_unknown_element_is_rejected() -> None:
    assert_payload_rejected(Add, add_xml("<a>1</a><b>2</b><c>3</c>"), "not expected")


def test_wrong_order_is_rejected() -> None:
    assert_payload_rejected(Add, add_xml("<b>2</b><a>1</a>"), "not expected")


def test_missing_required_element_is_rejected() -> None:
    assert_payload_rejected(Add, add_xml("<a>1</a>"), "Missing child element")


def test_repeated_single_element_is_rejected() -> None:
    assert_payload_rejected(Add, add_xml("<a>1</a><a>1</a><b>2</b>"))


def test_string_over_max_length_is_rejected() -> None:
    ns = spec_of(Bounded).namespace
    ok = f'<bounded xmlns="{ns}"><name>12345678</name><code>ab</code></bounded>'
    assert from_xml(Bounded, ok.encode()) == Bounded("12345678", "ab")
    too_long = ok.replace("12345678", "123456789")
    assert_payload_rejected(Bounded, too_long.encode(), "maxLength")
    assert_payload_rejected(Bounded, ok.replace(">ab<", ">abc<").encode(), "maxLength")


def test_default_string_bound_is_in_the_schema() -> None:
    assert f'<xs:maxLength value="{DEFAULT_MAX_STRING_LENGTH}"/>' in xsd_of(Everything)
    assert f'maxOccurs="{DEFAULT_MAX_LIST_LENGTH}"' in xsd_of(Everything)


def test_list_over_max_length_is_rejected() -> None:
    ns = spec_of(Bounded).namespace
    tags = "".join(f"<tags>t{i}</tags>" for i in range(4))
    data = f'<bounded xmlns="{ns}"><name>n</name><code>ab</code>{tags}</bounded>'
    assert_payload_rejected(Bounded, data.encode(), "not expected")


def test_non_integer_in_int_field_is_rejected() -> None:
    for bad in ["1.5", "abc", "", "1e3", "1_000", "\u0661"]:
        assert_payload_rejected(Add, add_xml(f"<a>{bad}</a><b>2</b>"))


def test_integer_with_too_many_digits_is_rejected() -> None:
    digits = "9" * (MAX_NUMBER_DIGITS + 1)
    assert_payload_rejected(Add, add_xml(f"<a>{digits}</a><b>2</b>"), "pattern")
    padded = "0" * MAX_NUMBER_DIGITS + "1"  # leading zeros count: int() cost is lexical
    assert_payload_rejected(Add, add_xml(f"<a>{padded}</a><b>2</b>"), "pattern")


def test_element_in_wrong_namespace_is_rejected() -> None:
    ns = spec_of(Add).namespace
    data = f'<add xmlns="{ns}"><a>1</a><b xmlns="urn:other">2</b></add>'.encode()
    assert_payload_rejected(Add, data)
    data = f'<add xmlns="{ns}"><a xmlns="">1</a><b>2</b></add>'.encode()
    assert_payload_rejected(Add, data)


def test_attributes_are_rejected() -> None:
    assert_payload_rejected(Add, add_xml('<a x="1">1</a><b>2</b>'), "attribute")
    ns = spec_of(Add).namespace
    assert_payload_rejected(Add, f'<add xmlns="{ns}" id="1"><a>1</a><b>2</b></add>'.encode())


def test_xsi_type_and_nil_are_rejected() -> None:
    xsi = 'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"'
    xs = 'xmlns:xs="http://www.w3.org/2001/XMLSchema"'
    for t in ["xs:long", "xs:string", "xs:anyType"]:
        assert_payload_rejected(Add, add_xml(f'<a {xsi} {xs} xsi:type="{t}">1</a><b>2</b>'))
    assert_payload_rejected(Add, add_xml(f'<a {xsi} xsi:nil="true"/><b>2</b>'))


def test_mixed_content_is_rejected() -> None:
    assert_payload_rejected(Add, add_xml("<a>1</a>text<b>2</b>"))


def test_datetime_without_timezone_is_rejected() -> None:
    ns = spec_of(Stamp).namespace
    for bad in [
        "2026-01-01T00:00:00",
        "2026-01-01T24:00:00Z",
        "-2026-01-01T00:00:00Z",
        "12026-01-01T00:00:00Z",
        "2026-01-01T00:00:00.1234567891Z",
        "2026-02-30T00:00:00Z",
    ]:
        data = f'<stamp xmlns="{ns}"><at>{bad}</at></stamp>'.encode()
        assert_payload_rejected(Stamp, data)


def test_decimal_with_exponent_is_rejected() -> None:
    good = to_xml(sample_everything())
    assert_payload_rejected(Everything, good.replace(b"<money>12.30<", b"<money>1E3<"))


def test_enum_non_member_is_rejected() -> None:
    good = to_xml(sample_everything())
    assert_payload_rejected(Everything, good.replace(b"<color>green<", b"<color>blue<"))
    assert_payload_rejected(Everything, good.replace(b"<color>green<", b"<color>GREEN<"))
    assert_payload_rejected(Everything, good.replace(b"<level>10<", b"<level>2<"))


def test_a_nested_type_is_not_a_payload_on_its_own() -> None:
    point = parse_untrusted(f'<point xmlns="{NS}"><x>1</x><y>2</y></point>'.encode())
    with pytest.raises(ValidationError):
        spec_of(Everything).validate(point)


def test_from_xml_rejects_malformed_xml() -> None:
    with pytest.raises(ValidationError) as info:
        from_xml(Add, add_xml("<a>1</a><b>2</b")[:-3])
    assert info.value.code is HuhCode.MALFORMED


def test_from_xml_rejects_doctype() -> None:
    data = b'<!DOCTYPE add [<!ENTITY x "1">]>' + add_xml("<a>&x;</a><b>2</b>")
    with pytest.raises(ValidationError) as info:
        from_xml(Add, data)
    assert info.value.code is HuhCode.MALFORMED


def test_from_xml_rejects_wrong_root() -> None:
    with pytest.raises(ValidationError, match="root element"):
        from_xml(Add, to_xml(Point(1, 2)))
    with pytest.raises(ValidationError, match="root element"):
        from_xml(Add, add_xml("<a>1</a><b>2</b>", ns="urn:elsewhere"))


def test_from_xml_rejects_oversized_input() -> None:
    data = add_xml("<a>1</a><b>2</b>" + " " * 300_000)
    with pytest.raises(ValidationError) as info:
        from_xml(Add, data)
    assert info.value.code is HuhCode.TOO_LARGE


def test_from_xml_reports_a_refusal_by_the_class_as_validation_error() -> None:
    @xmlify
    @dataclass
    class Positive:
        n: int

        def __post_init__(self) -> None:
            if self.n <= 0:
                raise ValueError("must be positive")

    ns = spec_of(Positive).namespace
    with pytest.raises(ValidationError, match="must be positive"):
        from_xml(Positive, f'<positive xmlns="{ns}"><n>0</n></positive>'.encode())


def test_validation_error_carries_libxml2_text() -> None:
    error = assert_payload_rejected(Add, add_xml("<a>x</a><b>2</b>"))
    assert "{https://xml-pipeline.org/ns/calculator/add/v1}a" in error.detail
    assert error.public_message == "The payload does not match its schema."


# --- what serialising refuses -------------------------------------------------------


def test_naive_datetime_is_refused_on_output() -> None:
    with pytest.raises(ValueError, match="naive"):
        to_xml(Stamp(datetime(2026, 1, 1)))


def test_utc_offset_with_seconds_is_refused_on_output() -> None:
    with pytest.raises(ValueError, match="offset"):
        to_xml(Stamp(datetime(2026, 1, 1, tzinfo=timezone(timedelta(seconds=30)))))


def test_string_with_characters_illegal_in_xml_is_refused() -> None:
    for bad in ["\x00", "a\x1fb", "\ufffe", "\ud800"]:
        with pytest.raises(ValueError, match="cannot be represented in XML"):
            to_xml(sample_everything(text=bad))


def test_overlong_string_and_list_are_refused_on_output() -> None:
    with pytest.raises(ValueError, match="exceeds 8"):
        to_xml(Bounded("123456789", "ab"))
    with pytest.raises(ValueError, match="exceeds 2"):
        to_xml(Bounded("n", "abc"))
    with pytest.raises(ValueError, match="exceed 3"):
        to_xml(Bounded("n", "ab", ["1", "2", "3", "4"]))


def test_values_of_the_wrong_type_are_refused() -> None:
    for obj in [
        Add(True, 1),  # a bool is not an int on the wire
        Add("1", 2),  # type: ignore[arg-type]
        Add(None, 2),  # type: ignore[arg-type]
        sample_everything(point=(1, 2)),
        sample_everything(color="blue"),
        sample_everything(words="abc"),
        sample_everything(flag=1),
        sample_everything(money=1.5),
    ]:
        with pytest.raises(TypeError):
            to_xml(obj)


def test_unrepresentable_numbers_are_refused() -> None:
    for money in [Decimal("NaN"), Decimal("Infinity"), Decimal("1E+2000")]:
        with pytest.raises(ValueError):
            to_xml(sample_everything(money=money))
    with pytest.raises(ValueError):
        to_xml(Add(10**MAX_NUMBER_DIGITS, 1))


def test_lenient_numeric_inputs_are_written_canonically() -> None:
    assert b"<value>3.0</value>" in to_xml(Measurement(3, []))  # int where float is declared
    assert b"<money>5</money>" in to_xml(sample_everything(money=5))
    assert b"<text>red</text>" in to_xml(sample_everything(text=_StrColor.RED))


class _StrColor(str, Enum):  # noqa: UP042 -- str() of this kind is "_StrColor.RED"
    RED = "red"


def test_to_xml_of_a_plain_object_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        to_xml(object())
    with pytest.raises(TypeError):
        spec_of(Add).to_bytes(Point(1, 2))


# --- decoration --------------------------------------------------------------------


@pytest.mark.parametrize(
    "annotation",
    [bytes, dict, tuple, Any, list, "int | str", "list[int] | None", "list[list[int]]",
     "list[int | None]", "Annotated[int, MaxLen(3)]", "set[int]", "complex"],
)  # fmt: skip
def test_unsupported_type_raises_type_error_at_decoration(annotation: Any) -> None:
    cls = dataclasses.make_dataclass("Bad", [("odd", annotation)])
    cls.__module__ = __name__
    with pytest.raises(TypeError, match=r"Bad\.odd") as info:
        xmlify(cls)
    assert "unsupported" in str(info.value) or "MaxLen" in str(info.value)


def test_nested_dataclass_must_be_xmlified_too() -> None:
    @dataclass
    class Plain:
        x: int

    @dataclass
    class Outer:
        inner: Plain

    with pytest.raises(TypeError, match=r"Outer\.inner.*Plain"):
        xmlify(Outer)


def test_unusable_enums_raise_type_error() -> None:
    class Empty(Enum):
        pass

    class Floaty(Enum):
        HALF = 0.5

    for enum in (Empty, Floaty):
        cls = dataclasses.make_dataclass("E", [("e", enum)])
        with pytest.raises(TypeError, match=r"E\.e"):
            xmlify(cls)


def test_field_name_that_is_not_an_ncname_raises_type_error() -> None:
    # An identifier but not an NCName (no __init__: its exec would NFKC-normalise the name).
    cls = dataclasses.make_dataclass("N", [("\u00aab", int)], init=False)
    with pytest.raises(TypeError, match="not a valid XML element name"):
        xmlify(cls)


def test_non_dataclass_and_bad_arguments_are_refused() -> None:
    class NotData:
        x: int

    with pytest.raises(TypeError, match="above @dataclass"):
        xmlify(NotData)
    point = dataclasses.make_dataclass("P", [("x", int)])
    for namespace in ["not a uri", "relative/path", "urn:a&b", "urn:a%zz", "urn:\u00e9"]:
        with pytest.raises(ValueError, match="namespace"):
            xmlify(namespace=namespace)(point)
    with pytest.raises(ValueError):
        xmlify(tag="1st")(point)
    with pytest.raises(ValueError):
        xmlify(max_string_length=0)(point)
    with pytest.raises(ValueError):
        MaxLen(0)


def test_recursive_payload_is_refused() -> None:
    with pytest.raises(TypeError, match="recursive"):

        @xmlify
        @dataclass
        class Node:
            children: list[Node]


def test_default_namespace_is_deterministic() -> None:
    def make() -> type:
        @xmlify
        @dataclass
        class Greeting:
            name: str

        return Greeting

    first, second = spec_of(make()), spec_of(make())
    assert first.namespace == f"https://xml-pipeline.org/ns/py/{__name__}/greeting/v1"
    assert first.key == second.key == (first.namespace, "greeting")
    assert first.clark == f"{{{first.namespace}}}greeting"
    assert first.xsd == second.xsd and first.example == second.example


def test_tag_defaults_to_lower_case_class_name_and_can_be_set() -> None:
    assert spec_of(Add).tag == "add"
    assert spec_of(Everything).tag == "everything"
    assert spec_of(Everything).namespace == NS


def test_spec_helpers() -> None:
    assert is_xmlified(Add) and is_xmlified(Add(1, 2)) and not is_xmlified(int)
    assert isinstance(spec_of(Add(1, 2)), XmlSpec)

    @dataclass
    class SubAdd(Add):
        pass

    assert not is_xmlified(SubAdd)  # inherits __xmlify__ but is not the class it describes
    with pytest.raises(TypeError):
        spec_of(SubAdd)


def test_a_class_without_fields_is_an_empty_payload() -> None:
    @xmlify
    @dataclass
    class Ping:
        pass

    assert to_xml(Ping()) == spec_of(Ping).example
    assert to_xml(Ping()).endswith(b"></ping>")
    assert from_xml(Ping, to_xml(Ping())) == Ping()


def test_non_ascii_names_give_a_valid_default_namespace() -> None:
    @xmlify
    @dataclass
    class Grüße:
        wörter: list[str]

    obj = Grüße(["hallo"])
    assert "%C3%BC" in spec_of(Grüße).namespace
    assert from_xml(Grüße, to_xml(obj)) == obj


def test_init_false_fields_are_not_on_the_wire() -> None:
    @xmlify
    @dataclass
    class Rect:
        w: int
        h: int
        area: int = field(init=False)

        def __post_init__(self) -> None:
            self.area = self.w * self.h

    assert b"area" not in to_xml(Rect(2, 3))
    assert from_xml(Rect, to_xml(Rect(2, 3))).area == 6


# --- XSD, example, prompt -------------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_xsd_compiles_with_lxml_and_xmlschema(cls: type) -> None:
    spec = spec_of(cls)
    assert isinstance(spec.schema, etree.XMLSchema)
    schema = _xmlschema(cls)
    assert schema.target_namespace == spec.namespace
    assert list(schema.elements) == [spec.tag]  # one global element: the payload root


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_example_validates(cls: type) -> None:
    spec = spec_of(cls)
    assert example_of(cls) == spec.example
    spec.validate(parse_untrusted(spec.example))
    assert _xmlschema(cls).is_valid(spec.example.decode())
    assert c14n(parse_untrusted(spec.example)) == spec.example
    assert isinstance(from_xml(cls, spec.example), cls)


def test_xsd_is_closed() -> None:
    xsd = xsd_of(Everything)
    for open_construct in ("xs:any", "anyAttribute", 'mixed="true"', "xs:attribute"):
        assert open_construct not in xsd
    assert 'elementFormDefault="qualified"' in xsd
    assert f'targetNamespace="{NS}"' in xsd


def test_docs_flow_into_schema_annotations() -> None:
    xsd = xsd_of(Add)
    assert "<xs:documentation>Adds two integers.</xs:documentation>" in xsd
    assert "<xs:documentation>The first addend.</xs:documentation>" in xsd
    point_xsd = xsd_of(Point)
    assert "<xs:documentation>Vertical coordinate, measured upwards.</xs:documentation>" in (
        point_xsd
    )


def test_description_is_the_first_docstring_paragraph() -> None:
    assert spec_of(Add).description == "Adds two integers."
    assert spec_of(Point).description == "A point in the plane."
    assert spec_of(Measurement).description == ""  # not the repr @dataclass writes


def test_prompt_has_description_fields_docs_and_example() -> None:
    prompt = spec_of(Add).prompt
    assert "Adds two integers." in prompt
    assert "<a> integer, required - The first addend." in prompt
    assert "<b> integer, required - The second addend." in prompt
    assert spec_of(Add).example.decode() in prompt
    search = spec_of(Search).prompt
    assert "What to look for." in search and "How many results at most." in search
    assert "optional, default 10" in search
    nested = spec_of(Everything).prompt
    assert "  - <x> integer, required - Horizontal coordinate." in nested
    assert "one of: red, green, a&b <c>" in nested
    assert "repeated 0 to 1000 times" in nested


def test_classes_defined_in_functions_resolve_local_names() -> None:
    @xmlify
    @dataclass
    class Inner:
        v: int

    @xmlify
    @dataclass
    class Outer:
        inner: Inner
        inners: list[Inner]

    obj = Outer(Inner(1), [Inner(2), Inner(3)])
    assert from_xml(Outer, to_xml(obj)) == obj


def _xmlschema(cls: type) -> xmlschema.XMLSchema:
    cached = _XMLSCHEMA_CACHE.get(cls)
    if cached is None:
        cached = _XMLSCHEMA_CACHE[cls] = xmlschema.XMLSchema(xsd_of(cls))
    return cached


_XMLSCHEMA_CACHE: dict[type, xmlschema.XMLSchema] = {}


# ---- XmlName: element names a Python identifier cannot spell ----------------------


def test_xml_name_gives_a_field_a_hyphenated_element_everywhere() -> None:
    from agentd import XmlName

    @xmlify(namespace="https://example.org/ns/named/v1", tag="run-result")
    @dataclass
    class Named:
        """What a program did."""

        exit_code: Annotated[int, "the exit status", XmlName("exit-code")]
        mime_type: Annotated[str | None, XmlName("mime-type")] = None

    data = to_xml(Named(exit_code=3, mime_type="text/plain"))
    assert data == (b'<run-result xmlns="https://example.org/ns/named/v1"><exit-code>3</exit-code>'
                    b"<mime-type>text/plain</mime-type></run-result>")
    assert from_xml(Named, data) == Named(exit_code=3, mime_type="text/plain")
    assert 'name="exit-code"' in xsd_of(Named) and b"<exit-code>" in example_of(Named)
    with pytest.raises(ValidationError):  # the Python spelling is not the element
        from_xml(Named, b'<run-result xmlns="https://example.org/ns/named/v1">'
                        b"<exit_code>3</exit_code></run-result>")
