"""The pump's waits as plans: a timer set, due or cancelled, a message parked,
decided, expired or closed with its conversation, each returns what the pump must
do (a `WaitPlan`) and keeps its own counts. No pump, no kernel, no event loop."""

from __future__ import annotations

from pathlib import Path

import pytest
from lxml import etree

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode
from agentd._routing import Routing
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, new_uuid
from agentd._xmlify import to_xml
from agentd.config import PumpConfig, load_config
from agentd.durable import Deadline, Decision, TimerRequest
from agentd.pump.admission import route_request
from agentd.pump.gate import Park, gate
from agentd.pump.message import Message
from agentd.pump.waits import NOTHING, WaitPlan, Waits
from tests.organisms.durable import Count, Pay

ORGANISM = Path(__file__).parent / "organisms" / "gates.yaml"


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class World:
    """A registry with one conversation of alice's, the waits over it, and the
    entries its deadline scheduler found due."""

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self.clock = Clock()
        self.registry = ThreadRegistry()
        self.fired: list[Deadline] = []
        self.waits = Waits(self.registry, PumpConfig(), self._fire, self.clock)
        self.root = Frame(new_uuid(), ("alice",), None, "alice", routing.profiles["public"])
        self.registry.add(self.root)

    def _fire(self, due: list[Deadline], now: float) -> None:
        self.fired.extend(due)

    def due(self, seconds: float) -> list[WaitPlan]:
        """Let `seconds` pass: what each due entry asks of the pump."""
        self.clock.now += seconds
        self.fired.clear()
        self.waits.deadlines.run_due()
        return [self.waits.due(e, self.clock.now, None, None) for e in self.fired]

    def request(self, payload: object, frame: Frame | None = None) -> Message:
        frame = frame or self.root
        data = build_envelope("alice", frame.uuid, to_xml(payload))
        env = parse_envelope(data)
        return route_request(env, env.key, data, "alice", None, frame)

    def park(self, payload: object = None, tell_owner: bool = True
             ) -> tuple[Message, str, WaitPlan]:
        msg = self.request(payload if payload is not None else Pay(amount=7))
        gated = gate(msg, self.root.profile.table.gates, self.waits.counts)
        assert isinstance(gated, Park)
        row, plan = self.waits.park(msg, gated, None, tell_owner)
        return msg, row.id, plan


@pytest.fixture(scope="module")
def routing() -> Routing:
    return Routing.build(load_config(ORGANISM))


@pytest.fixture
def world(routing: Routing) -> World:
    return World(routing)


def core(payload: bytes) -> tuple[str, dict[str, str]]:
    el = etree.fromstring(payload)
    return etree.QName(el).localname, {etree.QName(c).localname: c.text or "" for c in el}


def not_approved(payload: bytes) -> bool:
    tag, fields = core(payload)
    return (tag, fields["code"], fields["message"]) == ("huh", "denied", "not approved")


def timer_call(world: World, seconds: float = 5, max_pending: int = 3) -> tuple[Frame, WaitPlan]:
    """The counter's call on alice's conversation answered `wait`."""
    msg = world.request(Count())
    call = world.registry.extend(world.root, "counter")
    listener = world.routing.listeners["counter"]
    req = TimerRequest(seconds, "tea", max_pending)
    return call, world.waits.set_timer(req, msg, listener, call, 1, None)


def test_a_due_timer_answers_its_call_with_woke(world: World) -> None:
    call, plan = timer_call(world)
    assert plan is NOTHING  # the call stays open: nothing to send yet
    assert world.waits.holds == {call.uuid: 1}
    assert world.due(4.9) == []
    (woke,) = world.due(0.2)
    assert woke.listener is world.routing.listeners["counter"] and woke.frame is call
    assert woke.hops == 1
    answer = woke.answer
    assert answer.thread is world.root and answer.respond and answer.end is ThreadEvent.ANSWERED
    (envelope,) = answer.envelopes
    env = parse_envelope(envelope)
    assert (env.sender, env.thread, env.to) == ("counter", world.root.uuid, "alice")
    assert core(etree.tostring(env.payload)) == ("woke", {"note": "tea", "late": "false"})
    assert world.waits.timers == {} and world.waits.holds == {}


def test_a_timer_whose_call_ended_answers_nothing(world: World) -> None:
    call, _ = timer_call(world)
    world.registry.end(call, ThreadEvent.FAILED)
    assert world.due(10) == [NOTHING]
    assert world.waits.timers == {} and world.waits.holds == {}


