"""The caller side of federation, piece by piece: offers and their digests, pins on
disk, classes made from a peer's XSD, the calls in flight to one gateway, and what
a remote listener does with a peer's reply (a hostile peer's included). The frames
a `RemoteCalls` sends are recorded instead of crossing a link."""

from __future__ import annotations

import asyncio
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from agentd._envelope import build_envelope
from agentd._errors import HuhCode
from agentd._handler import ChainStopped, HandlerMetadata, ResponseKind
from agentd._xmlify import from_xml, spec_of, to_xml, xsd_of
from agentd.federation._calls import call_thread
from agentd.federation._remote import (
    HOLD_S,
    OUTGOING,
    Offer,
    OfferError,
    RemoteCall,
    RemoteCalls,
    calls_for,
    class_of_xsd,
    load_pins,
    save_pins,
)
from agentd.tools.calculator import Add, Sum
from agentd.tools.echo import Echo, EchoReply

ADD = Offer("calculator.add", "Adds two integers.", (xsd_of(Add),), (xsd_of(Sum),))
ECHO = Offer("echo", "Echoes text back.", (xsd_of(Echo),), (xsd_of(EchoReply),))


class Link:
    """Records what a `RemoteCalls` sends; `up` says whether a link would take it."""

    def __init__(self) -> None:
        self.frames: list[dict[str, object]] = []
        self.events: list[tuple[str, dict[str, str]]] = []
        self.up = True

    def send(self, frame: dict[str, object]) -> bool:
        if self.up:
            self.frames.append(frame)
        return self.up

    def audit(self, kind: str, fields: Any) -> None:
        self.events.append((kind, dict(fields)))

    def kinds(self) -> list[object]:
        return [f["t"] for f in self.frames]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- offers and pins -------------------------------------------------------------


def element(payload: Any) -> etree._Element:
    """A payload as the pump hands it to a remote listener: the validated element."""
    return etree.fromstring(to_xml(payload))


def test_an_offer_survives_json_and_its_digest_covers_every_part() -> None:
    again = Offer.from_json(ADD.to_json())
    assert again == ADD and again.digest == ADD.digest
    for changed in (Offer(ADD.name, "Adds.", ADD.payloads, ADD.responses),
                    Offer(ADD.name, ADD.description, ADD.payloads, (xsd_of(EchoReply),))):
        assert changed.digest != ADD.digest


@pytest.mark.parametrize("bad", [
    None, [], {"name": "x"}, {"name": "x", "description": "", "payloads": [], "responses": ["a"]},
    {"name": "x", "description": "", "payloads": ["a"] * 9, "responses": ["a"]},
    {"name": "x", "description": "", "payloads": ["a" * 70000], "responses": ["a"]},
    {"name": 1, "description": "", "payloads": ["a"], "responses": ["a"]},
])
def test_a_malformed_offer_is_refused(bad: Any) -> None:
    with pytest.raises(OfferError):
        Offer.from_json(bad)


def test_pins_are_written_whole_and_private(tmp_path: Path) -> None:
    assert load_pins(tmp_path) == {}
    save_pins(tmp_path, {"beta": {"calculator.add": ADD}})
    path = tmp_path / "federation-pins.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_pins(tmp_path) == {"beta": {"calculator.add": ADD}}
    path.write_text("{not json")
    with pytest.raises(OfferError):
        load_pins(tmp_path)


# ---- classes from a peer's XSD -----------------------------------------------------


def test_the_same_xsd_reuses_the_local_class_and_a_different_one_is_refused() -> None:
    assert class_of_xsd(xsd_of(Add), {spec_of(Add).key: Add}) is Add
    other = xsd_of(Add).replace('name="b"', 'name="c"')
    with pytest.raises(OfferError, match="different schema"):
        class_of_xsd(other, {spec_of(Add).key: Add})


def test_a_class_made_from_an_xsd_has_the_peers_root_and_shape() -> None:
    made = class_of_xsd(xsd_of(Add), {})
    assert made is not Add
    assert spec_of(made).key == spec_of(Add).key
    payload = from_xml(made, to_xml(Add(a=2, b=3)))
    assert (payload.a, payload.b) == (2, 3)


def test_an_xsd_that_is_not_one_is_refused() -> None:
    with pytest.raises(OfferError):
        class_of_xsd("<nothing/>", {})


