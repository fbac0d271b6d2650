"""The pump, end to end through the Harness: routing, identity injection, zero-trust
re-entry, threads, scheduling and containment of hostile handlers."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from agentd._core import Ack, Huh
from agentd._envelope import NIL_THREAD, build_envelope, parse_envelope
from agentd._errors import GENERIC_MESSAGES, HuhCode
from agentd._handler import ChainStopped, HandlerResponse
from agentd._xmlify import spec_of, to_xml
from agentd.client import frame_kind
from agentd.config import OrganismConfig, load_config_text
from agentd.pump import dispatch as dispatch_module
from agentd.testing import Harness
from agentd.tools.calculator import Add
from agentd.tools.relay import Relay
from tests.organisms import listeners as L

ORGANISM = Path(__file__).parent / "organisms" / "basic.yaml"
CLIENTS = {"alice": "public", "bob": "public", "nina": "narrow", "root": "admin"}


@pytest.fixture(autouse=True)
def _reset() -> None:
    L.SEEN.clear()
    L.STATE.update(running=0, peak=0)


@pytest.fixture
async def h():
    async with Harness.from_config(ORGANISM, clients=CLIENTS) as harness:
        yield harness


Events = list[tuple[str, dict[str, str]]]


@pytest.fixture
async def watched():
    """A harness and the security events its pump reported."""
    events: Events = []
    async with Harness.from_config(ORGANISM, clients=CLIENTS, on_security=lambda kind, fields:
                                   events.append((kind, dict(fields)))) as harness:
        yield harness, events


def kinds(frames: list[bytes]) -> list[tuple[str, str]]:
    """(sender, payload local name) of each frame."""
    return [frame_kind(f)[:2] for f in frames]


def field(frame: bytes, name: str) -> str:
    env = parse_envelope(frame)
    for child in env.payload:
        if child.tag.split("}")[1] == name:
            return child.text or ""
    raise KeyError(name)


def envelope(sender: str, payload: bytes, thread: str | None = None, to: str | None = None):
    return build_envelope(sender, thread or str(uuid.uuid4()), payload, to=to)


ADD = b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>2</a><b>3</b></add>'


# ---- the happy paths ---------------------------------------------------------


async def test_request_is_accepted_then_answered_on_the_same_thread(h: Harness) -> None:
    thread = str(uuid.uuid4())
    frames = await h.send("alice", envelope("alice", ADD, thread))
    assert kinds(frames) == [("core", "accepted"), ("calculator.add", "sum")]
    assert all(parse_envelope(f).thread == thread for f in frames)
    assert field(frames[1], "value") == "5"
    assert parse_envelope(frames[1]).to == "alice"


async def test_payload_object_is_wrapped_on_a_new_thread(h: Harness) -> None:
    frames = await h.send("alice", Add(a=40, b=2))
    assert kinds(frames)[-1] == ("calculator.add", "sum")
    assert field(frames[-1], "value") == "42"


async def test_respond_returns_up_the_call_chain(h: Harness) -> None:
    frames = await h.send("alice", Relay(a=20, b=22))
    # The calculator answers the relay; the relay answers alice.
    assert kinds(frames) == [("core", "accepted"), ("relay", "sum")]
    assert field(frames[1], "value") == "42"


async def test_egress_is_in_exclusive_c14n_form(h: Harness) -> None:
    from agentd._xml import c14n, parse_untrusted

    frames = await h.send("alice", Add(a=1, b=2))
    for f in frames:
        assert c14n(parse_untrusted(f)) == f


# ---- ingress checks ----------------------------------------------------------------


async def test_malformed_xml_gets_huh_malformed_on_no_thread(h: Harness) -> None:
    frames = await h.send("alice", b"<message><unclosed>")
    assert kinds(frames) == [("core", "huh")]
    assert field(frames[0], "code") == "malformed"
    assert parse_envelope(frames[0]).thread == NIL_THREAD


async def test_forged_from_on_ingress_is_rejected(h: Harness) -> None:
    frames = await h.send("alice", envelope("bob", ADD))
    assert field(frames[0], "code") == "invalid-envelope"
    assert len(frames) == 1


async def test_envelope_with_two_payloads_is_invalid(h: Harness) -> None:
    data = envelope("alice", ADD + ADD)
    frames = await h.send("alice", data)
    assert field(frames[0], "code") == "invalid-envelope"


async def test_invalid_payload_gets_invalid_payload(h: Harness) -> None:
    bad = b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>x</a><b>3</b></add>'
    frames = await h.send("alice", envelope("alice", bad))
    assert kinds(frames) == [("core", "huh")]
    assert field(frames[0], "code") == "invalid-payload"


async def test_unroutable_and_out_of_profile_give_the_identical_huh(h: Harness) -> None:
    nowhere = b'<nothing xmlns="https://example.org/ns/none"><x>1</x></nothing>'
    secret = b'<secret xmlns="https://xml-pipeline.org/ns/test/secret/v1"><text>hi</text></secret>'
    thread = str(uuid.uuid4())
    a = await h.send("alice", envelope("alice", nowhere, thread))
    b = await h.send("alice", envelope("alice", secret, thread))
    assert field(a[0], "code") == field(b[0], "code") == "unroutable"
    assert a == b  # byte for byte: nothing distinguishes "absent" from "forbidden"
    assert "vault" not in L.SEEN


async def test_admin_profile_reaches_what_public_cannot(h: Harness) -> None:
    secret = b'<secret xmlns="https://xml-pipeline.org/ns/test/secret/v1"><text>hi</text></secret>'
    frames = await h.send("root", envelope("root", secret))
    assert kinds(frames)[-1] == ("vault", "secret")


async def test_to_narrows_delivery_but_never_widens_it(h: Harness) -> None:
    work = b'<work xmlns="https://xml-pipeline.org/ns/test/work/v1"><seq>1</seq></work>'
    frames = await h.send("alice", envelope("alice", work, to="worker.b"))
    assert kinds(frames)[1:] == [("worker.b", "done")]
    frames = await h.send("alice", envelope("alice", work, to="vault"))
    assert field(frames[0], "code") == "unroutable"


async def test_thread_of_another_client_is_unroutable(h: Harness) -> None:
    thread = str(uuid.uuid4())
    await h.send("alice", envelope("alice", ADD, thread))
    frames = await h.send("bob", envelope("bob", ADD, thread))
    assert kinds(frames) == [("core", "huh")]
    assert field(frames[0], "code") == "unroutable"


async def test_privileged_payload_on_the_bus_is_dropped(h: Harness) -> None:
    priv = b'<privileged xmlns="https://xml-pipeline.org/ns/privileged/v1"><x/></privileged>'
    frames = await h.send("root", envelope("root", priv))
    assert field(frames[0], "code") == "unroutable"


async def test_whitespace_and_prefixes_in_meta_do_not_change_the_outcome(h: Harness) -> None:
    thread = str(uuid.uuid4())
    plain = envelope("alice", ADD, thread)
    fancy = (
        b'<e:message xmlns:e="https://xml-pipeline.org/ns/envelope/v1">\n  <e:meta>\n'
        b"    <e:from>alice</e:from>\n    <e:thread>" + thread.encode() + b"</e:thread>\n"
        b"  </e:meta>\n"
        b'  <c:add xmlns:c="https://xml-pipeline.org/ns/calculator/add/v1"><c:a>2</c:a>'
        b"<c:b>3</c:b></c:add>\n</e:message>"
    )
    a = await h.send("alice", plain)
    b = await h.send("alice", fancy)
    assert kinds(a) == kinds(b) == [("core", "accepted"), ("calculator.add", "sum")]
    assert a[1] == b[1]


# ---- handler output is untrusted -----------------------------------------------


async def order(h: Harness, kind: str, client: str = "alice") -> list[bytes]:
    body = f'<order xmlns="https://xml-pipeline.org/ns/test/order/v1"><kind>{kind}</kind></order>'
    return await h.send(client, envelope(client, body.encode()))


def hostile_inbox() -> list[object]:
    return [p for p, _meta in L.SEEN.get("hostile-in", [])]


async def test_silence_makes_the_pump_ack_the_sender(h: Harness) -> None:
    frames = await order(h, "silence")
    assert kinds(frames) == [("core", "accepted"), ("core", "ack")]
    assert field(frames[1], "thread") == parse_envelope(frames[0]).thread


async def test_raising_handler_is_contained_with_a_generic_internal_huh(h: Harness) -> None:
    frames = await order(h, "raise")
    assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
    assert field(frames[1], "code") == "internal"
    assert b"shadow" not in frames[1] and b"RuntimeError" not in frames[1]
    # The pump keeps running.
    assert kinds(await h.send("alice", Add(a=1, b=1)))[-1] == ("calculator.add", "sum")


async def test_hanging_handler_is_cancelled_and_its_sender_told_timeout(h: Harness) -> None:
    frames = await order(h, "hang")
    assert kinds(frames)[-1] == ("core", "huh")
    assert field(frames[-1], "code") == "timeout"


async def test_to_outside_peers_is_blocked_with_a_generic_error(h: Harness) -> None:
    frames = await order(h, "non-peer", client="root")  # even in a profile that has vault
    assert "vault" not in L.SEEN
    inbox = hostile_inbox()
    assert inbox == [Huh(HuhCode.UNROUTABLE, GENERIC_MESSAGES[HuhCode.UNROUTABLE], True)]
    assert kinds(frames) == [("core", "accepted")]  # the thread stays alive, nothing leaks


async def test_unknown_target_and_non_peer_look_the_same_to_the_handler(h: Harness) -> None:
    await order(h, "non-peer", client="root")
    await order(h, "unknown-target", client="root")
    a, b = hostile_inbox()
    assert a == b


async def test_forged_envelope_in_handler_output_is_refused(h: Harness) -> None:
    await order(h, "forged-envelope")
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.INVALID_ENVELOPE
    assert "calculator.add" not in {m.from_id for _, m in L.SEEN.get("hostile-in", [])}


async def test_from_of_handler_output_is_set_by_the_pump(h: Harness) -> None:
    await order(h, "send-work")
    assert L.SEEN["work-from"] == ["hostile"]
    ((done, meta),) = L.SEEN["hostile-in"]
    assert done == L.Done(seq=7, by="a") and meta.from_id == "worker.a"


async def test_forged_from_attribute_in_handler_output_is_refused(h: Harness) -> None:
    await order(h, "forged-from")
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.INVALID_PAYLOAD
    assert "work-from" not in L.SEEN


async def test_multi_payload_output_fans_out_one_envelope_each(h: Harness) -> None:
    await order(h, "multi")
    sums = sorted(p.value for p in hostile_inbox())  # type: ignore[attr-defined]
    assert sums == [3, 7, 11]


async def test_well_formed_raw_output_is_not_parsed_a_second_time(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pump parsed the handler's bytes to split them; the envelopes it builds
    # around the elements are adopted (checked, not parsed again).
    parsed: list[bytes] = []
    real = dispatch_module.parse_built_envelope

    def counting(data: bytes, **limits: object) -> object:
        parsed.append(data)
        return real(data, **limits)  # type: ignore[arg-type]

    monkeypatch.setattr(dispatch_module, "parse_built_envelope", counting)
    await order(h, "multi")
    assert sorted(p.value for p in hostile_inbox()) == [3, 7, 11]  # type: ignore[attr-defined]
    assert not [d for d in parsed if b"calculator/add/v1" in d]


async def test_invalid_handler_output_never_reaches_the_next_handler(h: Harness) -> None:
    await order(h, "invalid-output")
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.INVALID_PAYLOAD


async def test_answer_of_an_undeclared_class_is_refused_to_its_maker(h: Harness) -> None:
    frames = await order(h, "wrong-response-class")
    assert kinds(frames) == [("core", "accepted")]
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.INVALID_PAYLOAD


async def test_privileged_payload_from_a_handler_is_refused(h: Harness) -> None:
    await order(h, "priv")
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.UNROUTABLE


# Bytes with a privileged element deep inside; an object of a class declared in the
# privileged namespace (serialised by the pump, not the handler).
@pytest.mark.parametrize("kind", ["priv-deep", "priv-object"])
async def test_privileged_handler_output_is_a_security_event(
    watched: tuple[Harness, Events], kind: str
) -> None:
    h, events = watched
    frames = await order(h, kind)
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.UNROUTABLE
    # Named by the client's thread (the one on its `accepted`), not the handler's frame.
    client_thread = parse_envelope(frames[0]).thread
    assert events == [("priv-from-handler", {"listener": "hostile", "thread": client_thread})]


@pytest.mark.parametrize("kind", ["env-object", "bad-to-object"])
async def test_an_object_the_envelope_schema_would_refuse_is_refused(
    h: Harness, kind: str
) -> None:
    frames = await order(h, kind, client="root")  # a profile that has vault
    (huh,) = hostile_inbox()
    assert isinstance(huh, Huh) and huh.code is HuhCode.INVALID_ENVELOPE
    assert kinds(frames) == [("core", "accepted")]
    assert "vault" not in L.SEEN


async def test_handler_error_goes_to_the_caller_as_huh(h: Harness) -> None:
    frames = await order(h, "error")
    assert field(frames[-1], "code") == "budget-exceeded"


async def test_confinement_refusal_is_a_generic_denied_huh_and_a_security_event(
    watched: tuple[Harness, Events],
) -> None:
    h, events = watched
    frames = await order(h, "denied")
    assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
    assert field(frames[-1], "code") == "denied"
    assert field(frames[-1], "message") == GENERIC_MESSAGES[HuhCode.DENIED]
    assert field(frames[-1], "retry-allowed") == "false"
    assert b"shadow" not in frames[-1]  # the cause stays in the log and the journal
    client_thread = parse_envelope(frames[0]).thread
    assert events == [("tool-denied", {"path": "../../etc/shadow", "listener": "hostile",
                                       "cause": "path escapes the root",
                                       "thread": client_thread})]


async def test_handler_returning_garbage_is_an_internal_error(h: Harness) -> None:
    frames = await order(h, "not-a-response")
    assert field(frames[-1], "code") == "internal"


async def test_handler_metadata_carries_only_opaque_facts(h: Harness) -> None:
    frames = await order(h, "silence")
    (_, meta) = L.SEEN["hostile"][0]
    assert meta.from_id == "alice" and meta.own_name == "hostile"
    uuid.UUID(meta.thread_id)  # an opaque UUID, not a path
    assert meta.thread_id != parse_envelope(frames[0]).thread  # the callee runs in its own frame


# ---- threads and scheduling ---------------------------------------------------------


async def test_hop_limit_stops_a_ping_pong(h: Harness) -> None:
    frames = await h.send("alice", L.Ping(n=0))
    assert kinds(frames)[-1] == ("core", "huh")
    assert field(frames[-1], "code") == "budget-exceeded"
    hops = len(L.SEEN["ping"]) + len(L.SEEN["pong"])
    assert hops == 10  # max_hops in basic.yaml
    # Only that chain stopped: the conversation itself goes on.
    again = await h.send("alice", Add(a=1, b=2), thread=parse_envelope(frames[0]).thread)
    assert kinds(again)[-1] == ("calculator.add", "sum")


async def test_a_stopped_chain_is_told_durably_and_a_carried_hop_count_counts(
    h: Harness,
) -> None:
    """The client of a stopped chain gets its `huh` through the outbox (a federation
    peer, whose call it is, takes only durable frames as the reply: it waited for
    its call timeout), and an envelope that arrives with its chain's hops already at
    `max_hops` (a peer organism's call carries them) is refused at once."""
    frames = await h.send("alice", L.Ping(n=0))
    thread = parse_envelope(frames[0]).thread
    assert field(frames[-1], "code") == "budget-exceeded"
    assert h.kernel is not None
    await h.kernel.flush()
    told = [e for e in await h.kernel.journal(thread=thread, limit=1000)
            if e.direction == "out" and e.tag.endswith("}huh")]
    assert len(told) == 1 and b"budget-exceeded" in (told[0].payload or b"")
    data = build_envelope("alice", str(uuid.uuid4()), to_xml(Add(a=1, b=2)))
    result = await h.pump.submit("alice", data, hops=10)  # max_hops in basic.yaml
    assert result.code is HuhCode.BUDGET_EXCEEDED


def organism_with(handlers: dict[str, str]) -> OrganismConfig:
    """basic.yaml with some listeners' handlers swapped, as an operator edits it."""
    text = ORGANISM.read_text()
    for old, new in handlers.items():
        assert text.count(f"handler: {old}\n") == 1, old
        text = text.replace(f"handler: {old}\n", f"handler: {new}\n")
    return load_config_text(text, base_dir=ORGANISM.parent)


async def stopped_add(payload: Add, meta: object) -> ChainStopped:
    return ChainStopped(HuhCode.BUDGET_EXCEEDED)


async def test_a_chain_a_peer_organism_stopped_is_stopped_here_and_the_client_told(
) -> None:
    """A gateway's call refused at the peer's hop limit (a federation listener answers
    `ChainStopped`): the client is told `budget-exceeded` durably, as for a chain
    stopped at home, and the calling listener (the relay) is not answered. Before,
    the relay got a `huh` and the client heard nothing."""
    organism = organism_with({"agentd.tools.calculator:add": "tests.test_pump:stopped_add"})
    async with Harness(organism, CLIENTS) as h:
        frames = await h.send("alice", Relay(a=1, b=2))
        assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
        assert field(frames[-1], "code") == "budget-exceeded"
        assert h.kernel is not None
        await h.kernel.flush()
        thread = parse_envelope(frames[0]).thread
        told = [e for e in await h.kernel.journal(thread=thread, limit=1000)
                if e.direction == "out" and e.tag.endswith("}huh")]
        assert len(told) == 1
        handled = [e for e in await h.kernel.journal(limit=1000)
                   if e.direction == "in" and e.handler == "relay"]
        assert len(handled) == 1  # the relay ran once and never took an answer


async def refusing_add(payload: Add, meta: object) -> HandlerResponse:
    return HandlerResponse.error(HuhCode.DENIED)


async def fragile_relay(payload: object, meta: object) -> HandlerResponse:
    if isinstance(payload, Relay):
        return HandlerResponse(Add(a=payload.a, b=payload.b), to="calculator.add")
    raise RuntimeError("the relay did not expect a huh")


async def test_a_holder_failing_on_a_core_reply_tells_its_caller() -> None:
    """The relay's call is refused (a core `huh` comes back to it) and the relay
    raises while taking it: its caller, the client, gets a `huh` and the relay's
    frame ends. For a core reply the failure used to tell nobody, and the client
    waited until idle collection (a day by default)."""
    organism = organism_with({"agentd.tools.calculator:add": "tests.test_pump:refusing_add",
                              "agentd.tools.relay:relay": "tests.test_pump:fragile_relay"})
    async with Harness(organism, CLIENTS) as h:
        frames = await h.send("alice", Relay(a=1, b=2))
        assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
        assert field(frames[-1], "code") == "internal"
        thread = parse_envelope(frames[0]).thread
        assert h.pump.registry.get(thread) is None or not h.pump.registry.get(thread).children


async def test_broadcast_runs_listeners_of_one_key_concurrently(h: Harness) -> None:
    frames = await h.send("alice", L.Work(seq=1))
    assert sorted(kinds(frames)[1:]) == [("worker.a", "done"), ("worker.b", "done")]
    assert L.STATE["peak"] == 2


async def test_thousand_conversations_through_one_chain_each_come_back_on_their_own(
    h: Harness,
) -> None:
    threads = [str(uuid.uuid4()) for _ in range(1000)]
    sends = [
        h.send("alice", build_envelope("alice", t, spec_of(Relay).to_bytes(Relay(a=i, b=1000))))
        for i, t in enumerate(threads)
    ]
    results = await asyncio.gather(*sends)
    for i, (t, frames) in enumerate(zip(threads, results, strict=True)):
        assert kinds(frames) == [("core", "accepted"), ("relay", "sum")]
        assert all(parse_envelope(f).thread == t for f in frames)
        assert field(frames[1], "value") == str(i + 1000)


async def test_concurrent_callers_continuing_their_threads_each_get_only_their_answer(
    h: Harness,
) -> None:
    """64 callers, two clients, five turns each on one thread: every `send` returns
    its own `accepted` and its own sum, never an earlier turn's or another caller's."""

    async def caller(n: int) -> list[list[bytes]]:
        client = ("alice", "bob")[n % 2]
        thread = str(uuid.uuid4())
        turns = []
        for turn in range(5):
            data = build_envelope(client, thread, spec_of(Add).to_bytes(Add(a=n, b=turn)))
            turns.append(await h.send(client, data))
        return turns

    results = await asyncio.gather(*(caller(n) for n in range(64)))
    for n, turns in enumerate(results):
        for turn, frames in enumerate(turns):
            assert kinds(frames) == [("core", "accepted"), ("calculator.add", "sum")]
            assert field(frames[1], "value") == str(n + turn)
            assert len({parse_envelope(f).thread for f in frames}) == 1


async def test_messages_on_one_thread_are_handled_in_order(h: Harness) -> None:
    threads = [str(uuid.uuid4()) for _ in range(20)]
    work = spec_of(L.Work)
    sends = []
    for seq in range(10):
        for t in threads:
            # Later messages are faster: only ordering keeps them in sequence.
            w = L.Work(seq=seq, delay_ms=(9 - seq))
            sends.append(h.pump.submit("alice", build_envelope("alice", t, work.to_bytes(w))))
    await asyncio.gather(*sends)
    await h.run_until_idle()
    for t in threads:
        dones = [int(field(f, "seq")) for f in h.frames("alice", t) if b"<done" in f]
        assert dones[::2] == list(range(10)) and dones[1::2] == list(range(10))


async def test_busy_thread_does_not_starve_others() -> None:
    from agentd._routing import Routing
    from agentd.config import PumpConfig, load_config
    from agentd.pump import Pump, PumpOptions

    busy = str(uuid.uuid4())
    done_when_bob_answered: list[int] = []
    busy_done = 0

    def deliver(client: str, thread: str, data: bytes, oid: int | None) -> None:
        nonlocal busy_done
        if thread == busy and b"<done" in data:
            busy_done += 1
        if client == "bob" and b"<sum" in data:
            done_when_bob_answered.append(busy_done)

    config = load_config(ORGANISM)
    pump = Pump(Routing.build(config), CLIENTS, deliver, PumpOptions(PumpConfig(max_concurrency=4)))
    work = spec_of(L.Work)
    for seq in range(200):
        await pump.submit("alice", build_envelope("alice", busy, work.to_bytes(L.Work(seq=seq))))
    await pump.submit("bob", envelope("bob", ADD))
    await pump.start()
    await pump.join()
    await pump.stop()
    # bob's conversation was served long before the busy thread's backlog drained.
    assert busy_done == 400
    assert done_when_bob_answered and done_when_bob_answered[0] < 10


async def test_queue_applies_backpressure_to_clients() -> None:
    from agentd._routing import Routing
    from agentd.config import PumpConfig, load_config
    from agentd.pump import Pump, PumpOptions

    config = load_config(ORGANISM)
    delivered: list[bytes] = []
    pump = Pump(
        Routing.build(config),
        CLIENTS,
        lambda c, t, d, o: delivered.append(d),
        PumpOptions(PumpConfig(max_concurrency=1, max_queue=5)),
    )
    # Not started: nothing drains, so the sixth submit must wait.
    for _ in range(5):
        assert (await pump.submit("alice", envelope("alice", ADD))).accepted
    sixth = asyncio.ensure_future(pump.submit("alice", envelope("alice", ADD)))
    await asyncio.sleep(0)
    assert not sixth.done() and pump.queue_depth == 5
    await pump.start()
    await sixth
    await pump.join()
    await pump.stop()
    assert sum(b"<sum" in d for d in delivered) == 6


async def test_a_handler_that_never_suspends_runs_before_submit_returns(
        tmp_path: Path) -> None:
    from agentd._routing import Routing
    from agentd.config import load_config
    from agentd.kernel import Kernel
    from agentd.pump import Pump

    delivered: list[bytes] = []
    kernel = await Kernel.open(tmp_path)
    pump = Pump(Routing.build(load_config(ORGANISM)), CLIENTS,
                lambda c, t, d, o: delivered.append(d), kernel=kernel)
    await pump.start()
    try:
        result = pump.submit_nowait("alice", envelope("alice", ADD))
        # No await since: the calculator ran on this stack, no worker took it; its
        # answer waits for the commits, after `accepted`.
        assert result is not None and result.accepted
        assert pump.handled == 1 and pump.queue_depth == 0 and pump.running == 0
        assert delivered == []
        await kernel.flush()
        assert [frame_kind(d)[:2] for d in delivered] == [("core", "accepted"),
                                                         ("calculator.add", "sum")]
    finally:
        await pump.stop()
        await kernel.close()


async def test_a_handler_that_never_suspends_waits_for_a_free_worker(tmp_path: Path) -> None:
    from agentd._routing import Routing
    from agentd.config import PumpConfig, load_config
    from agentd.kernel import Kernel
    from agentd.pump import Pump, PumpOptions

    delivered: list[bytes] = []
    gate = L.GATE["event"] = asyncio.Event()
    kernel = await Kernel.open(tmp_path)
    pump = Pump(Routing.build(load_config(ORGANISM)), CLIENTS,
                lambda c, t, d, o: delivered.append(d),
                PumpOptions(PumpConfig(max_concurrency=1)), kernel)
    await pump.start()
    try:
        hold = spec_of(L.Hold).to_bytes(L.Hold(n=1))
        await pump.submit("alice", envelope("alice", hold))
        while pump.running == 0:  # the one worker is inside `hold`
            await asyncio.sleep(0)
        await pump.submit("bob", envelope("bob", ADD))
        # The calculator is not run beside the busy worker: it is queued.
        assert pump.handled == 1 and pump.queue_depth == 1
        gate.set()
        await pump.join()
        await kernel.flush()
        answers = [frame_kind(d)[1] for d in delivered if frame_kind(d)[0] != "core"]
        assert answers == ["done", "sum"]
    finally:
        L.GATE["event"] = None
        await pump.stop()
        await kernel.close()


async def test_profile_of_a_thread_never_changes_and_children_inherit_it(h: Harness) -> None:
    frames = await h.send("nina", Add(a=1, b=2))
    thread = parse_envelope(frames[0]).thread
    frame = h.pump.registry.get(thread)
    assert frame is not None and frame.profile.name == "narrow"
    child = h.pump.registry.extend(frame, "calculator.add")
    assert child.profile is frame.profile
    relay = await h.send("nina", Relay(a=1, b=2), thread=thread)
    assert field(relay[0], "code") == "unroutable"


async def test_silent_core_messages_do_not_echo(h: Harness) -> None:
    # hostile receives an ack-free huh and stays silent: no ack for a huh.
    await order(h, "invalid-output")
    assert len(hostile_inbox()) == 1
    assert not any(isinstance(p, Ack) for p in hostile_inbox())


# ---- meta introspection on the bus ------------------------------------------------

CORE_NS = "https://xml-pipeline.org/ns/core/v1"
LIST_Q = f'<list-capabilities xmlns="{CORE_NS}"/>'.encode()


def schema_q(name: str) -> bytes:
    return f'<request-schema xmlns="{CORE_NS}"><name>{name}</name></request-schema>'.encode()


def example_q(name: str) -> bytes:
    return f'<request-example xmlns="{CORE_NS}"><name>{name}</name></request-example>'.encode()


async def test_meta_questions_are_refused_when_not_enabled(h: Harness) -> None:
    for q in (LIST_Q, schema_q("calculator.add"), example_q("calculator.add")):
        frames = await h.send("alice", envelope("alice", q))
        assert kinds(frames) == [("core", "huh")] and field(frames[0], "code") == "unroutable"


async def test_meta_answers_only_about_the_clients_own_profile() -> None:
    import dataclasses

    from agentd._xml import parse_untrusted
    from agentd.config import MetaConfig, load_config

    config = dataclasses.replace(load_config(ORGANISM), meta=MetaConfig(True, True, True))
    async with Harness(config, CLIENTS) as h:
        frames = await h.send("alice", envelope("alice", LIST_Q))
        assert kinds(frames) == [("core", "accepted"), ("core", "capabilities")]
        listed = frames[1].decode()
        assert "calculator.add" in listed and "relay" in listed
        assert "vault" not in listed  # outside alice's profile

        frames = await h.send("alice", envelope("alice", schema_q("calculator.add")))
        assert kinds(frames)[-1] == ("core", "schema")
        xsd = parse_envelope(frames[-1]).payload[1].text
        assert xsd is not None and "xs:schema" in xsd

        frames = await h.send("alice", envelope("alice", example_q("calculator.add")))
        example = parse_envelope(frames[-1]).payload[1].text or ""
        assert parse_untrusted(example.encode()).tag.endswith("}add")

        thread = str(uuid.uuid4())
        hidden = await h.send("alice", envelope("alice", schema_q("vault"), thread))
        missing = await h.send("alice", envelope("alice", schema_q("no-such"), thread))
        assert field(hidden[0], "code") == "unroutable" and hidden[0] == missing[0]

        # root's profile (admin) does include the vault.
        frames = await h.send("root", envelope("root", schema_q("vault")))
        assert kinds(frames)[-1] == ("core", "schema")


async def test_submit_nowait_admits_at_once_or_says_there_is_no_room() -> None:
    """The bus's task-free ingress: admitted now (the outcome goes out through
    `deliver`, exactly as with `submit`), refused now, or None with nothing done
    when the pump is full, so the caller falls back to waiting in `submit`."""
    from agentd._routing import Routing
    from agentd.config import PumpConfig, load_config
    from agentd.pump import Pump, PumpOptions

    config = load_config(ORGANISM)
    delivered: list[bytes] = []
    pump = Pump(Routing.build(config), CLIENTS, lambda c, t, d, o: delivered.append(d),
                PumpOptions(PumpConfig(max_concurrency=1, max_queue=2)))
    first, second = (envelope("alice", ADD) for _ in range(2))
    for data in (first, second):
        result = pump.submit_nowait("alice", data)
        assert result is not None and result.accepted
    assert pump.queue_depth == 2 and len(delivered) == 2  # two `accepted`, nothing else
    full = envelope("alice", ADD)
    assert pump.submit_nowait("alice", full) is None
    assert pump.queue_depth == 2 and len(delivered) == 2  # nothing admitted, nothing said
    # A refusal is final and immediate, room or not.
    forged = pump.submit_nowait("alice", envelope("bob", ADD))
    assert forged is None  # still full: not even parsed
    waiting = asyncio.ensure_future(pump.submit("alice", full))
    await asyncio.sleep(0)
    assert pump.submit_nowait("bob", envelope("bob", ADD)) is None  # no jumping the queue
    await pump.start()
    assert (await waiting).accepted
    await pump.join()
    forged = pump.submit_nowait("alice", envelope("bob", ADD))
    assert forged is not None and forged.code is HuhCode.INVALID_ENVELOPE
    await pump.stop()
    assert sum(b"<sum" in d for d in delivered) == 3


async def test_submit_nowait_with_the_journal_says_accepted_only_once_durable(
    tmp_path: Path,
) -> None:
    async with Harness.from_config(ORGANISM, clients=CLIENTS, state_dir=tmp_path) as h:
        assert h.kernel is not None
        thread = str(uuid.uuid4())
        result = h.pump.submit_nowait("alice", envelope("alice", ADD, thread))
        assert result is not None and result.accepted and result.seq
        assert h.frames("alice", thread) == []  # not before its commit
        await h.run_until_idle()
        assert kinds(h.frames("alice", thread)) == [("core", "accepted"), ("calculator.add", "sum")]
        pending = await h.kernel.pending_messages()
        assert [e.seq for e in pending] == []  # handled and marked delivered


async def test_a_burst_of_blocking_handlers_gets_the_whole_worker_pool(h: Harness) -> None:
    """Workers are woken one at a time (each one that takes a message while more are
    ready wakes the next), yet a burst of handlers that all block still ends up
    running all at once, up to `max_concurrency` (32 here), and no more."""
    gate = L.GATE["event"] = asyncio.Event()
    try:
        sends = [asyncio.ensure_future(h.send("alice", L.Hold(n=i))) for i in range(40)]
        for _ in range(500):  # loop turns, not time: the ramp-up takes one per worker
            if h.pump.running == 32:
                break
            await asyncio.sleep(0)
        assert h.pump.running == 32 and h.pump.queue_depth == 8
        gate.set()
        results = await asyncio.gather(*sends)
        assert all(kinds(r)[-1] == ("hold", "done") for r in results)
    finally:
        L.GATE["event"] = None


async def test_finished_large_messages_are_not_kept_in_memory() -> None:
    """Each idle worker kept the last message it had handled (envelope, payload and
    parsed tree) until its next one, so a daemon held up to `max_concurrency` finished
    messages: about 160 of ~240 KB each after 1,200 (110 MiB). Once answered, a
    message holds nothing."""
    import gc
    import tracemalloc

    size = 240_000
    bulk = Path(__file__).parent / "organisms" / "bulk.yaml"
    async with Harness.from_config(bulk, clients={"alice": "public"}) as h:
        assert h.pump.settings.max_concurrency == 8
        await h.send("alice", L.Bulk(text="warm"))  # first-use caches are not growth
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(32):  # four rounds of the eight workers
                frames = await h.send("alice", L.Bulk(text=f"{i:06d}" * (size // 6)))
                assert kinds(frames)[-1] == ("bulk", "done")
            gc.collect()
            retained = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    # The 32 conversations at rest and their answers, far below one large message.
    assert retained < size // 2, retained
