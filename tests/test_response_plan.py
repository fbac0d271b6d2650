"""What a handler's outcome turns into, decided without a pump: envelopes to
re-enter, the core notice for a holder, and the event that ends the handler's frame."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd._core import Ack, Huh
from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode
from agentd._handler import HandlerResponse
from agentd._routing import Routing
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, new_uuid
from agentd._xml import c14n
from agentd._xmlify import spec_of
from agentd.config import load_config
from agentd.pump.message import CORE, Message, MsgKind
from agentd.pump.response import plan_failure, plan_response
from agentd.tools.calculator import Add, Sum
from tests.organisms.listeners import Work

ORGANISM = Path(__file__).parent / "organisms" / "basic.yaml"
FANOUT = 4


@pytest.fixture(scope="module")
def routing() -> Routing:
    return Routing.build(load_config(ORGANISM))


class Call:
    """alice's conversation -> relay's frame -> calculator.add's frame (just called)."""

    def __init__(self, routing: Routing) -> None:
        self.reg = ThreadRegistry()
        self.root = Frame(new_uuid(), ("alice",), None, "alice", routing.profiles["public"])
        self.reg.add(self.root)
        self.relay = self.reg.extend(self.root, "relay")
        self.add = self.reg.extend(self.relay, "calculator.add")
        self.listener = routing.listeners["calculator.add"]
        data = build_envelope("relay", self.relay.uuid, spec_of(Add).to_bytes(Add(a=1, b=2)))
        env = parse_envelope(data)
        self.request = Message(MsgKind.REQUEST, "relay", self.relay, env.payload,
                               (self.listener,), spec_of(Add), data)


@pytest.fixture
def call(routing: Routing) -> Call:
    return Call(routing)


def payload_of(envelope: bytes) -> tuple[str, str | None, str, bytes]:
    env = parse_envelope(envelope)
    from lxml import etree

    return env.sender, env.to, env.thread, etree.tostring(env.payload)


def test_reply_goes_to_frame_holder(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(Sum(value=3)), FANOUT)
    assert plan.respond and plan.thread is call.relay
    [(sender, to, thread, body)] = [payload_of(e) for e in plan.envelopes]
    assert (sender, to, thread) == ("calculator.add", "relay", call.relay.uuid)
    assert b"<value>3</value>" in body
    assert plan.end is ThreadEvent.ANSWERED and plan.notice_to is None


def test_silence_acknowledges_the_request_and_ends_the_call(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add, None, FANOUT)
    assert plan.envelopes == () and plan.notice_to is call.relay
    assert plan.notice == Ack(call.relay.uuid).to_bytes() and plan.rejected is None
    assert plan.end is ThreadEvent.ANSWERED


def test_silence_with_calls_of_its_own_open_keeps_the_frame(call: Call) -> None:
    request = Message(MsgKind.REQUEST, "alice", call.root, call.request.payload,
                      (call.listener,), spec_of(Add), call.request.envelope)
    plan = plan_response(request, call.listener, call.relay, None, FANOUT)  # relay awaits add
    assert plan.notice_to is call.root and plan.end is None


def test_silence_on_a_response_sends_nothing(call: Call) -> None:
    data = build_envelope("calculator.add", call.relay.uuid, spec_of(Sum).to_bytes(Sum(value=3)))
    answer = Message(MsgKind.TO_HOLDER, "calculator.add", call.relay,
                     parse_envelope(data).payload, (call.listener,), spec_of(Sum), data)
    plan = plan_response(answer, call.listener, call.relay, None, FANOUT)
    assert plan.envelopes == () and plan.notice_to is None and plan.end is None


def test_error_tells_the_caller_its_code_and_fails_the_call(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.error(HuhCode.TIMEOUT, "upstream slow"), FANOUT)
    assert plan.notice_to is call.relay
    assert plan.notice == Huh.of(HuhCode.TIMEOUT, "upstream slow").to_bytes()
    assert plan.end is ThreadEvent.FAILED and plan.envelopes == ()


