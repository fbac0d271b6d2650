"""The client's calls without a socket (`agentd.client._calls`): which call a frame
belongs to, what it means, and each call's state machine."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from agentd import _core, xmlify
from agentd._core import Accepted as CoreAccepted
from agentd._core import Huh as CoreHuh
from agentd._delivery import stamp
from agentd._envelope import NIL_THREAD, build_envelope
from agentd._errors import HuhCode
from agentd._schemas import NS_CORE
from agentd._states import step
from agentd._xmlify import spec_of
from agentd.client import Accepted, Answer, ApprovalRequired, Final, Huh, Other, Partial, Step
from agentd.client._calls import TRANSITIONS, CallEvent, Calls, CallState, typed
from agentd.tools.calculator import Sum
from tests.state_tables import walk_table

T1 = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"
T2 = "0b8c1d2e-3f40-4a5b-8c6d-7e8f9a0b1c2d"
SUM = b'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>5</value></sum>'


def core(thread: str, payload: bytes) -> bytes:
    return build_envelope("core", thread, payload, to="alice")


def parked(thread: str) -> bytes:
    return core(thread, (
        f'<approval-required xmlns="{NS_CORE}"><approval>ap-1</approval>'
        "<listener>pay</listener><payload>&lt;pay xmlns=\"urn:p\"&gt;&lt;/pay&gt;</payload>"
        f"<payload-sha256>{'0' * 64}</payload-sha256>"
        "<expires>2030-01-01T00:00:00Z</expires></approval-required>").encode())


def test_every_state_and_event_pair_of_a_call() -> None:
    walk_table(TRANSITIONS, lambda s, e: step("call", TRANSITIONS, s, e), CallState,
               CallEvent)


def test_a_call_goes_accepted_parked_then_answered() -> None:
    calls = Calls()
    call = calls.start(T1)
    c, accepted = calls.feed(core(T1, CoreAccepted(T1, 12).to_bytes()))
    assert c is call and isinstance(accepted, Accepted) and accepted.seq == 12
    c, waiting = calls.feed(parked(T1))
    assert isinstance(waiting, ApprovalRequired) and call.state is CallState.PARKED
    assert (waiting.approval, waiting.listener, waiting.payload) == (
        "ap-1", "pay", b'<pay xmlns="urn:p"></pay>')
    c, answer = calls.feed(build_envelope("calculator.add", T1, SUM, to="alice"))
    assert isinstance(answer, Answer) and answer.payload == Sum(value=5)
    assert answer.xml == SUM and call.state is CallState.DONE and len(calls) == 0
    _, late = calls.feed(build_envelope("calculator.add", T1, SUM, to="alice"))
    assert isinstance(late, Other)  # the call is over: not taken for another answer


def test_a_preview_event_is_the_core_frame_as_sent() -> None:
    # Partial, Final and Step are the daemon's core frames read back with the
    # envelope they came in: every field of the frame, none lost or renamed.
    calls = Calls()
    calls.start(T1)
    sent = [_core.Partial("s1", 1, "The sum"), _core.Final("s1", 1, interrupted=True),
            _core.Step("tool-call", "calculator.add", "c1", SUM),
            _core.Step("progress", "calc.count", progress=2, total=3, message="two")]
    for frame, event_class in zip(sent, (Partial, Final, Step, Step), strict=True):
        envelope = core(T1, frame.to_bytes())
        _, event = calls.feed(envelope)
        assert isinstance(event, event_class) and isinstance(event, type(frame))
        assert (event.thread, event.sender, event.frame) == (T1, "core", envelope)
        assert event.to_bytes() == frame.to_bytes()


def test_a_huh_ends_the_call_as_an_exception_value() -> None:
    calls = Calls()
    calls.start(T1)
    frame = core(T1, CoreHuh.of(HuhCode.DENIED, "not approved").to_bytes())
    _, huh = calls.feed(frame)
    assert isinstance(huh, Huh)
    assert (huh.code, huh.message, huh.retry_allowed, huh.thread, huh.frame) == (
        "denied", "not approved", False, T1, frame)


def test_frames_of_threads_it_did_not_start_are_other() -> None:
    calls = Calls()
    calls.start(T1)
    call, event = calls.feed(build_envelope("pay", T2, SUM, to="alice"))
    assert call is None and isinstance(event, Other) and event.thread == T2
    assert len(calls) == 1


def test_calls_sharing_a_thread_take_their_frames_in_order() -> None:
    calls = Calls()
    first, second = calls.start(T1), calls.start(T1)
    assert calls.feed(core(T1, CoreAccepted(T1, 1).to_bytes()))[0] is first
    assert calls.feed(core(T1, CoreAccepted(T1, 2).to_bytes()))[0] is second
    assert calls.feed(build_envelope("calculator.add", T1, SUM))[0] is first
    assert calls.feed(build_envelope("calculator.add", T1, SUM))[0] is second


def test_a_refusal_on_the_nil_thread_goes_to_the_call_sent_on_it() -> None:
    calls = Calls()
    calls.start(T1)
    broken = calls.start(NIL_THREAD)  # bytes that name no thread
    call, huh = calls.feed(core(NIL_THREAD, CoreHuh.of(HuhCode.MALFORMED).to_bytes()))
    assert call is broken and isinstance(huh, Huh) and huh.code == "malformed"


def test_a_forgotten_call_takes_no_more_frames() -> None:
    calls = Calls()
    call = calls.start(T1)
    calls.forget(call)
    assert isinstance(calls.feed(build_envelope("x", T1, SUM))[1], Other)


def test_an_answer_is_typed_only_by_the_one_class_of_its_tag() -> None:
    assert typed("{urn:nobody}x", b'<x xmlns="urn:nobody"/>') == b'<x xmlns="urn:nobody"/>'
    assert typed("{https://xml-pipeline.org/ns/calculator/sum/v1}sum", SUM) == Sum(value=5)
    invalid = SUM.replace(b">5<", b">five<")
    assert typed("{https://xml-pipeline.org/ns/calculator/sum/v1}sum", invalid) == invalid

    @xmlify(namespace="urn:twice")
    @dataclass
    class One:
        n: int

    assert typed("{urn:twice}one", b'<one xmlns="urn:twice"><n>1</n></one>') == One(n=1)

    @xmlify(namespace="urn:twice", tag="one")
    @dataclass
    class Other1:
        n: int

    # Two classes for one tag: which one is meant is not known, so the bytes.
    xml = b'<one xmlns="urn:twice"><n>1</n></one>'
    assert typed("{urn:twice}one", xml) == xml and Other1 is not One


def test_a_frame_resent_with_a_seq_already_seen_is_dropped() -> None:
    calls = Calls()
    t = str(uuid.uuid4())
    calls.start(t)
    frame = stamp(build_envelope("calculator.add", t, spec_of(Sum).to_bytes(Sum(value=3)),
                                 to="alice"), 12)
    call, event = calls.feed(frame)
    assert call is not None and isinstance(event, Answer) and calls.delivered == 12
    assert calls.feed(frame) == (None, None)