@pytest.mark.parametrize("reference", [
    '<xs:include schemaLocation="/etc/passwd"/>',
    '<xs:import namespace="urn:x" schemaLocation="/run/agentd/fifo"/>',
    '<xs:redefine schemaLocation="file:///etc/hostname"/>',
    '<xs:override schemaLocation="/dev/zero"/>',
])
def test_a_peers_xsd_that_refers_to_other_documents_is_refused(reference: str) -> None:
    """Compiling it would read this host's files (a FIFO would hang the daemon)."""
    xsd = xsd_of(Add)
    at = xsd.index(">", xsd.index("<xs:schema")) + 1
    with pytest.raises(OfferError, match="refers to other documents"):
        class_of_xsd(xsd[:at] + reference + xsd[at:], {})


def test_a_peers_xsd_with_a_doctype_is_refused() -> None:
    with pytest.raises(OfferError):
        class_of_xsd('<!DOCTYPE x [<!ENTITY e SYSTEM "/etc/passwd">]>' + xsd_of(Add), {})


# ---- calls in flight ----------------------------------------------------------------


async def test_a_call_goes_out_is_accepted_and_answered() -> None:
    link = Link()
    calls = RemoteCalls("beta", link.send, link.audit)
    task = asyncio.create_task(calls.call("c1", "t1", "<env/>"))
    await asyncio.sleep(0)
    assert link.frames == [{"t": "call", "id": "c1", "envelope": "<env/>"}]
    calls.accepted("c1", "t1")
    calls.link_up()  # accepted: the peer answers from its outbox, no second call
    assert link.kinds() == ["call"]
    calls.reply(7, "t1", "<reply/>")
    assert await task == (7, "<reply/>")
    assert calls.in_flight == 0


async def test_a_call_made_while_the_link_is_down_goes_at_the_next_link_up() -> None:
    link = Link()
    link.up = False
    calls = RemoteCalls("beta", link.send, link.audit)
    task = asyncio.create_task(calls.call("c1", "t1", "<env/>"))
    await asyncio.sleep(0)
    assert link.frames == []
    link.up = True
    calls.link_up()
    calls.link_up()  # not accepted yet: sent again on every new link, marked so
    assert link.kinds() == ["call", "call"]
    assert "again" not in link.frames[0] and link.frames[1]["again"] is True
    calls.refused("c1", "unroutable")
    with pytest.raises(Exception, match="unroutable"):
        await task


async def test_an_unknown_refusal_code_is_internal_and_stray_frames_change_nothing() -> None:
    link = Link()
    calls = RemoteCalls("beta", link.send, link.audit)
    task = asyncio.create_task(calls.call("c1", "t1", "<env/>"))
    await asyncio.sleep(0)
    calls.accepted("c1", "another-thread")  # not this call's thread: ignored
    calls.accepted("nobody", "t1")
    calls.refused("nobody", "denied")
    calls.refused("c1", "whatever")
    with pytest.raises(Exception) as caught:
        await task
    assert getattr(caught.value, "code", None) is HuhCode.INTERNAL


async def test_a_reply_before_its_call_is_held_then_used_and_a_second_reply_acknowledged() -> None:
    link = Link()
    calls = RemoteCalls("beta", link.send, link.audit)
    calls.reply(3, "t1", "<early/>")  # a redelivered call has not run again yet
    assert await calls.call("c1", "t1", "<env/>", again=True) == (3, "<early/>")
    assert link.frames == []  # answered: never sent again
    task = asyncio.create_task(calls.call("c2", "t2", "<env/>"))
    await asyncio.sleep(0)
    calls.reply(4, "t2", "<first/>")
    calls.reply(5, "t2", "<second/>")
    assert await task == (4, "<first/>")
    assert {"t": "ack", "id": 5} in link.frames


async def test_a_reply_to_a_call_never_sent_does_not_answer_it() -> None:
    """A peer that works out a future call's thread cannot answer it before it is
    made: a held reply answers only a call that may have been sent before (again)."""
    link = Link()
    calls = RemoteCalls("beta", link.send, link.audit)
    calls.reply(3, "t1", "<pre-answered/>")
    task = asyncio.create_task(calls.call("c1", "t1", "<env/>"))
    await asyncio.sleep(0)
    assert link.frames == [{"t": "ack", "id": 3},  # dropped, and the peer told so
                           {"t": "call", "id": "c1", "envelope": "<env/>"}]
    calls.reply(4, "t1", "<real/>")
    assert await task == (4, "<real/>")


async def test_a_call_tells_the_peer_how_many_hops_its_chain_has_made() -> None:
    link = Link()
    calls = RemoteCalls("beta", link.send, link.audit)
    task = asyncio.create_task(calls.call("c1", "t1", "<env/>", hops=3))
    await asyncio.sleep(0)
    assert link.frames == [{"t": "call", "id": "c1", "envelope": "<env/>", "hops": 3}]
    calls.reply(4, "t1", "<r/>")
    assert await task == (4, "<r/>")


