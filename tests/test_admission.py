"""Admission as pure decisions: an envelope, the frame it names and the profile in
force in; the admitted message or the refusal (with its huh code) out. No pump."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd._envelope import Envelope, build_envelope, parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._routing import Routing
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, new_uuid
from agentd._xmlify import spec_of
from agentd.config import MetaConfig, load_config
from agentd.pump.admission import Violation, admit_client, response_spec, route_request, to_holder
from agentd.pump.message import CORE, MsgKind
from agentd.tools.calculator import Add, Sum
from agentd.tools.relay import Relay
from tests.organisms.listeners import Done, Secret, Work

ORGANISM = Path(__file__).parent / "organisms" / "basic.yaml"
CLIENTS = {"alice": "public", "nina": "narrow"}
MAX = 256 * 1024


@pytest.fixture(scope="module")
def routing() -> Routing:
    return Routing.build(load_config(ORGANISM))


def wrap(sender: str, payload: object, thread: str | None = None,
         to: str | None = None) -> tuple[Envelope, bytes]:
    data = build_envelope(sender, thread or new_uuid(), spec_of(payload).to_bytes(payload), to=to)
    return parse_envelope(data), data


def admit(routing: Routing, client: str, payload: object, frame: Frame | None = None,
          thread: str | None = None, sender: str | None = None):  # type: ignore[no-untyped-def]
    env, data = wrap(sender or client, payload, thread or (frame.uuid if frame else None))
    return admit_client(client, env, data, frame, routing.profiles, CLIENTS,
                        MetaConfig(), MAX)


def root(routing: Routing, client: str = "alice") -> Frame:
    return Frame(new_uuid(), (client,), None, client, routing.profiles[CLIENTS[client]])


def registered(routing: Routing) -> tuple[ThreadRegistry, Frame]:
    """A registry holding one conversation of alice's."""
    reg = ThreadRegistry()
    conversation = root(routing)
    reg.add(conversation)
    return reg, conversation


def test_first_envelope_opens_a_conversation_under_the_clients_profile(routing: Routing) -> None:
    msg = admit(routing, "alice", Add(a=1, b=2))
    assert msg.kind is MsgKind.REQUEST and msg.sender == "alice"
    assert msg.frame.is_root and msg.frame.owner == "alice" and msg.frame.path == ("alice",)
    assert msg.frame.profile is routing.profiles["public"]
    assert [t.name for t in msg.targets] == ["calculator.add"]


def test_forged_from_is_rejected(routing: Routing) -> None:
    with pytest.raises(Violation) as caught:
        admit(routing, "alice", Add(a=1, b=2), sender="bob")
    assert caught.value.code is HuhCode.INVALID_ENVELOPE
    assert caught.value.event == "forged-from"
    assert caught.value.fields == {"client": "alice", "claimed": "bob"}


def test_client_without_a_profile_is_unroutable(routing: Routing) -> None:
    with pytest.raises(Rejection) as caught:
        admit(routing, "mallory", Add(a=1, b=2))
    assert caught.value.code is HuhCode.UNROUTABLE


def test_key_outside_the_profile_is_unroutable_like_an_unknown_key(routing: Routing) -> None:
    with pytest.raises(Rejection) as outside:
        admit(routing, "nina", Relay(a=1, b=2))  # exists, not in narrow
    with pytest.raises(Rejection) as unknown:
        admit(routing, "alice", Secret(text="x"))  # vault: admin only
    assert outside.value.code is unknown.value.code is HuhCode.UNROUTABLE
    assert type(outside.value) is type(unknown.value) is Rejection


def test_another_clients_thread_is_unroutable(routing: Routing) -> None:
    bobs = Frame(new_uuid(), ("bob",), None, "bob", routing.profiles["public"])
    with pytest.raises(Rejection) as caught:
        admit(routing, "alice", Add(a=1, b=2), frame=bobs)
    assert caught.value.code is HuhCode.UNROUTABLE


def test_a_client_cannot_write_into_a_call_frame(routing: Routing) -> None:
    reg, conversation = registered(routing)
    call = reg.extend(conversation, "relay")
    with pytest.raises(Rejection) as caught:
        admit(routing, "alice", Add(a=1, b=2), frame=call)
    assert caught.value.code is HuhCode.UNROUTABLE