def test_a_timer_past_the_conversations_share_fails_the_call_with_a_security_event(
        world: World) -> None:
    timer_call(world, max_pending=1)
    call, refused = timer_call(world, max_pending=1)
    assert refused.event is not None and refused.event[0] == "tool-denied"
    assert refused.event[1]["cause"] == "too many pending timers"
    assert refused.answer.notice_to is world.root and refused.answer.rejected is HuhCode.DENIED
    assert refused.answer.end is ThreadEvent.FAILED and refused.frame is call
    assert len(world.waits.timers) == 1


def test_a_parked_message_tells_its_owner_and_is_counted(world: World) -> None:
    msg, approval, plan = world.park()
    client, thread, payload = plan.client  # type: ignore[misc]
    assert (client, thread) == ("alice", world.root.uuid)
    tag, fields = core(payload)
    assert tag == "approval-required" and fields["approval"] == approval
    assert list(world.waits.parked) == [approval] and world.waits.parked[approval].payload == b""
    assert world.waits.counts.total == 1 and world.waits.parked_bytes == len(msg.envelope)
    assert world.waits.holds == {world.root.uuid: 1}


def test_a_peer_organism_is_not_told_of_its_parked_call(world: World) -> None:
    _, approval, plan = world.park(tell_owner=False)
    assert plan is NOTHING and approval in world.waits.parked


def test_a_denied_message_answers_its_caller_not_approved(world: World) -> None:
    _, approval, _ = world.park()
    decision = Decision(approval, False, "operator:ops-1")
    assert world.waits.refusal(decision) is None
    plan = world.waits.decide(decision, None, None)
    assert plan.answer.notice_to is world.root and plan.hops == 0
    assert not_approved(plan.answer.notice)
    assert plan.dispatch is None and plan.own is None
    assert world.waits.parked == {} and world.waits.counts.total == 0
    assert world.waits.holds == {}


def test_an_approved_message_is_dispatched_once_routed_again(world: World) -> None:
    msg, approval, _ = world.park()
    plan = world.waits.decide(Decision(approval, True, "operator:ops-1"), None, None)
    dispatched = plan.dispatch
    assert dispatched is not None and dispatched is not msg  # routed again from its bytes
    assert [t.name for t in dispatched.targets] == ["pay"]
    assert dispatched.envelope == msg.envelope and dispatched.frame is world.root
    assert plan.own is None and plan.answer.notice_to is None
    # Decided once: a second decision on it does not stand.
    why = world.waits.refusal(Decision(approval, True, "operator:ops-1"))
    assert why is not None and why[1]["approval"] == approval


def test_a_decision_that_may_not_stand_is_refused_with_its_event(world: World) -> None:
    _, approval, _ = world.park()
    forged = Decision(approval, True, "bob", client="bob", thread=world.root.uuid,
                      payload_sha256="0" * 64)
    refused = world.waits.refusal(forged)
    assert refused is not None
    why, fields = refused
    assert fields == {"approval": approval, "by": "bob", "cause": why,
                      "thread": world.root.uuid, "client": "bob"}
    assert approval in world.waits.parked  # still pending


def test_an_expired_message_answers_its_caller_not_approved(world: World) -> None:
    world.park()
    assert world.due(59) == []
    (plan,) = world.due(2)
    assert plan.answer.notice_to is world.root
    assert not_approved(plan.answer.notice)
    assert world.waits.parked == {}


def test_the_end_of_a_conversation_drops_its_timers_and_denies_what_it_parked(
        world: World) -> None:
    timer_call(world)
    world.park()
    world.registry.end(world.root, ThreadEvent.ABANDONED)
    (plan,) = world.waits.conversation_ended(world.root.uuid, None)
    client, thread, payload = plan.client  # type: ignore[misc]
    assert (client, thread) == ("alice", world.root.uuid)
    assert not_approved(payload)
    assert world.waits.timers == {} and world.waits.parked == {} and world.waits.holds == {}
    assert not world.waits.conversations


def test_an_approved_message_no_longer_routable_answers_its_sender_and_records_the_decision(
        ) -> None:
    """Its listener retired by a reload while the message waited: the approval is
    still recorded (`own`, with a kernel), and the sender is answered the code."""
    world = World(Routing.build(load_config(ORGANISM)))
    _, approval, _ = world.park()
    world.routing.listeners["pay"].retired = True
    plan = world.waits.decide(Decision(approval, True, "operator:ops-1"), None, None)
    assert plan.dispatch is None and plan.approval == approval
    assert plan.answer.notice_to is world.root and plan.answer.rejected is HuhCode.UNROUTABLE
    assert core(plan.answer.notice)[1]["code"] == "unroutable"
