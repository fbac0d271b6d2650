"""Approval gates through the whole pump and a real kernel, attacked: a parked
message runs once when approved, never when denied, expired, decided by someone
not allowed, or approved for a different payload; its rules are the ones it was
parked under."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from agentd._envelope import build_envelope
from agentd._schemas import NS_CORE
from agentd._wiring import pump_options
from agentd._xmlify import to_xml
from agentd.config import load_config, load_config_text
from agentd.durable import Decision, judge
from agentd.kernel import ApprovalRow
from agentd.testing import Harness
from tests.organisms import durable
from tests.organisms.durable import Count, Pay, PayOp, PayVia

ORGANISM = Path(__file__).parent / "organisms" / "gates.yaml"
CLIENTS = {"alice": "public", "bob": "public", "olga": "ops", "carl": "careful"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _calls() -> None:
    durable.CALLS.clear()


def harness(clock: FakeClock, state_dir: Path | None = None, text: str | None = None,
            gateways: frozenset[str] = frozenset()) -> Harness:
    config = (load_config(ORGANISM) if text is None
              else load_config_text(text, base_dir=ORGANISM.parent))
    events: list[tuple[str, dict[str, str]]] = []
    h = Harness(config, CLIENTS, clock=clock, state_dir=state_dir,
                options=replace(pump_options(config), gateways=gateways),
                on_security=lambda kind, fields: events.append((kind, dict(fields))))
    h.events = events  # type: ignore[attr-defined]
    return h


def payload_of(frame: bytes) -> etree._Element:
    return etree.fromstring(frame)[1]


def tag(frame: bytes) -> str:
    return etree.QName(payload_of(frame)).localname


def child(frame: bytes, name: str) -> str:
    found = payload_of(frame).find(f"{{*}}{name}")
    assert found is not None, frame
    return found.text or ""


def decision(client: str, thread: str, approval: str, sha: str | None, approve: bool = True,
             ) -> bytes:
    if approve:
        body = (f'<approve xmlns="{NS_CORE}"><approval>{approval}</approval>'
                f"<payload-sha256>{sha}</payload-sha256></approve>")
    else:
        body = f'<deny xmlns="{NS_CORE}"><approval>{approval}</approval></deny>'
    return build_envelope(client, thread, body.encode())


async def park(h: Harness, client: str = "alice", payload: object = None
               ) -> tuple[str, str, str]:
    frames = await h.send(client, payload if payload is not None else Pay(amount=7))
    assert [tag(f) for f in frames] == ["accepted", "approval-required"]
    required = frames[1]
    thread = child(frames[0], "thread")
    return thread, child(required, "approval"), child(required, "payload-sha256")


# ---- the rules, pure --------------------------------------------------------------


def row(**changes: object) -> ApprovalRow:
    base = ApprovalRow("a" * 32, "t1", "t1", "alice", "pay", "alice", 0, b"", b"<p/>",
                       hashlib.sha256(b"<p/>").hexdigest(), ("operator", "client"), 0.0, 10.0)
    return base._replace(**changes)


@pytest.mark.parametrize(("decision_", "row_", "why"), [
    (Decision("x", True, "alice", "alice", "t1", hashlib.sha256(b"<p/>").hexdigest()),
     row(), None),
    (Decision("x", True, "alice", "alice", "t1", "0" * 64), row(), "payload hash does not match"),
    (Decision("x", True, "alice", "alice", "t1", None), row(), "approval without the payload hash"),
    (Decision("x", False, "alice", "alice", "t1"), row(), None),
    (Decision("x", False, "bob", "bob", "t1"), row(),
     "decision from a client that does not own the thread"),
    (Decision("x", False, "alice", "alice", "t2"), row(), "decision on another thread"),
    (Decision("x", False, "alice", "alice", "t1"), row(approvers=("operator",)),
     "clients may not decide on this gate"),
    (Decision("x", True, "ops-1"), row(approvers=("client",)),
     "operators may not decide on this gate"),
    (Decision("x", True, "ops-1"), row(), None),
    (Decision("x", True, "ops-1"), row(state="approved"), "approval already approved"),
    (Decision("x", True, "ops-1"), row(deadline=5.0), "approval expired"),
])
def test_judge(decision_: Decision, row_: ApprovalRow, why: str | None) -> None:
    assert judge(row_, decision_, 5.0) == why


def test_the_approval_machine_walks_its_table() -> None:
    from agentd._states import IllegalTransition
    from agentd.durable.approvals import TRANSITIONS, ApprovalEvent, ApprovalState, close

    for state in ApprovalState:
        for event in ApprovalEvent:
            allowed = TRANSITIONS[state].get(event)
            if allowed is None:
                with pytest.raises(IllegalTransition):
                    close(state.value, event)
            else:
                assert close(state.value, event) is allowed
    assert {s for s in ApprovalState if TRANSITIONS[s]} == {ApprovalState.PENDING}


def test_judge_unknown_approval() -> None:
    assert judge(None, Decision("x", True, "ops-1"), 0.0) == "no such approval"


# ---- through the pump ---------------------------------------------------------------------


async def test_a_gated_call_is_parked_and_the_owner_told_the_exact_payload() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", Pay(amount=7))
        assert [tag(f) for f in frames] == ["accepted", "approval-required"]
        required = frames[1]
        payload = child(required, "payload").encode()
        assert hashlib.sha256(payload).hexdigest() == child(required, "payload-sha256")
        assert b"<amount>7</amount>" in payload
        assert child(required, "listener") == "pay"
        assert child(required, "expires").endswith("Z")
        assert durable.CALLS == []
        (parked,) = await h.kernel.approvals()  # type: ignore[union-attr]
        assert parked.approvers == ("operator", "client")


async def test_a_conversation_cannot_park_more_than_its_share() -> None:
    """Each message parks a row, a deadline and a push to the owner: past
    MAX_PARKED_PER_CONVERSATION in one conversation the sender is answered `huh
    denied` with a security event (a relay fanning out to a gated listener parked
    6,400 from 100 messages before)."""
    from agentd.pump.gate import MAX_PARKED_PER_CONVERSATION

    async with harness(FakeClock()) as h:
        thread, _, _ = await park(h)
        for _ in range(MAX_PARKED_PER_CONVERSATION - 1):
            frames = await h.send("alice", build_envelope(
                "alice", thread, to_xml(Pay(amount=1))))
            assert [tag(f) for f in frames][-1] == "approval-required"
        refused = await h.send("alice", build_envelope("alice", thread, to_xml(Pay(amount=1))))
        assert [tag(f) for f in refused] == ["huh"] and child(refused[0], "code") == "denied"
        assert len(h.pump.waits.parked) == MAX_PARKED_PER_CONVERSATION
        assert [k for k, _ in h.events] == ["approval-limit"]  # type: ignore[attr-defined]
        _, _, _ = await park(h)  # another conversation still parks
        assert durable.CALLS == []


async def test_a_client_cannot_park_more_than_its_share_of_the_daemon() -> None:
    """One client filling the daemon's 10,000 parked messages (one a conversation)
    had every other client's gated request refused for an hour: a client parks at
    most its share (MAX_PARKED_PER_CLIENT; 3 here)."""
    async with harness(FakeClock()) as h:
        h.pump.waits.counts.max_parked_per_client = 3
        for _ in range(3):
            await park(h)  # three conversations
        refused = await h.send("alice", Pay(amount=1))
        assert [tag(f) for f in refused] == ["huh"] and child(refused[0], "code") == "denied"
        await park(h, "bob")  # another client still parks
        assert len(h.pump.waits.parked) == 4
        first = next(iter(h.pump.waits.parked.values()))
        await h.end_conversation(first.conversation)  # a decision frees alice's share
        await park(h)


async def test_parked_bytes_are_capped_per_client_and_in_all() -> None:
    """Parked envelopes are held in memory until decided: one client parking large
    payloads grew the daemon by ~0.44 MiB each, up to the count caps (~440 MiB per
    client). Past `pump.max_parked_bytes_per_client`, or everyone's past
    `pump.max_parked_bytes`, the sender is answered `huh rate-limited` (retry once a
    decision has made room), with an `approval-limit` security event."""
    size = len(build_envelope("alice", "0" * 36, to_xml(Pay(amount=1))))
    text = ORGANISM.read_text().replace(
        "pump: {", f"pump: {{max_parked_bytes_per_client: {3 * size + 1}, "
                   f"max_parked_bytes: {4 * size + 1}, ", 1)
    async with harness(FakeClock(), text=text) as h:
        parked = [await park(h, payload=Pay(amount=1)) for _ in range(3)]
        refused = await h.send("alice", Pay(amount=1))  # past alice's share
        assert [tag(f) for f in refused] == ["huh"]
        assert child(refused[0], "code") == "rate-limited"
        await park(h, "bob", Pay(amount=1))  # bob still parks, up to the total
        refused = await h.send("bob", Pay(amount=1))
        assert child(refused[0], "code") == "rate-limited"
        assert [k for k, _ in h.events] == ["approval-limit"] * 2  # type: ignore[attr-defined]
        thread, approval, _ = parked[0]
        frames = await h.send("alice", decision("alice", thread, approval, None, False))
        assert [tag(f) for f in frames] == ["accepted", "huh"]  # denied: room again
        await park(h, "bob", Pay(amount=1))
        assert durable.CALLS == []


async def test_approved_by_the_client_runs_once() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, sha = await park(h)
        frames = await h.send("alice", decision("alice", thread, approval, sha))
        assert [tag(f) for f in frames] == ["accepted", "paid"]
        assert durable.CALLS == [("pay", 7)]
        assert h.pump.waits.parked == {}


async def test_denied_by_the_client_gives_not_approved() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, _ = await park(h)
        frames = await h.send("alice", decision("alice", thread, approval, None, approve=False))
        assert [tag(f) for f in frames] == ["accepted", "huh"]
        assert child(frames[1], "code") == "denied"
        assert child(frames[1], "message") == "not approved"
        assert durable.CALLS == []


async def test_expired_gives_not_approved() -> None:
    clock = FakeClock()
    async with harness(clock) as h:
        thread, _, _ = await park(h)
        clock.now += 61
        assert await h.fire_due() == 1
        frames = h.frames("alice", thread)
        assert [tag(f) for f in frames] == ["accepted", "approval-required", "huh"]
        assert child(frames[-1], "message") == "not approved"
        (closed,) = await h.kernel.approvals(state=None)  # type: ignore[union-attr]
        assert closed.state == "expired"
        assert durable.CALLS == []


async def test_a_decision_with_another_payload_hash_is_refused() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, sha = await park(h)
        forged = hashlib.sha256(b"<pay><amount>7000</amount></pay>").hexdigest()
        frames = await h.send("alice", decision("alice", thread, approval, forged))
        assert [tag(f) for f in frames] == ["huh"]
        assert child(frames[0], "code") == "unroutable"
        assert h.events[-1][0] == "approval-refused"  # type: ignore[attr-defined]
        assert approval in h.pump.waits.parked  # still pending
        frames = await h.send("alice", decision("alice", thread, approval, sha))
        assert durable.CALLS == [("pay", 7)]


async def test_a_decision_from_another_client_is_refused() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, sha = await park(h)
        # On alice's thread: not bob's, refused like an unknown route.
        frames = await h.send("bob", decision("bob", thread, approval, sha))
        assert [child(f, "code") for f in frames] == ["unroutable"]
        # On his own thread, naming alice's approval.
        own, _, _ = await park(h, "bob", Pay(amount=1))
        frames = await h.send("bob", decision("bob", own, approval, sha))
        assert [child(f, "code") for f in frames] == ["unroutable"]
        assert h.events[-1][1]["cause"] in (  # type: ignore[attr-defined]
            "decision from a client that does not own the thread")
        assert durable.CALLS == []


async def test_a_client_may_not_decide_when_only_operators_may() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, sha = await park(h, "olga", PayOp(amount=3))
        frames = await h.send("olga", decision("olga", thread, approval, sha))
        assert [child(f, "code") for f in frames] == ["unroutable"]
        assert durable.CALLS == []
        assert h.pump.decide(Decision(approval, True, "operator:ops-1")) is None
        await h.run_until_idle()
        assert durable.CALLS == [("pay.op", 3)]
        assert tag(h.frames("olga", thread)[-1]) == "paid"


async def test_a_replayed_decision_is_refused_and_runs_nothing_twice() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, sha = await park(h)
        first = decision("alice", thread, approval, sha)
        await h.send("alice", first)
        frames = await h.send("alice", first)
        assert [child(f, "code") for f in frames] == ["unroutable"]
        assert durable.CALLS == [("pay", 7)]


async def test_a_forged_approval_id_is_refused() -> None:
    async with harness(FakeClock()) as h:
        thread, _, sha = await park(h)
        frames = await h.send("alice", decision("alice", thread, "f" * 32, sha))
        assert [child(f, "code") for f in frames] == ["unroutable"]
        assert h.events[-1][1]["cause"] == "no such approval"  # type: ignore[attr-defined]


async def test_an_operator_denial_is_audited_with_its_reason() -> None:
    async with harness(FakeClock()) as h:
        thread, approval, _ = await park(h)
        assert h.pump.decide(
            Decision(approval, False, "operator:ops-1", reason="not today")) is None
        await h.run_until_idle()
        assert child(h.frames("alice", thread)[-1], "message") == "not approved"
        kinds = [e.kind for e in await h.kernel.journal(thread=thread)]  # type: ignore[union-attr]
        assert "approval-request" in kinds and "approval-decision" in kinds
        (closed,) = await h.kernel.approvals(state=None)  # type: ignore[union-attr]
        assert (closed.state, closed.decided_by, closed.reason) == (
            "denied", "operator:ops-1", "not today")


async def test_a_gated_listener_reached_through_a_relay() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", PayVia(amount=9))
        assert [tag(f) for f in frames] == ["accepted", "approval-required"]
        thread = child(frames[0], "thread")
        approval, sha = child(frames[1], "approval"), child(frames[1], "payload-sha256")
        frames = await h.send("alice", decision("alice", thread, approval, sha))
        assert [tag(f) for f in frames] == ["accepted", "paid"]
        assert durable.CALLS == [("pay", 9)]


async def test_a_relay_is_told_not_approved() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("alice", PayVia(amount=9))
        thread = child(frames[0], "thread")
        approval = child(frames[1], "approval")
        frames = await h.send("alice", decision("alice", thread, approval, None, approve=False))
        assert [tag(f) for f in frames] == ["accepted", "huh"]
        assert child(frames[-1], "code") == "denied"


async def test_a_profile_gate_covers_its_listeners() -> None:
    async with harness(FakeClock()) as h:
        frames = await h.send("carl", Count())
        assert [tag(f) for f in frames] == ["accepted", "approval-required"]
        frames = await h.send("alice", Count())  # the public profile has no gate
        assert [tag(f) for f in frames] == ["accepted", "counted"]


async def test_pending_approvals_survive_a_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    async with harness(clock, tmp_path) as h:
        thread, approval, sha = await park(h)
    async with harness(clock, tmp_path) as h:
        assert list(h.pump.waits.parked) == [approval]
        frames = await h.send("alice", decision("alice", thread, approval, sha))
        assert [tag(f) for f in frames] == ["accepted", "paid"]
        assert durable.CALLS == [("pay", 7)]


async def test_an_approval_due_while_down_expires_on_restart(tmp_path: Path) -> None:
    clock = FakeClock()
    async with harness(clock, tmp_path) as h:
        thread, _, _ = await park(h)
    clock.now += 3600
    async with harness(clock, tmp_path) as h:
        assert await h.fire_due() == 1
        assert child(h.frames("alice", thread)[-1], "message") == "not approved"
        assert durable.CALLS == []


async def test_a_reload_does_not_change_parked_rules(tmp_path: Path) -> None:
    clock = FakeClock()
    async with harness(clock, tmp_path) as h:
        thread, approval, sha = await park(h)
    # The new configuration: the gate lets operators only, with a short timeout.
    text = ORGANISM.read_text().replace(
        "approval: {approvers: [operator, client], timeout_s: 60}",
        "approval: {approvers: [operator], timeout_s: 1}")
    async with harness(clock, tmp_path, text) as h:
        (parked,) = h.pump.waits.parked.values()
        assert parked.approvers == ("operator", "client")
        clock.now += 30  # past the new timeout, within the parked one
        assert await h.fire_due() == 0
        frames = await h.send("alice", decision("alice", thread, approval, sha))
        assert [tag(f) for f in frames] == ["accepted", "paid"]
    # A gate removed: the parked message still waits for its decision.
    async with harness(clock, tmp_path) as h:
        frames = await h.send("alice", Pay(amount=2))
        thread2 = child(frames[0], "thread")
        approval2 = child(frames[1], "approval")
    text = ORGANISM.read_text().replace(
        "    approval: {approvers: [operator, client], timeout_s: 60}\n", "", 1)
    async with harness(clock, tmp_path, text) as h:
        assert list(h.pump.waits.parked) == [approval2]
        assert durable.CALLS == [("pay", 7)]
        h.pump.decide(Decision(approval2, False, "operator:ops-1"))
        await h.run_until_idle()
        assert child(h.frames("alice", thread2)[-1], "message") == "not approved"


async def test_the_end_of_a_conversation_denies_what_it_parked() -> None:
    async with harness(FakeClock()) as h:
        thread, _, _ = await park(h)
        assert await h.end_conversation(thread)
        assert h.pump.waits.parked == {}
        (closed,) = await h.kernel.approvals(state=None)  # type: ignore[union-attr]
        assert closed.state == "cancelled"
        assert child(h.frames("alice", thread)[-1], "message") == "not approved"


# ---- an agent's tool call into a gated listener ------------------------------------------


@asynccontextmanager
async def gated_agent(script: Callable[[Any], str]) -> AsyncIterator[tuple[Harness, Any]]:
    """The tutor agent of tests/llm_servers.py, on a fake model, with the calculator
    behind an operator-only gate; yields the harness and the fake model server."""
    from agentd.platform import Platform, make_agent_handlers
    from tests.llm_servers import FakeLLM, load, openai_backend, organism_yaml

    async with FakeLLM("openai", script) as server:
        text = organism_yaml(openai_backend(server), agent=", max_iterations: 2").replace(
            "    handler: agentd.tools.calculator:add\n",
            "    handler: agentd.tools.calculator:add\n"
            "    approval: {approvers: [operator]}\n", 1)
        config = load(text)
        platform = Platform.from_config(config)
        handlers = make_agent_handlers(config, platform)
        try:
            async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                               clock=FakeClock()) as h:
                platform.bind_threads(h.pump.registry)
                yield h, server
        finally:
            await platform.aclose()


async def test_an_agents_tool_call_parks_and_the_outcome_is_its_tool_result() -> None:
    from agentd.platform.demo import MathQuestion
    from tests.llm_servers import add_call, values

    def script(seen: Any) -> str:
        got = values(seen.conversation().results)
        if not got:
            return f"Let me add.\n{add_call(2, 40)}"
        return f"The sum is {got[0]}."

    async with gated_agent(script) as (h, server):
        frames = await h.send("alice", MathQuestion(text="What is 2 + 40?"))
        assert [tag(f) for f in frames] == ["accepted", "approval-required"]
        assert len(server.requests) == 1  # the agent waits; no model turn is spent
        thread = child(frames[0], "thread")
        (parked,) = h.pump.waits.parked.values()
        assert parked.listener == "calculator.add" and parked.sender == "tutor"
        assert h.pump.decide(Decision(parked.id, True, "operator:ops-1")) is None
        await h.run_until_idle()
        answer = h.frames("alice", thread)[-1]
        assert tag(answer) == "answer" and child(answer, "text") == "The sum is 42."
        assert len(server.requests) == 2  # within max_iterations: 2


async def test_an_agent_is_told_not_approved_as_its_tool_result() -> None:
    from agentd.platform.demo import MathQuestion
    from tests.llm_servers import add_call

    def script(seen: Any) -> str:
        results = seen.conversation().results
        if not results:
            return f"Let me add.\n{add_call(2, 40)}"
        return "Refused: " + ("yes" if "not approved" in results[0].content else "no")

    async with gated_agent(script) as (h, _):
        frames = await h.send("alice", MathQuestion(text="What is 2 + 40?"))
        thread = child(frames[0], "thread")
        (parked,) = h.pump.waits.parked.values()
        h.pump.decide(Decision(parked.id, False, "operator:ops-1", reason="no"))
        await h.run_until_idle()
        assert child(h.frames("alice", thread)[-1], "text") == "Refused: yes"


def test_listeners_sharing_a_payload_with_different_gates_are_refused() -> None:
    """A message to several listeners is parked once, under one gate: with a
    client-approved listener and an operator-only one on the same payload, the
    client's approval used to release it to both."""
    from agentd._errors import ConfigError
    from agentd._routing import Routing

    text = ORGANISM.read_text().replace(
        "  - name: pay.op\n    payload_class: tests.organisms.durable:PayOp",
        "  - name: pay.op\n    payload_class: tests.organisms.durable:Pay").replace(
        "  ops: {listeners: [pay.op]}", "  ops: {listeners: [pay.op, pay]}")
    config = load_config_text(text, base_dir=ORGANISM.parent)
    with pytest.raises(ConfigError, match=r"goes to pay, pay\.op, whose approval gates differ"):
        Routing.build(config)
    same = text.replace("approval: {approvers: [operator]}",
                        "approval: {approvers: [client, operator], timeout_s: 60}")
    Routing.build(load_config_text(same, base_dir=ORGANISM.parent))  # the same gate: one park