def test_a_reply_nobody_waits_for_is_acknowledged_after_the_hold() -> None:
    link, clock = Link(), Clock()
    calls = RemoteCalls("beta", link.send, link.audit, clock=clock)
    calls.reply(9, "t9", "<stale/>")
    assert calls.sweep() == 0 and link.frames == []
    clock.now += HOLD_S + 1
    assert calls.sweep() == 1
    assert link.frames == [{"t": "ack", "id": 9}]


# ---- a remote listener and a peer's reply ---------------------------------------------


def meta(seq: int = 4) -> HandlerMetadata:
    return HandlerMetadata(str(uuid.uuid4()), "alice", "beta:calculator.add", False, "",
                           None, "3f2a9c1e-0000-4000-8000-000000000001", None, seq)


@pytest.fixture
def gateway() -> Any:
    link = Link()
    calls = calls_for("beta-units")
    calls.adopt(link.send, link.audit)
    calls.imports["calculator.add"] = "pinned"
    yield link, calls
    OUTGOING.pop("beta-units", None)


async def answer_with(gateway: Any, reply: bytes | None, seq: int = 4, **kw: Any) -> Any:
    link, calls = gateway
    handler = RemoteCall("alpha", "beta-units", "calculator.add", ADD, 262144)
    m = meta(seq)
    task = asyncio.create_task(handler(element(Add(a=1, b=2)), m))
    await asyncio.sleep(0)
    call = link.frames[-1]
    assert call["t"] == "call"
    thread = call_thread("alpha", str(call["id"]))
    if reply is None:
        calls.refused(str(call["id"]), kw["code"])
    else:
        env = build_envelope(kw.get("sender", "calculator.add"), kw.get("thread", thread), reply)
        calls.reply(11, thread, env.decode())
    return call, await task, m


async def test_the_call_id_is_stable_for_a_redelivered_message(gateway: Any) -> None:
    first, response, m = await answer_with(gateway, to_xml(Sum(value=3)))
    again, _, _ = await answer_with(gateway, to_xml(Sum(value=3)))
    assert first["id"] == again["id"]
    # Opaque: neither the client's conversation UUID nor the journal seq shows.
    assert m._conversation not in first["id"] and len(first["id"]) == 32
    assert response.kind is ResponseKind.RESPOND
    assert from_xml(Sum, response.payload).value == 3
    link, _ = gateway
    assert {"t": "ack", "id": 11} not in link.frames  # only once the answer is committed
    m._after_commit()
    assert link.frames[-1] == {"t": "ack", "id": 11}


@pytest.mark.parametrize(("reply", "kw"), [
    (to_xml(EchoReply(text="not a sum")), {}),  # a root the pin does not allow
    (b'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>x</value></sum>', {}),
    (to_xml(Sum(value=3)), {"thread": str(uuid.uuid4())}),  # another call's thread
    (to_xml(Sum(value=3)), {"sender": "admin"}),  # not the listener called
])
async def test_a_reply_outside_the_pin_is_refused_as_a_security_event(
    gateway: Any, reply: bytes, kw: dict[str, str]
) -> None:
    link, _ = gateway
    _, response, m = await answer_with(gateway, reply, **kw)
    assert response.kind is ResponseKind.ERROR
    assert response.error_code is HuhCode.INVALID_PAYLOAD
    assert link.events[-1][0] == "federation-reply-refused"
    m._after_commit()  # acknowledged anyway: the peer does not send it forever
    assert link.frames[-1] == {"t": "ack", "id": 11}


async def test_a_peers_huh_and_refusal_become_the_same_huh_here(gateway: Any) -> None:
    huh = (b'<huh xmlns="https://xml-pipeline.org/ns/core/v1"><code>budget-exceeded</code>'
           b"<message>x</message><retry-allowed>false</retry-allowed></huh>")
    _, response, _ = await answer_with(gateway, huh)
    assert response.error_code is HuhCode.BUDGET_EXCEEDED
    _, response, _ = await answer_with(gateway, huh.replace(b"budget-exceeded", b"denied"),
                                       sender="core")  # the peer's platform
    assert response.error_code is HuhCode.DENIED
    _, response, _ = await answer_with(gateway, to_xml(Sum(value=1)), sender="core")
    assert response.error_code is HuhCode.INVALID_PAYLOAD  # only a huh may come from core
    _, response, _ = await answer_with(gateway, None, code="denied")
    assert response.error_code is HuhCode.DENIED