def test_an_error_the_handler_calls_final_tells_the_caller_not_to_retry(call: Call) -> None:
    final = HandlerResponse.error(HuhCode.INTERNAL, retry_allowed=False)
    plan = plan_response(call.request, call.listener, call.add, final, FANOUT)
    assert plan.notice_to is call.relay and plan.end is ThreadEvent.FAILED
    assert b"<code>internal</code>" in plan.notice
    assert b"<retry-allowed>false</retry-allowed>" in plan.notice
    # Without a word from the handler, the code decides (internal: may retry).
    plain = plan_response(call.request, call.listener, call.add,
                          HandlerResponse.error(HuhCode.INTERNAL), FANOUT)
    assert b"<retry-allowed>true</retry-allowed>" in plain.notice


def test_core_payload_from_a_handler_is_refused_to_its_own_frame(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(Ack("forged")), FANOUT)
    assert plan.notice_to is call.add and plan.rejected is HuhCode.INVALID_PAYLOAD
    assert plan.end is None  # the call stays open: the handler may correct itself


def test_fanout_beyond_the_limit_is_too_large(call: Call) -> None:
    many = [Sum(value=i) for i in range(FANOUT + 1)]
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(many), FANOUT)
    assert plan.rejected is HuhCode.TOO_LARGE and plan.envelopes == ()


def test_a_return_value_that_is_not_a_handler_response_fails_the_call(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add, "oops", FANOUT)
    assert plan.notice_to is call.relay and plan.rejected is HuhCode.INTERNAL
    assert plan.end is ThreadEvent.FAILED


def test_send_goes_out_on_the_handlers_own_frame(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse(Work(seq=1), to="worker.a"), FANOUT)
    assert not plan.respond and plan.thread is call.add and plan.end is None
    [(sender, to, thread, _)] = [payload_of(e) for e in plan.envelopes]
    assert (sender, to, thread) == ("calculator.add", "worker.a", call.add.uuid)


def test_addressed_payloads_each_go_to_the_listener_named_for_them(call: Call) -> None:
    raw = spec_of(Work).to_bytes(Work(seq=1)) + spec_of(Work).to_bytes(Work(seq=2))
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.addressed(raw, ["worker.b", ""]), FANOUT)
    assert [payload_of(e)[1] for e in plan.envelopes] == ["worker.b", None]
    assert plan.adopted is not None and [to for _, to in plan.adopted] == ["worker.b", None]


def test_addressees_that_do_not_match_the_payloads_are_refused(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.addressed([Work(seq=1)], ["worker.a", "worker.b"]),
                         FANOUT)
    assert plan.envelopes == () and plan.rejected is HuhCode.INVALID_PAYLOAD


def test_addressed_calls_keep_their_refs(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add, HandlerResponse.addressed(
        [Work(seq=1), Work(seq=2)], ["worker.a", "worker.a"], ["2.0", "2.1"]), FANOUT)
    assert len(plan.envelopes) == 2 and plan.refs == ("2.0", "2.1")


@pytest.mark.parametrize("refs", [["2.0"], ["2.0", "x" * 65], ["2.0", "a/b"],
                                  ["2.0", "a b"], ["2.0", "\u00e9"], ["2.0", 7]])
def test_refs_that_do_not_match_the_payloads_or_are_not_names_are_refused(
        call: Call, refs: list[object]) -> None:
    """A ref is journaled with every message about its call: one per payload, a short
    name, or the whole output is refused."""
    plan = plan_response(call.request, call.listener, call.add, HandlerResponse.addressed(
        [Work(seq=1), Work(seq=2)], ["worker.a", "worker.a"], refs), FANOUT)  # type: ignore[arg-type]
    assert plan.envelopes == () and plan.rejected is HuhCode.INVALID_PAYLOAD


def test_broadcast_is_one_envelope_per_target_and_payload(call: Call) -> None:
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.broadcast([Work(seq=1), Work(seq=2)],
                                                   ["worker.a", "worker.b"]), FANOUT)
    got = [payload_of(e)[1] for e in plan.envelopes]
    assert got == ["worker.a", "worker.a", "worker.b", "worker.b"]


