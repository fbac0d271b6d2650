"""`admit_call`, the checks a peer's call meets at the link, without sockets."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode
from agentd._xml import DEFAULT_SHAPE, ShapeLimits, c14n, parse_untrusted
from agentd._xmlify import to_xml
from agentd.federation._calls import _THREADS, CallRefused, admit_call, call_thread
from agentd.tools.echo import Echo

EXPORT = frozenset({"echo"})


def call(payload: bytes | None = None, to: str | None = "echo", sender: str = "alpha",
         call_id: object = "c-1") -> dict[str, object]:
    body = payload if payload is not None else to_xml(Echo(text="hi"))
    env = build_envelope(sender, str(uuid.uuid4()), c14n(parse_untrusted(body)), to)
    return {"t": "call", "id": call_id, "envelope": env.decode()}


def admit(frame: dict[str, object], allow_meta: bool = False) -> object:
    return admit_call(frame, "alpha", EXPORT, allow_meta, 262144)


def test_an_exported_call_gets_this_organisms_thread() -> None:
    frame = call()
    admitted = admit_call(frame, "alpha", EXPORT, False, 262144)
    env = parse_envelope(admitted.envelope)
    assert env.sender == "alpha" and env.to == "echo"
    assert env.thread == admitted.thread == call_thread("alpha", "c-1")
    assert env.thread not in str(frame["envelope"])  # the caller's thread stays there


def test_call_threads_differ_by_peer_and_by_id() -> None:
    assert call_thread("alpha", "1") != call_thread("gamma", "1")
    assert call_thread("alpha", "1") != call_thread("alpha", "2")
    assert call_thread("alpha", "1") == call_thread("alpha", "1")


@given(st.text(max_size=40), st.text(max_size=80))
def test_a_call_thread_is_the_uuid5_of_peer_and_call_id(peer: str, call_id: str) -> None:
    assert call_thread(peer, call_id) == str(uuid.uuid5(_THREADS, f"{peer}\n{call_id}"))


@pytest.mark.parametrize("payload", [
    to_xml(Echo(text="hi")),
    b'<echo xmlns="https://xml-pipeline.org/ns/tools/echo/v1" xmlns:u="urn:unused"'
    b' a="1"><text u:b="2">&#x3c; &amp; \xc3\xa9</text><!-- c --></echo>',
    b'<e:echo xmlns:e="https://xml-pipeline.org/ns/tools/echo/v1"><e:text><![CDATA[<x/>]]>'
    b'</e:text></e:echo>',
])
def test_the_parsed_call_is_what_the_pump_would_parse(payload: bytes) -> None:
    """The pump takes `parsed` instead of parsing `envelope` again: they must agree."""
    admitted = admit_call(call(payload), "alpha", EXPORT, False, 262144, DEFAULT_SHAPE)
    again = parse_envelope(admitted.envelope, shape=DEFAULT_SHAPE)
    got = admitted.parsed
    assert (got.sender, got.to, got.thread) == (again.sender, again.to, again.thread)
    assert c14n(got.payload) == c14n(again.payload)
    assert got.attributed == again.attributed
    assert got.payload_has_attributes() == again.payload_has_attributes()


def test_a_call_is_held_to_the_pumps_shape_and_size() -> None:
    many = b"".join(b"<text>x</text>" for _ in range(50))
    payload = b'<echo xmlns="https://xml-pipeline.org/ns/tools/echo/v1">' + many + b"</echo>"
    with pytest.raises(CallRefused) as shape:
        admit_call(call(payload), "alpha", EXPORT, False, 262144, ShapeLimits(max_elements=20))
    assert shape.value.code is HuhCode.TOO_LARGE
    # C14N writes `>` in text as `&gt;`: the peer's bytes fit, re-addressed they do not.
    body = (b'<echo xmlns="https://xml-pipeline.org/ns/tools/echo/v1"><text>' + b">" * 100
            + b"</text></echo>")
    envelope = build_envelope("alpha", str(uuid.uuid4()), body, "echo")
    frame = {"t": "call", "id": "c-1", "envelope": envelope.decode()}
    fits = len(envelope)
    with pytest.raises(CallRefused) as size:
        admit_call(frame, "alpha", EXPORT, False, fits)
    assert size.value.code is HuhCode.TOO_LARGE
    # 40 declarations on the root, each used by one of a child's 40 attributes: within
    # the shape as sent (at most 64 a tag); C14N writes 80 on the child.
    prefixes = [f"p{i}" for i in range(40)]
    declared = " ".join(f'xmlns:{x}="urn:{x}"' for x in prefixes)
    used = " ".join(f'{x}:a="1"' for x in prefixes)
    crowded = (f'<echo xmlns="https://xml-pipeline.org/ns/tools/echo/v1" {declared}>'
               f"<text {used}>x</text></echo>").encode()
    envelope = build_envelope("alpha", str(uuid.uuid4()), crowded, "echo")
    parse_envelope(envelope, shape=DEFAULT_SHAPE)  # as the peer sent it: within the shape
    with pytest.raises(CallRefused) as moved:
        admit_call({"t": "call", "id": "c-2", "envelope": envelope.decode()}, "alpha", EXPORT,
                   False, 262144, DEFAULT_SHAPE)
    assert moved.value.code is HuhCode.TOO_LARGE


@pytest.mark.parametrize(("frame", "code", "event"), [
    (call(to="calculator.add"), HuhCode.UNROUTABLE, "not-exported"),
    (call(to=None), HuhCode.UNROUTABLE, "not-exported"),
    (call(sender="core"), HuhCode.INVALID_ENVELOPE, "forged-from"),
    (call(b'<shutdown xmlns="https://xml-pipeline.org/ns/privileged/v1"/>'),
     HuhCode.UNROUTABLE, "priv-from-peer"),
    (call(b'<list-capabilities xmlns="https://xml-pipeline.org/ns/core/v1"/>', to=None),
     HuhCode.UNROUTABLE, None),
    (call(call_id="../../etc"), HuhCode.MALFORMED, None),
    (call(call_id=7), HuhCode.MALFORMED, None),
    (call(call_id="x" * 65), HuhCode.MALFORMED, None),
    ({"t": "call", "id": "c", "envelope": 3}, HuhCode.MALFORMED, None),
    ({"t": "call", "id": "c", "envelope": "<not-an-envelope/>"}, HuhCode.INVALID_ENVELOPE, None),
    ({"t": "call", "id": "c", "envelope": "<<<"}, HuhCode.MALFORMED, None),
])
def test_refused_calls(frame: dict[str, object], code: HuhCode, event: str | None) -> None:
    with pytest.raises(CallRefused) as refused:
        admit(frame)
    assert refused.value.code is code
    assert refused.value.event == event


def test_meta_is_admitted_only_when_allowed() -> None:
    frame = call(b'<list-capabilities xmlns="https://xml-pipeline.org/ns/core/v1"/>', to=None)
    assert admit(frame, allow_meta=True) is not None


def test_nested_privileged_elements_are_refused_too() -> None:
    nested = (b'<echo xmlns="https://xml-pipeline.org/ns/echo/v1"><text>x</text>'
              b'<p:shutdown xmlns:p="https://xml-pipeline.org/ns/privileged/v1"/></echo>')
    with pytest.raises(CallRefused) as refused:
        admit(call(nested))
    assert refused.value.event == "priv-from-peer"


def test_a_call_carries_its_chains_hops_and_a_bad_count_is_refused() -> None:
    """A chain that crosses organisms back and forth goes on counting on each side."""
    assert admit({**call(), "hops": 3}).hops == 3  # type: ignore[attr-defined]
    assert admit(call()).hops == 0  # type: ignore[attr-defined]  # absent: a first hop
    for bad in (-1, "3", 2.5, True, 10**7):
        with pytest.raises(CallRefused):
            admit({**call(), "hops": bad})