async def test_a_conversation_waiting_for_an_approval_is_never_pushed_out_of_memory() -> None:
    """A conversation whose message is parked stays in progress: pushed out of the
    rest set by other conversations, it used to end, and its approval was denied."""
    clock = FakeClock()
    async with harness(clock) as h:
        h.pump.registry.max_resting = 2
        frames = await h.send("alice", Pay(amount=5))
        assert tag(frames[-1]) == "approval-required"
        thread = etree.fromstring(frames[0])[1].findtext("{*}thread")
        await h.send("alice", Count(by=1), thread=thread)  # handled: the conversation is idle
        for _ in range(5):
            await h.send("bob", Count(by=1))
        assert h.pump.registry.get(thread) is not None
        assert len(h.pump.waits.parked) == 1
        assert not any(b"not approved" in f for f in h.frames("alice", thread))


async def test_a_peer_organism_gets_the_outcome_not_approval_required() -> None:
    """A gateway's call into a gated exported listener: the peer takes anything sent
    on the call's thread as the call's answer, so `approval-required` made its call
    fail while the approved handler still ran later. The peer is sent the outcome
    alone."""
    clock = FakeClock()
    async with harness(clock, gateways=frozenset({"alice"})) as h:  # alice: a peer organism
        frames = await h.send("alice", Pay(amount=9))
        assert [tag(f) for f in frames] == ["accepted"]
        (parked,) = h.pump.waits.parked.values()
        assert h.pump.decide(Decision(parked.id, True, "operator:ops-1")) is None
        await h.run_until_idle()
        thread = child(frames[0], "thread")
        assert [tag(f) for f in h.frames("alice", thread)] == ["accepted", "paid"]
        assert durable.CALLS == [("pay", 9)]


