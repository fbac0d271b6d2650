"""The approval gate as a pure decision: a routed message, its thread's gates and
the counts of what is parked in; run now, park, or refuse out. No pump, no loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode
from agentd._routing import Routing
from agentd._threads import Frame, new_uuid
from agentd._xmlify import spec_of, to_xml
from agentd.config import load_config
from agentd.durable import ApprovalRules
from agentd.kernel import ApprovalRow
from agentd.pump import gate as gates
from agentd.pump.admission import route_request, to_holder
from agentd.pump.gate import PASS, Deny, Park, ParkedCounts, gate
from agentd.pump.message import Message
from tests.organisms.durable import Count, Paid, Pay

ORGANISM = Path(__file__).parent / "organisms" / "gates.yaml"
BIG = 1 << 30


@pytest.fixture(scope="module")
def routing() -> Routing:
    return Routing.build(load_config(ORGANISM))


def conversation(routing: Routing, client: str = "alice", profile: str = "public") -> Frame:
    return Frame(new_uuid(), (client,), None, client, routing.profiles[profile])


def request(frame: Frame, payload: object, sender: str = "alice") -> Message:
    data = build_envelope(sender, frame.uuid, to_xml(payload))
    env = parse_envelope(data)
    return route_request(env, env.key, data, sender, None, frame)


def parked(frame: Frame, size: int = 100) -> ApprovalRow:
    """A row as the waits park it: what the counts read is its ids and size."""
    return ApprovalRow(new_approval(), frame.root.uuid, frame.uuid, frame.root.owner, "pay",
                       frame.root.owner, 0, b"x" * size, b"", "", ("client",), 0.0, 60.0)


_ids = iter(range(1_000_000))


def new_approval() -> str:
    return f"a{next(_ids)}"


def test_a_request_for_a_gated_listener_parks_under_its_gates_rules(routing: Routing) -> None:
    frame = conversation(routing)
    msg = request(frame, Pay(amount=7))
    decided = gate(msg, frame.profile.table.gates, ParkedCounts(BIG, BIG))
    assert decided == Park(ApprovalRules(("operator", "client"), 60.0), "pay")


def test_a_listener_without_a_gate_runs_now(routing: Routing) -> None:
    frame = conversation(routing)
    msg = request(frame, Count())
    assert gate(msg, frame.profile.table.gates, ParkedCounts(BIG, BIG)) is PASS


def test_a_profile_gate_applies_to_its_listeners(routing: Routing) -> None:
    frame = conversation(routing, "carl", "careful")
    msg = request(frame, Count(), "carl")
    assert gate(msg, frame.profile.table.gates, ParkedCounts(BIG, BIG)) == Park(
        ApprovalRules(("client",), 30.0), "counter")


def test_only_a_request_is_gated(routing: Routing) -> None:
    """An answer for a gated caller is delivered, never parked: only a call waits."""
    frame = conversation(routing)
    gated_call = Frame(new_uuid(), ("alice", "pay"), frame, "alice", frame.profile)
    data = build_envelope("counter", gated_call.uuid, to_xml(Paid(amount=7)), to="pay")
    env = parse_envelope(data)
    answer = to_holder(env, data, "counter", gated_call, spec_of(Paid))
    assert [t.name for t in answer.targets] == ["pay"]
    assert gate(answer, frame.profile.table.gates, ParkedCounts(BIG, BIG)) is PASS


def test_no_gates_at_all_runs_now(routing: Routing) -> None:
    frame = conversation(routing)
    assert gate(request(frame, Pay(amount=7)), {}, ParkedCounts(BIG, BIG)) is PASS


def test_a_full_conversation_is_denied_with_the_security_event(routing: Routing) -> None:
    frame = conversation(routing)
    counts = ParkedCounts(BIG, BIG)
    for _ in range(gates.MAX_PARKED_PER_CONVERSATION):
        counts.add(parked(frame))
    msg = request(frame, Pay(amount=7))
    assert gate(msg, frame.profile.table.gates, counts) == Deny(HuhCode.DENIED, {
        "thread": frame.uuid, "sender": "alice", "pending": "64",
        "parked_bytes": str(64 * 100), "refused": "denied"})
    other = conversation(routing)  # another conversation of the same client still parks
    assert isinstance(gate(request(other, Pay(amount=7)), other.profile.table.gates, counts),
                      Park)


def test_a_client_past_its_share_is_denied_and_another_client_parks(
        routing: Routing) -> None:
    counts = ParkedCounts(BIG, BIG, max_parked_per_client=2)
    for _ in range(2):
        counts.add(parked(conversation(routing)))
    alice = conversation(routing)
    decided = gate(request(alice, Pay(amount=1)), alice.profile.table.gates, counts)
    assert isinstance(decided, Deny) and decided.code is HuhCode.DENIED
    bob = conversation(routing, "bob")
    assert isinstance(gate(request(bob, Pay(amount=1), "bob"), bob.profile.table.gates,
                           counts), Park)


def test_everyone_past_max_parked_is_denied(routing: Routing) -> None:
    counts = ParkedCounts(BIG, BIG, max_parked=3)
    for client in ("alice", "bob", "olga"):
        counts.add(parked(conversation(routing, client)))
    carl = conversation(routing, "carl")
    decided = gate(request(carl, Pay(amount=1), "carl"), carl.profile.table.gates, counts)
    assert isinstance(decided, Deny) and decided.code is HuhCode.DENIED


def test_parked_bytes_past_a_clients_cap_or_everyones_are_rate_limited(
        routing: Routing) -> None:
    alice, bob = conversation(routing), conversation(routing, "bob")
    size = len(request(alice, Pay(amount=1)).envelope)
    counts = ParkedCounts(max_bytes=3 * size, max_bytes_per_client=2 * size)
    counts.add(parked(alice, size))
    assert isinstance(gate(request(alice, Pay(amount=1)), alice.profile.table.gates, counts),
                      Park)  # exactly at the client's cap: still parks
    counts.add(parked(alice, size))
    decided = gate(request(alice, Pay(amount=1)), alice.profile.table.gates, counts)
    assert isinstance(decided, Deny) and decided.code is HuhCode.RATE_LIMITED
    assert decided.event["parked_bytes"] == str(2 * size)
    assert isinstance(gate(request(bob, Pay(amount=1), "bob"), bob.profile.table.gates,
                           counts), Park)
    counts.add(parked(bob, size))  # everyone's cap reached
    decided = gate(request(bob, Pay(amount=1), "bob"), bob.profile.table.gates, counts)
    assert isinstance(decided, Deny) and decided.code is HuhCode.RATE_LIMITED


def test_a_decision_makes_room_and_the_counts_forget_empty_keys(routing: Routing) -> None:
    frame = conversation(routing)
    counts = ParkedCounts(BIG, BIG)
    rows = [parked(frame) for _ in range(gates.MAX_PARKED_PER_CONVERSATION)]
    for row in rows:
        counts.add(row)
    msg = request(frame, Pay(amount=7))
    assert isinstance(gate(msg, frame.profile.table.gates, counts), Deny)
    counts.remove(rows[0])
    assert isinstance(gate(msg, frame.profile.table.gates, counts), Park)
    for row in rows[1:]:
        counts.remove(row)
    assert (counts.total, counts.bytes, counts.ids_of, counts.of_client,
            counts.bytes_of_client) == (0, 0, {}, {}, {})