@pytest.mark.parametrize("said", ["true", "false"])
async def test_a_peers_huh_keeps_the_retry_allowed_it_said(gateway: Any, said: str) -> None:
    """The caller is told what the callee logged (the demo's cassette miss says false)."""
    huh = (b'<huh xmlns="https://xml-pipeline.org/ns/core/v1"><code>internal</code>'
           b"<message>x</message><retry-allowed>" + said.encode() + b"</retry-allowed></huh>")
    _, response, _ = await answer_with(gateway, huh)
    assert response.error_code is HuhCode.INTERNAL
    assert response.retry_allowed is (said == "true")


async def test_a_peer_stopping_the_chain_stops_it_here_too(gateway: Any) -> None:
    """The peer refused the call at its hop limit, or its platform stopped the chain
    inside (a `budget-exceeded` from its core): the chain crossing the two organisms
    stops here as one that stays home does, and the client is told. As a `huh` for
    the calling listener it went no further (the client waited for ever)."""
    huh = (b'<huh xmlns="https://xml-pipeline.org/ns/core/v1"><code>budget-exceeded</code>'
           b"<message>x</message><retry-allowed>false</retry-allowed></huh>")
    _, response, _ = await answer_with(gateway, None, code="budget-exceeded")
    assert response == ChainStopped(HuhCode.BUDGET_EXCEEDED)
    _, response, _ = await answer_with(gateway, huh, sender="core")
    assert response == ChainStopped(HuhCode.BUDGET_EXCEEDED)


async def test_a_changed_or_missing_import_is_unroutable_without_a_call(gateway: Any) -> None:
    link, calls = gateway
    calls.imports["calculator.add"] = "changed"
    handler = RemoteCall("alpha", "beta-units", "calculator.add", ADD, 262144)
    response = await handler(element(Add(a=1, b=2)), meta())
    assert response.error_code is HuhCode.UNROUTABLE
    assert link.frames == []


async def test_a_peers_agent_may_answer_with_text_and_nothing_else_may(gateway: Any) -> None:
    """A callable organism: the peer exported an agent, whose final answer is core
    `answer` text. Only an offer that says so lets that root through."""
    answer = b'<answer xmlns="https://xml-pipeline.org/ns/core/v1"><text>five</text></answer>'
    _, response, _ = await answer_with(gateway, answer)
    assert response.error_code is HuhCode.INVALID_PAYLOAD  # `calculator.add` is no agent
    agent = Offer("tutor", "Answers questions.", (xsd_of(Add),), (), answers=True)
    assert Offer.from_json(agent.to_json()) == agent
    link, calls = gateway
    calls.imports["tutor"] = "pinned"
    handler = RemoteCall("alpha", "beta-units", "tutor", agent, 262144)
    task = asyncio.create_task(handler(element(Add(a=2, b=3)), meta()))
    await asyncio.sleep(0)
    thread = call_thread("alpha", str(link.frames[-1]["id"]))
    calls.reply(12, thread, build_envelope("tutor", thread, answer).decode())
    response = await task
    assert response.kind is ResponseKind.RESPOND and b"<text>five</text>" in response.payload


def test_a_pinned_peer_listener_is_in_an_agents_tool_definitions(tmp_path: Path) -> None:
    """A callable organism's listener is a tool like a local one: its pinned
    payload's example and description reach the agent's `{tool_definitions}`."""
    from agentd.platform import PromptRegistry
    from tests.fixtures_config import Greeting, Relay
    from tests.llm_servers import load, organism_yaml
    from tests.test_platform import REPLAY

    offer = Offer("greeter", "Greets someone by name.", (xsd_of(Greeting),), (xsd_of(Relay),))
    save_pins(tmp_path, {"beta": {"greeter": offer}})
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGx2dW1teWtleWR1bW15a2V5ZHVtbXlrZXlkdW0x beta"
    text = organism_yaml(REPLAY, peers='[calculator.add, "beta:greeter"]') + f"""
state_dir: {tmp_path}
identity: {{key: identity.key}}
federation: {{listen: "127.0.0.1:0", tls: {{cert: cert.pem, key: key.pem}}}}
gateways:
  - {{name: beta, public_key: "{key}", url: "wss://127.0.0.1:1/federation",
      import: [greeter]}}
"""
    from agentd.federation import with_remote_listeners

    config = with_remote_listeners(load(text))  # the daemon's wiring adds them
    remote = config.listener("beta:greeter")
    assert remote.handler_ref == f"federation:beta:greeter:{offer.digest}"
    core = PromptRegistry.build(config).get("tutor").core
    # Listed under its provider tool name (`:` maps to `--`), then the listener's.
    assert "### beta--greeter (beta:greeter): Listener greeter of the peer organism beta." \
        in core
    assert "[Third-party text from the tool's server" in core  # the peer's own words
    assert "<<<Greets someone by name.>>>" in core
    assert f'<greeting xmlns="{spec_of(Greeting).namespace}">' in core