@pytest.mark.parametrize("via_relay", [False, True])
async def test_a_pending_message_for_a_listener_gated_since_is_parked_on_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via_relay: bool) -> None:
    """Accepted while `pay` had no gate (from the client, or from `pay.relay`), then
    the daemon stopped before `pay` ran; it starts again with a gate on `pay`: the
    message waits for approval like any new one (it ran unapproved before), and runs
    once when approved, its answer going where it would have gone."""
    clock = FakeClock()
    ungated = ORGANISM.read_text().replace(
        "    approval: {approvers: [operator, client], timeout_s: 60}\n", "", 1)
    thread = "7f1d3c52-0a6b-4c53-9d2e-5d2d8a7f0e11"
    monkeypatch.setenv("AGENTD_TEST_PAY", "block")
    async with harness(clock, tmp_path, ungated) as h:
        payload = PayVia(amount=5) if via_relay else Pay(amount=5)
        assert (await h.pump.submit("alice", build_envelope("alice", thread,
                                                            to_xml(payload)))).accepted
        for _ in range(1000):  # until the request for `pay` is journaled (pay blocks)
            await h.kernel.flush()  # type: ignore[union-attr]
            pending = await h.kernel.pending_messages()  # type: ignore[union-attr]
            if any(e.tag.endswith("}pay") for e in pending):
                break
        else:
            raise AssertionError("pay never reached")
    monkeypatch.delenv("AGENTD_TEST_PAY")
    async with harness(clock, tmp_path) as h:
        await h.run_until_idle()
        assert durable.CALLS == []
        required = h.frames("alice", thread)[-1]
        assert tag(required) == "approval-required"
        assert list(h.pump.waits.parked) == [child(required, "approval")]
        assert not any(e.tag.endswith("}pay")
                       for e in await h.kernel.pending_messages())  # type: ignore[union-attr]
        frames = await h.send("alice", decision("alice", thread, child(required, "approval"),
                                                child(required, "payload-sha256")))
        assert [tag(f) for f in frames] == ["accepted", "paid"]
        assert durable.CALLS == [("pay", 5)]


async def test_an_approved_message_pending_at_a_restart_runs_without_asking_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setenv("AGENTD_TEST_PAY", "block")
    async with harness(clock, tmp_path) as h:
        thread, approval, sha = await park(h)
        assert (await h.pump.submit("alice", decision("alice", thread, approval, sha))).accepted
        await h.kernel.flush()  # type: ignore[union-attr]  # the approval committed
        assert h.pump.waits.parked == {}
    monkeypatch.delenv("AGENTD_TEST_PAY")
    async with harness(clock, tmp_path) as h:
        await h.run_until_idle()
        assert durable.CALLS == [("pay", 7)]
        assert tag(h.frames("alice", thread)[-1]) == "paid"
        assert h.pump.waits.parked == {}