def test_an_ended_conversation_takes_no_more_envelopes(routing: Routing) -> None:
    reg, conversation = registered(routing)
    assert admit(routing, "alice", Add(a=1, b=2), frame=conversation).frame is conversation
    reg.end(conversation, ThreadEvent.ABANDONED)
    with pytest.raises(Rejection) as caught:
        admit(routing, "alice", Add(a=1, b=2), frame=conversation)
    assert caught.value.code is HuhCode.UNROUTABLE


def test_payload_that_fails_its_schema_is_invalid_payload(routing: Routing) -> None:
    data = build_envelope("alice", new_uuid(),
                          b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1">'
                          b"<a>two</a><b>3</b></add>")
    env = parse_envelope(data)
    with pytest.raises(Rejection) as caught:
        admit_client("alice", env, data, None, routing.profiles, CLIENTS, MetaConfig(), MAX)
    assert caught.value.code is HuhCode.INVALID_PAYLOAD


def test_meta_question_is_answered_by_the_pump_itself(routing: Routing) -> None:
    data = build_envelope("alice", new_uuid(),
                          b'<list-capabilities xmlns="https://xml-pipeline.org/ns/core/v1"/>')
    env = parse_envelope(data)
    with pytest.raises(Rejection) as off:  # off by default
        admit_client("alice", env, data, None, routing.profiles, CLIENTS, MetaConfig(), MAX)
    assert off.value.code is HuhCode.UNROUTABLE
    allowed = MetaConfig(allow_list_capabilities=True)
    msg = admit_client("alice", env, data, None, routing.profiles, CLIENTS, allowed, MAX)
    assert b"calculator.add" in msg.envelope and b"vault" not in msg.envelope
    assert msg.kind is MsgKind.TO_HOLDER and msg.sender == CORE and msg.targets == ()
    assert parse_envelope(msg.envelope).to == "alice"


def test_handler_output_to_an_undeclared_peer_is_a_peer_violation(routing: Routing) -> None:
    relay = routing.listeners["relay"]
    frame = root(routing)
    env, data = wrap("relay", Work(seq=1), frame.uuid)  # worker.a: not relay's peer
    with pytest.raises(Violation) as caught:
        route_request(env, env.key, data, "relay", relay, frame)
    assert caught.value.code is HuhCode.UNROUTABLE and caught.value.event == "peer-violation"


def test_broadcast_key_reaches_only_the_declared_peers(routing: Routing) -> None:
    hostile = routing.listeners["hostile"]  # peers: calculator.add, worker.a
    frame = root(routing)
    env, data = wrap("hostile", Work(seq=1), frame.uuid)  # worker.a and worker.b
    msg = route_request(env, env.key, data, "hostile", hostile, frame)
    assert [t.name for t in msg.targets] == ["worker.a"]


def test_retired_listener_is_not_routed_to(routing: Routing) -> None:
    fresh = Routing.build(load_config(ORGANISM))
    fresh.listeners["calculator.add"].retired = True
    frame = Frame(new_uuid(), ("alice",), None, "alice", fresh.profiles["public"])
    env, data = wrap("alice", Add(a=1, b=2), frame.uuid)
    with pytest.raises(Rejection) as caught:
        route_request(env, env.key, data, "alice", None, frame)
    assert caught.value.code is HuhCode.UNROUTABLE


def test_reply_goes_to_frame_holder(routing: Routing) -> None:
    reg, conversation = registered(routing)
    call = reg.extend(conversation, "relay")  # relay holds `call`
    env, data = wrap("calculator.add", Sum(value=3), call.uuid, to="relay")
    msg = to_holder(env, data, "calculator.add", call, spec_of(Sum))
    assert msg.kind is MsgKind.TO_HOLDER and [t.name for t in msg.targets] == ["relay"]


def test_reply_on_a_conversation_goes_to_its_client(routing: Routing) -> None:
    conversation = root(routing)
    env, data = wrap("calculator.add", Sum(value=3), conversation.uuid, to="alice")
    msg = to_holder(env, data, "calculator.add", conversation, spec_of(Sum))
    assert msg.targets == ()  # delivered to the client, not run


def test_undeclared_response_class_is_refused(routing: Routing) -> None:
    env, _ = wrap("calculator.add", Done(seq=1, by="x"))
    with pytest.raises(Rejection) as caught:
        response_spec(routing.listeners["calculator.add"], env)
    assert caught.value.code is HuhCode.INVALID_PAYLOAD
    env, _ = wrap("calculator.add", Sum(value=1))
    assert response_spec(routing.listeners["calculator.add"], env) is spec_of(Sum)
