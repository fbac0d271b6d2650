"""`parse_built_envelope` against `parse_envelope`: on every envelope the pump can
build around a serializer's output (agentd's for objects, C14N for elements parsed
out of a handler's raw bytes), both agree (the same fields, or the same refusal), so
skipping the envelope schema there changes nothing but the cost. `adopt_envelope`,
which takes the element the pump parsed strictly out of raw output instead of parsing
the envelope built around it, agrees with both."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lxml import etree

from agentd import xmlify
from agentd._core import Ack, Huh
from agentd._envelope import (
    Envelope,
    PrivilegedOnBus,
    adopt_envelope,
    build_envelope,
    parse_built_envelope,
    parse_envelope,
)
from agentd._errors import HuhCode, Rejection
from agentd._xml import DEFAULT_MAX_BYTES, ShapeLimits, c14n
from agentd._xmlify import spec_of
from agentd.pump.response import serialise_all
from agentd.tools.calculator import Sum
from tests.organisms.listeners import EnvObject, PrivObject


@xmlify(namespace="https://example.org/ns/built/v1")
@dataclass
class Note:
    text: str
    items: list[str]


THREAD = str(uuid.uuid4())
NAME_CHARS = st.sampled_from([*"abcXYZ019_.-: \t\r\n<>&\"'/", "\u00a0", "\u2028", "é"])
names = st.one_of(
    st.sampled_from(["calculator.add", "vault", "beta:echo", " vault ", "a" * 128, "a" * 129,
                     "a:b:c", ":x", "x:", ".x", "vault\n<to>x</to>"]),
    st.text(NAME_CHARS, max_size=40),
)
texts = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xD7FF) | st.sampled_from("\t\n\r"),
                max_size=60)  # what XML 1.0 can hold (the serializer refuses the rest)


def payloads() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.builds(lambda t, i: spec_of(Note).to_bytes(Note(t, i)), texts,
                  st.lists(texts, max_size=4)),
        st.builds(lambda v: spec_of(Sum).to_bytes(Sum(value=v)), st.integers(-10**9, 10**9)),
        st.just(spec_of(PrivObject).to_bytes(PrivObject(command="x"))),
        st.just(spec_of(EnvObject).to_bytes(EnvObject(thread="x"))),
        st.just(Huh.of(HuhCode.UNROUTABLE).to_bytes()),
        st.just(Ack(THREAD).to_bytes()),
    )


def outcome(parse: Callable[..., Envelope], data: bytes, shape: ShapeLimits | None) -> object:
    try:
        env = parse(data, shape=shape)
    except PrivilegedOnBus:
        return "privileged"
    except Rejection as rej:
        return rej.code
    return (env.sender, env.to, env.thread, env.payload.tag, env.attributed)


@settings(max_examples=400, deadline=None)
@given(sender=st.sampled_from(["hostile", "core", "calculator.add"]), to=st.none() | names,
       payload=payloads())
def test_both_parsers_agree_on_built_envelopes(sender: str, to: str | None,
                                               payload: bytes) -> None:
    try:
        data = build_envelope(sender, THREAD, payload, to=to)
    except ValueError:  # text XML cannot hold (escape_text refuses it)
        return
    shape = ShapeLimits()
    assert outcome(parse_built_envelope, data, shape) == outcome(parse_envelope, data, shape)


PRIV = "https://xml-pipeline.org/ns/privileged/v1"
ENV = "https://xml-pipeline.org/ns/envelope/v1"
# The privileged URI spelled with character references, as an attacker would hide it.
PRIV_REFS = "".join(f"&#{ord(c)};" for c in PRIV)
# Mostly what a handler means to send, sometimes what an attacker would.
namespaces = st.sampled_from(["urn:a", "https://example.org/ns/built/v1"] * 3
                             + ["", PRIV, ENV, PRIV_REFS])
tags = st.sampled_from(["a", "b", "sum", "value"] * 3 + ["p:x", "q:y", "xmlns:z"])
attributes = st.lists(st.sampled_from([
    ' id="1"', ' from="core"', ' xmlns=""', f' xmlns:p="{PRIV}"', ' xmlns:p="urn:p"',
    ' p:k="v"', f' xmlns:q="{PRIV_REFS}"', ' q:k="v"', " a='x&amp;y'",
]), max_size=2)
leaf_text = st.sampled_from(["", "x", "1", "&amp;", "&lt;b&gt;", "<![CDATA[<c/>]]>",
                             "<!-- c -->", "&#233;", "text &#x26; more", "\u00e9t\u00e9"])


def elements(depth: int = 0) -> st.SearchStrategy[str]:
    children = st.just("") if depth >= 2 else st.lists(elements(depth + 1), max_size=2).map(
        "".join)
    return st.builds(element, tags, namespaces, attributes, leaf_text, children)


def element(tag: str, ns: str, attrs: list[str], text: str, inner: str) -> str:
    declaration = f' xmlns="{ns}"' if ns else ""
    return f"<{tag}{declaration}{''.join(attrs)}>{text}{inner}</{tag}>"


raw_outputs = st.lists(elements(), min_size=1, max_size=3).map(lambda xs: "".join(xs).encode())


@settings(max_examples=500, deadline=None)
@given(raw=raw_outputs, to=st.none() | names)
def test_both_parsers_agree_on_envelopes_around_raw_output(raw: bytes, to: str | None) -> None:
    try:
        bodies = serialise_all(raw, 16).bodies
    except Rejection:
        return  # refused before any envelope is built
    shape = ShapeLimits()
    for body in bodies:
        try:
            data = build_envelope("hostile", THREAD, body, to=to)
        except ValueError:
            continue
        assert outcome(parse_built_envelope, data, shape) == outcome(parse_envelope, data, shape)


def adopted_outcome(data: bytes, element: etree._Element, to: str | None,
                    shape: ShapeLimits | None, max_bytes: int = DEFAULT_MAX_BYTES) -> object:
    def adopt(data: bytes, shape: ShapeLimits | None) -> Envelope:
        return adopt_envelope(data, element, "hostile", to, THREAD, max_bytes=max_bytes,
                              shape=shape)
    return outcome(adopt, data, shape)


@settings(max_examples=500, deadline=None)
@given(raw=raw_outputs, to=st.none() | names)
def test_an_adopted_element_is_what_a_parse_of_its_envelope_gives(raw: bytes,
                                                                  to: str | None) -> None:
    try:
        bodies, elements = serialise_all(raw, 16)
    except Rejection:
        return
    if elements is None:
        return  # repaired output: its envelopes are parsed from their bytes
    shape = ShapeLimits()
    for body, element in zip(bodies, elements, strict=True):
        try:
            data = build_envelope("hostile", THREAD, body, to=to)
        except ValueError:
            continue
        adopted = adopted_outcome(data, element, to, shape)
        assert adopted == outcome(parse_envelope, data, shape)
        assert adopted == outcome(parse_built_envelope, data, shape)
        if isinstance(adopted, tuple):  # taken: the same tree a parse gives
            assert c14n(element) == c14n(parse_envelope(data).payload) == body


def test_an_adopted_element_is_held_to_the_shape_of_its_built_bytes() -> None:
    # 40 declarations on the outer element, used by 40 attributes of the inner one:
    # parsed, each element is within 64 attributes; exclusive C14N moves the
    # declarations to the inner element, which then holds 80.
    decls = "".join(f' xmlns:p{i}="urn:p{i}"' for i in range(40))
    attrs = "".join(f' p{i}:k="v"' for i in range(40))
    raw = f'<a xmlns="urn:a"{decls}><b{attrs}/></a>'.encode()
    bodies, elements = serialise_all(raw, 16)
    assert elements is not None
    data = build_envelope("hostile", THREAD, bodies[0], to="vault")
    shape = ShapeLimits()
    assert adopted_outcome(data, elements[0], "vault", shape) is HuhCode.TOO_LARGE
    assert outcome(parse_envelope, data, shape) is HuhCode.TOO_LARGE
    assert adopted_outcome(data, elements[0], "vault", None, max_bytes=100) is HuhCode.TOO_LARGE


def test_a_privileged_element_is_not_adopted() -> None:
    raw = f'<a xmlns="urn:a"><x xmlns="{PRIV_REFS}"/></a>'.encode()
    bodies, elements = serialise_all(raw, 16)
    assert elements is not None
    data = build_envelope("hostile", THREAD, bodies[0], to="vault")
    assert adopted_outcome(data, elements[0], "vault", ShapeLimits()) == "privileged"


@pytest.mark.parametrize("to", ["vault\n<to>x</to>", "", "a b", "x" * 129, "\u00a0vault"])
def test_a_recipient_that_is_no_name_is_refused(to: str) -> None:
    data = build_envelope("hostile", THREAD, spec_of(Sum).to_bytes(Sum(value=1)), to=to)
    if not to:  # no <to> at all: a notice to the holder
        assert parse_built_envelope(data).to is None
        return
    with pytest.raises(Rejection) as err:
        parse_built_envelope(data)
    assert err.value.code is HuhCode.INVALID_ENVELOPE


def test_limits_still_apply() -> None:
    note = Note("x", ["y"] * 50)
    data = build_envelope("hostile", THREAD, spec_of(Note).to_bytes(note), to="vault")
    with pytest.raises(Rejection) as err:
        parse_built_envelope(data, shape=ShapeLimits(max_elements=20))
    assert err.value.code is HuhCode.TOO_LARGE
    with pytest.raises(Rejection) as err:
        parse_built_envelope(data, max_bytes=100)
    assert err.value.code is HuhCode.TOO_LARGE