def test_a_broadcast_counts_every_message_against_the_fanout(call: Call) -> None:
    """max_fanout bounds the messages one output sends: targets x payloads (a target
    named twice gets one copy). A single payload to 500 targets was 500 messages."""
    many = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.broadcast([Work(seq=1), Work(seq=2)],
                                                   ["worker.a", "worker.b", "worker.c"]),
                         FANOUT)
    assert many.rejected is HuhCode.TOO_LARGE and many.envelopes == ()
    wide = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.broadcast(Work(seq=1), ["worker.a"] * 3 + [
                             f"worker.{i}" for i in range(500)]), FANOUT)
    assert wide.rejected is HuhCode.TOO_LARGE
    repeated = plan_response(call.request, call.listener, call.add,
                             HandlerResponse.broadcast(Work(seq=1), ["worker.a"] * 500),
                             FANOUT)
    assert [payload_of(e)[1] for e in repeated.envelopes] == ["worker.a"]


def test_raw_xml_output_is_split_into_one_envelope_per_element(call: Call) -> None:
    raw = b'<?xml version="1.0"?><sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1">' \
          b'<value>1</value></sum><sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1">' \
          b"<value>2</value></sum>"
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(raw), FANOUT)
    assert len(plan.envelopes) == 2
    # Well-formed: each envelope comes with the element it was built from, and the
    # holder it is addressed to (the pump adopts them without a second parse).
    assert plan.adopted is not None
    assert [(c14n(el), to) for el, to in plan.adopted] == [
        (c14n(parse_envelope(e).payload), call.relay.holder) for e in plan.envelopes]


def test_repaired_raw_output_is_parsed_again_from_its_bytes(call: Call) -> None:
    raw = b'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>1</value>'
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(raw), FANOUT)
    assert len(plan.envelopes) == 1 and plan.adopted is None


def test_a_broadcast_of_raw_output_gives_each_message_its_own_tree(call: Call) -> None:
    raw = b'<work xmlns="https://xml-pipeline.org/ns/test/work/v1"><seq>1</seq></work>'
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.broadcast(raw, ["worker.a", "worker.b"]), FANOUT)
    assert len(plan.envelopes) == 2 and plan.adopted is None


def test_raw_output_to_one_listener_is_adopted_with_its_to(call: Call) -> None:
    raw = b'<work xmlns="https://xml-pipeline.org/ns/test/work/v1"><seq>1</seq></work>'
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse(raw, to="worker.a"), FANOUT)
    assert plan.adopted is not None and [to for _, to in plan.adopted] == ["worker.a"]


def test_failure_of_a_request_goes_to_the_caller(call: Call) -> None:
    plan = plan_failure(call.request, call.add, HuhCode.TIMEOUT)
    assert plan.notice_to is call.relay and plan.rejected is HuhCode.TIMEOUT
    assert plan.end is ThreadEvent.FAILED


def test_failure_while_taking_a_response_goes_to_the_callers_caller(call: Call) -> None:
    data = build_envelope("calculator.add", call.relay.uuid, spec_of(Sum).to_bytes(Sum(value=3)))
    answer = Message(MsgKind.TO_HOLDER, "calculator.add", call.relay,
                     parse_envelope(data).payload, (call.listener,), spec_of(Sum), data)
    plan = plan_failure(answer, call.relay, HuhCode.INTERNAL)
    assert plan.notice_to is call.root and plan.end is ThreadEvent.FAILED


def test_failure_on_a_core_notice_tells_the_holders_caller(call: Call) -> None:
    """A holder that fails while taking a core reply (an ack, a huh for its refused
    call, a sub-agent's answer): its caller learns of it and the frame ends, as for
    any reply. It told nobody, and the caller waited until idle collection. The huh
    goes up the chain, never back to the reply's sender, so it cannot echo."""
    data = build_envelope(CORE, call.relay.uuid, Ack(call.relay.uuid).to_bytes())
    ack = Message(MsgKind.TO_HOLDER, CORE, call.relay, parse_envelope(data).payload,
                  (call.listener,), None, data)
    plan = plan_failure(ack, call.relay, HuhCode.INTERNAL)
    assert call.relay.parent is not None
    assert plan.notice_to is call.relay.parent and plan.end is ThreadEvent.FAILED


def test_an_ended_frame_is_never_ended_again(call: Call) -> None:
    call.reg.end(call.add, ThreadEvent.ANSWERED)
    plan = plan_response(call.request, call.listener, call.add,
                         HandlerResponse.respond(Sum(value=3)), FANOUT)
    assert plan.end is None and len(plan.envelopes) == 1