def test_a_peer_flooding_stray_replies_is_held_to_a_bound() -> None:
    """Replies for no call in flight are held (a redelivered call may claim one) up
    to `MAX_HELD`; past it the oldest is acknowledged and dropped."""
    from agentd.federation._remote import MAX_HELD

    link, clock = Link(), Clock()
    calls = RemoteCalls("beta", link.send, link.audit, clock=clock)
    for i in range(MAX_HELD + 3):
        clock.now += 0.001
        calls.reply(i, f"t{i}", "<stray/>")
    assert link.frames == [{"t": "ack", "id": i} for i in range(3)]
    clock.now += 0.001
    calls.reply(MAX_HELD + 3, "t", "<stray/>")  # the oldest still held goes next
    assert link.frames[3:] == [{"t": "ack", "id": 3}]


def test_offers_are_weighed_against_the_pins() -> None:
    from agentd.federation._remote import weigh_offers

    changed = Offer(ADD.name, "Adds, differently.", ADD.payloads, ADD.responses)
    shadow = Offer("other", "", (xsd_of(Add).replace('name="b"', 'name="c"'),), ADD.responses)
    weighed = weigh_offers(
        ["calculator.add", "echo", "missing", "other"],
        [changed.to_json(), ECHO.to_json(), shadow.to_json(), {"not": "an offer"}],
        {"calculator.add": ADD}, {spec_of(Add).key: Add})
    assert weighed.states == {"calculator.add": "changed", "echo": "pinned",
                              "missing": "not-offered", "other": "not-offered"}
    assert weighed.changed == {"calculator.add": changed}
    assert weighed.new == {"echo": ECHO}
    assert len(weighed.bad) == 2  # the shadowing schema and the malformed item


def test_a_declared_digest_takes_that_offer_at_once_and_no_other() -> None:
    from agentd.federation._remote import weigh_offers

    changed = Offer(ADD.name, "Adds, differently.", ADD.payloads, ADD.responses)
    local = {spec_of(Add).key: Add}
    items = [changed.to_json(), ECHO.to_json()]
    # declared = what is offered: pinned now, even over a different stored pin
    weighed = weigh_offers(["calculator.add", "echo"], items, {"calculator.add": ADD}, local,
                           {"calculator.add": changed.digest, "echo": ECHO.digest})
    assert weighed.states == {"calculator.add": "pinned", "echo": "pinned"}
    assert weighed.new == {"calculator.add": changed, "echo": ECHO} and not weighed.changed
    # declared != offered: refused, never pinned, not left for a reload to accept
    weighed = weigh_offers(["calculator.add", "echo"], items, {}, local,
                           {"calculator.add": ADD.digest})
    assert weighed.states == {"calculator.add": "mismatch", "echo": "pinned"}
    assert weighed.mismatched == {"calculator.add": changed}
    assert weighed.new == {"echo": ECHO} and not weighed.changed


def test_schema_pins_name_imports_and_are_sha256(tmp_path: Path) -> None:
    from agentd._errors import ConfigError
    from tests.llm_servers import load, organism_yaml
    from tests.test_platform import REPLAY

    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGx2dW1teWtleWR1bW15a2V5ZHVtbXlrZXlkdW0x beta"

    def gateway(pins: str) -> str:
        return organism_yaml(REPLAY) + f"""
state_dir: {tmp_path}
identity: {{key: identity.key}}
federation: {{listen: "127.0.0.1:0", tls: {{cert: cert.pem, key: key.pem}}}}
gateways:
  - {{name: beta, public_key: "{key}", url: "wss://127.0.0.1:1/federation",
      import: [greeter], schema_pins: {pins}}}
"""

    config = load(gateway(f"{{greeter: {'a' * 64}}}"))
    assert config.gateways[0].schema_pins == {"greeter": "a" * 64}
    with pytest.raises(ConfigError, match="'other' is not in this gateway's import"):
        load(gateway(f"{{other: {'a' * 64}}}"))
    with pytest.raises(ConfigError, match="schema_pins"):
        load(gateway("{greeter: ABC}"))
