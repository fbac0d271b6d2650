"""`admit_call`, the checks a peer's call meets at the link, without sockets."""

from __future__ import annotations

import uuid

import pytest

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import to_xml
from agentd.federation._calls import CallRefused, admit_call, call_thread
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
