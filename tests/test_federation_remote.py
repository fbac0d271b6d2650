"""Calling a peer organism's listeners, between real `agentd run` processes: alpha
imports beta's `echo` and `hold` and its client calls them as `beta:echo` and
`beta:hold`. The schemas are pinned at the first link-up; a changed schema is
refused until a reload accepts it; a listener beta does not export is never
callable; either side killed with SIGKILL mid-call still answers once."""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentd._envelope import build_envelope, parse_envelope
from agentd._xml import c14n
from agentd._xmlify import from_xml, to_xml
from agentd.client import BusClient, frame_kind, is_answer
from agentd.federation._remote import Offer
from agentd.tools.echo import Echo, EchoReply
from tests.daemon_process import DaemonProcess, edit_config
from tests.organisms.listeners import Done, Hold
from tests.test_federation_daemons import (
    declare,
    federation_port,
    gateway_states,
    organism,
    public_line,
    start,
)

IMPORTS = ["echo", "hold"]


def link_pair(tmp: Path, imports: list[str] = IMPORTS,
              exports: list[str] = IMPORTS) -> tuple[Path, Path]:
    """beta exports to alpha; alpha imports from beta and lets its client call them."""
    alpha, beta = organism(tmp, "alpha"), organism(tmp, "beta")

    def serve(doc: dict[str, Any]) -> None:
        doc["gateways"] = [{"name": "alpha", "public_key": public_line(alpha, "alpha"),
                            "profile": "public", "export": exports}]

    edit_config(beta, serve)
    return alpha, beta


def dial(alpha: Path, beta_daemon: DaemonProcess, imports: list[str] = IMPORTS) -> None:
    declare(alpha, "beta", public_line(beta_daemon.home, "beta"),
            f"wss://127.0.0.1:{federation_port(beta_daemon)}/federation")

    def edit(doc: dict[str, Any]) -> None:
        doc["gateways"][0]["import"] = imports
        doc["gateways"][0]["call_timeout_s"] = 60
        doc["profiles"]["public"]["listeners"] += [f"beta:{n}" for n in imports]

    edit_config(alpha, edit)


async def linked(tmp: Path, daemons: list[DaemonProcess], beta_env: dict[str, str] | None = None,
                 ) -> tuple[DaemonProcess, DaemonProcess]:
    alpha, beta = link_pair(tmp)
    b = DaemonProcess(beta, env=beta_env)
    daemons.append(b)
    await b.start()
    dial(alpha, b)
    a = await start(daemons, alpha)
    await a.wait_for_line(r"reloaded for newly pinned peer schemas")
    return a, b


def envelope(payload: Any, to: str, thread: str | None = None) -> bytes:
    return build_envelope("alice", thread or str(uuid.uuid4()), to_xml(payload), to=to)


async def answer_of(bus: BusClient, payload: Any, to: str) -> bytes:
    frames = await bus.exchange(envelope(payload, to), timeout=60)
    return frames[-1]


async def answer_on(bus: BusClient, thread: str) -> bytes:
    while True:
        frame = await bus.recv(timeout=60)
        if frame_kind(frame)[2] == thread and is_answer(frame):
            return frame


async def committed_at(d: DaemonProcess, sender: str) -> None:
    """Until `d`'s journal holds a message from `sender`. A handler may start before
    its message's commit (its output waits for it), so its log line is not enough."""
    async with asyncio.timeout(30):
        while True:
            _, doc = d.agentctl("journal", "--limit", "20")
            if any(e.get("sender") == sender for e in doc["result"]["journal"]):
                return
            await asyncio.sleep(0.05)  # a poll of committed state, bounded above


async def held_call(bus: BusClient, b: DaemonProcess, n: int) -> str:
    """A call to `beta:hold`, committed at beta and blocked in its handler."""
    thread = await bus.send(envelope(Hold(n=n), "beta:hold"))
    await b.wait_for_line(rf"hold: n={n} blocking")
    await committed_at(b, "alpha")
    return thread


async def restart(daemons: list[DaemonProcess], d: DaemonProcess, port: int) -> DaemonProcess:
    """`d` again, on the federation port its peer dials."""
    edit_config(d.home, lambda doc: doc["federation"].update(listen=f"127.0.0.1:{port}"))
    return await start(daemons, d.home)


def payload_bytes(frame: bytes) -> bytes:
    return c14n(parse_envelope(frame).payload)


def pins(home: Path) -> dict[str, Any]:
    return dict(json.loads((home / "state" / "federation-pins.json").read_text()))


async def test_a_client_calls_a_peers_listener_through_its_organism(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a, b = await linked(tmp_path, daemons)
    assert sorted(pins(a.home)["beta"]) == ["echo", "hold"]
    _, doc = a.agentctl("status")
    gateway = doc["result"]["status"]["gateways"][0]
    assert gateway["imports"] == {"echo": "pinned", "hold": "pinned"}
    code, doc = a.agentctl("introspect", "schema", "beta:echo")  # the pinned XSD, here
    assert code == 0, doc
    assert 'targetNamespace="https://xml-pipeline.org/ns/echo/v1"' in doc["result"]
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        answer = await answer_of(bus, Echo(text="across"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "across"
        assert parse_envelope(answer).sender == "beta:echo"
    # Beta saw the call from "alpha", on a thread of its own.
    _, doc = b.agentctl("journal", "--limit", "50")
    senders = {e.get("sender") for e in doc["result"]["journal"]}
    assert "alpha" in senders


async def test_a_listener_the_peer_does_not_export_is_never_callable(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    alpha, beta = link_pair(tmp_path, exports=["echo"])
    b = await start(daemons, beta)
    dial(alpha, b)
    a = await start(daemons, alpha)
    await a.wait_for_line(r"reloaded for newly pinned peer schemas")
    _, doc = a.agentctl("status")
    assert doc["result"]["status"]["gateways"][0]["imports"] == {
        "echo": "pinned", "hold": "not-offered"}
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        answer = await answer_of(bus, Hold(n=1), "beta:hold")
        assert frame_kind(answer)[1] == "huh"
        assert b"unroutable" in answer
        answer = await answer_of(bus, Echo(text="ok"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "ok"


async def test_a_frame_over_the_peers_limit_is_never_sent_and_the_link_stays_up(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    """Each side announces its `max_frame_bytes` in the handshake: a call too large for
    beta, or a reply too large for alpha, is answered `too-large` instead of being
    sent (the peer would close the link on it, and it would be sent again on the
    next link, for ever). Two-byte characters make the frames (UTF-8) twice the
    text."""
    alpha, beta = link_pair(tmp_path)
    edit_config(beta, lambda doc: doc["federation"].update(max_frame_bytes=8192))
    b = await start(daemons, beta)
    dial(alpha, b)
    edit_config(alpha, lambda doc: doc["federation"].update(max_frame_bytes=4096))
    a = await start(daemons, alpha)
    await a.wait_for_line(r"reloaded for newly pinned peer schemas")

    def since() -> str:
        _, doc = a.agentctl("status")
        (gateway,) = doc["result"]["status"]["gateways"]
        assert gateway["state"] == "up" and gateway["peer_max_frame"] == 8192
        return str(gateway["since"])

    up = since()
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        # About 8.3 KB of call frame: over beta's 8,192, never sent.
        answer = await answer_of(bus, Echo(text="\u00e9" * 4000), "beta:echo")
        assert frame_kind(answer)[1] == "huh" and b"too-large" in answer
        await a.wait_for_line(r"a call frame of \d+ bytes is over the 8192 the peer takes")
        # About 5 KB each way: the call fits beta, the reply is over alpha's 4,096.
        answer = await answer_of(bus, Echo(text="\u00e9" * 2500), "beta:echo")
        assert frame_kind(answer)[1] == "huh" and b"too-large" in answer
        await b.wait_for_line(r"a reply frame of \d+ bytes is over the 4096 the peer takes")
        answer = await answer_of(bus, Echo(text="\u00e9" * 1000), "beta:echo")  # 2 KB
        assert from_xml(EchoReply, payload_bytes(answer)).text == "\u00e9" * 1000
    assert since() == up  # the link never went down


async def test_a_changed_schema_is_refused_until_a_reload_accepts_it(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a, b = await linked(tmp_path, daemons)
    pinned = pins(a.home)
    # Tamper with alpha's pin of `echo` as if beta had changed it since: the
    # next link-up offers something else than what is pinned.
    doc = pinned["beta"]["echo"]
    doc["description"] = "an older description"
    (a.home / "state" / "federation-pins.json").write_text(json.dumps(pinned))
    port = federation_port(b)
    await b.stop(signal.SIGKILL)
    await a.stop(signal.SIGKILL)
    b = await restart(daemons, b, port)
    a = await start(daemons, a.home)
    await a.wait_for_line(r"security kind=federation-schema-changed .*listener=echo")
    code, doc = a.agentctl("status")
    assert doc["result"]["status"]["gateways"][0]["imports"]["echo"] == "changed"
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        answer = await answer_of(bus, Echo(text="blocked"), "beta:echo")
        assert frame_kind(answer)[1] == "huh"
        code, doc = a.agentctl("reload")
        assert code == 0, doc
        assert doc["result"]["reload"]["accepted_schemas"] == ["beta:echo"]
        answer = await answer_of(bus, Echo(text="accepted"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "accepted"
    assert pins(a.home)["beta"]["echo"]["description"] != "an older description"


async def test_a_declared_schema_pin_takes_only_that_schema_and_no_first_use(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    alpha, beta = link_pair(tmp_path)
    b = DaemonProcess(beta)
    daemons.append(b)
    await b.start()
    dial(alpha, b)
    wrong = "0" * 64

    def declare_pin(digest: str) -> Callable[[dict[str, Any]], None]:
        def edit(doc: dict[str, Any]) -> None:
            doc["gateways"][0]["schema_pins"] = {"echo": digest}
        return edit

    edit_config(alpha, declare_pin(wrong))
    a = await start(daemons, alpha)
    await a.wait_for_line(r"security kind=federation-schema-mismatch .*listener=echo")
    _, doc = a.agentctl("status")
    (gateway,) = doc["result"]["status"]["gateways"]
    assert gateway["imports"]["echo"] == "mismatch"
    assert "echo" not in gateway["import_sha256"]  # nothing pinned on first use
    # The callee's operator reads the digest to declare from its own status.
    _, doc = b.agentctl("status")
    exported = doc["result"]["status"]["gateways"][0]["export_sha256"]["echo"]
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        assert frame_kind(await answer_of(bus, Echo(text="blocked"), "beta:echo"))[1] == "huh"
        code, doc = a.agentctl("reload")  # a reload does not accept a mismatch
        assert code == 0 and doc["result"]["reload"].get("accepted_schemas", []) == []
        assert frame_kind(await answer_of(bus, Echo(text="still"), "beta:echo"))[1] == "huh"
        session = bus.session
    edit_config(alpha, declare_pin(exported))  # gateways are read at start
    await a.stop(signal.SIGTERM)
    a = await start(daemons, alpha)
    await a.wait_for_line(r"reloaded for newly pinned peer schemas")
    async with BusClient(a.url, "alice", session=session, cafile=a.cafile) as bus:
        answer = await answer_of(bus, Echo(text="declared"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "declared"
    assert Offer.from_json(pins(a.home)["beta"]["echo"]).digest == exported


async def test_callee_killed_mid_call_runs_once_and_answers_once(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a, b = await linked(tmp_path, daemons, beta_env={"AGENTD_TEST_HOLD": "block"})
    port = federation_port(b)
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        thread = await held_call(bus, b, 5)
        await b.stop(signal.SIGKILL)
        b = await restart(daemons, b, port)  # hold answers now: the recovered call
        done = from_xml(Done, payload_bytes(await answer_on(bus, thread)))
        assert (done.seq, done.by) == (5, "redelivered")
        # A barrier: a later call answered means no second answer was on its way.
        answer = await answer_of(bus, Echo(text="barrier"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "barrier"
        extra = [f for f in bus.kept if frame_kind(f)[2] == thread]
        assert not extra
    assert gateway_states(a) == {"beta": "up"}


async def test_both_sides_killed_mid_call_the_call_runs_once_and_is_answered_once(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    """alpha (the caller) and beta are both killed while beta's handler runs; beta
    comes back first and answers into its outbox while alpha is down; alpha comes
    back, redelivers its message to `beta:hold`, which sends the same call id: beta
    recognises it, and its stored reply answers alpha's client once."""
    a, b = await linked(tmp_path, daemons, beta_env={"AGENTD_TEST_HOLD": "block"})
    port = federation_port(b)
    async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
        thread = await held_call(bus, b, 9)
        session = bus.session
    await a.stop(signal.SIGKILL)
    await b.stop(signal.SIGKILL)
    b = await restart(daemons, b, port)  # the recovered call runs and answers (outbox)
    a = await start(daemons, a.home)
    async with BusClient(a.url, "alice", session=session, cafile=a.cafile) as bus:
        done = from_xml(Done, payload_bytes(await answer_on(bus, thread)))
        assert (done.seq, done.by) == (9, "redelivered")
        answer = await answer_of(bus, Echo(text="barrier"), "beta:echo")
        assert from_xml(EchoReply, payload_bytes(answer)).text == "barrier"
        assert not [f for f in bus.kept if frame_kind(f)[2] == thread]
    _, doc = b.agentctl("journal", "--limit", "200")
    holds = [(e["direction"], e["kind"]) for e in doc["result"]["journal"]
             if e["thread"] and "hold" in (e["handler"], e["sender"])]
    # Delivered once, answered once; at hop 1 of the chain (alpha's call was its hop).
    assert holds == [("in", "request/1"), ("out", "reply")]


async def test_three_organisms_two_callers_each_get_only_their_own_answers(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    """beta serves alpha and gamma; both call beta's echo at once, on the same call
    ids of their own (thread 1, 2, …): beta keeps them apart by caller."""
    alpha, beta = link_pair(tmp_path)
    gamma = organism(tmp_path, "gamma")
    edit_config(beta, lambda doc: doc["gateways"].append(
        {"name": "gamma", "public_key": public_line(gamma, "gamma"), "profile": "public",
         "export": ["echo"]}))
    b = await start(daemons, beta)
    dial(alpha, b)
    dial(gamma, b, imports=["echo"])
    a, g = await start(daemons, alpha), await start(daemons, gamma)
    for d in (a, g):
        await d.wait_for_line(r"reloaded for newly pinned peer schemas")

    async def ask(d: DaemonProcess, who: str) -> list[str]:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            threads = {await bus.send(envelope(Echo(text=f"{who}-{i}"), "beta:echo"))
                       for i in range(5)}
            answers = []
            while len(answers) < 5:
                frame = await bus.recv(timeout=60)
                if is_answer(frame):
                    assert frame_kind(frame)[2] in threads
                    answers.append(from_xml(EchoReply, payload_bytes(frame)).text)
        return sorted(answers)

    got_a, got_g = await asyncio.gather(ask(a, "alpha"), ask(g, "gamma"))
    assert got_a == [f"alpha-{i}" for i in range(5)]
    assert got_g == [f"gamma-{i}" for i in range(5)]


async def test_a_hostile_callee_reply_outside_the_pin_and_an_unsolicited_offer(
    tmp_path: Path,
) -> None:
    """beta imports `echo` from a peer the test plays (as alpha). The peer offers the
    schema beta asked for, then answers beta's call with a reply its pinned schema
    refuses, then sends an offer nobody asked for."""
    from agentd._xmlify import xsd_of
    from agentd.federation import load_identity
    from agentd.federation._remote import Offer
    from tests.federation_peer import RawPeer
    from tests.test_federation_calls import ALPHA, serving_beta

    home = serving_beta(tmp_path)

    def imports(doc: dict[str, Any]) -> None:
        doc["gateways"][0]["import"] = ["echo"]
        doc["profiles"]["public"]["listeners"].append("alpha:echo")

    edit_config(home, imports)
    b = DaemonProcess(home)
    await b.start()
    try:
        key = load_identity(home / "identity.key", "beta").key.public_key()
        peer = await RawPeer(ALPHA, "beta", key).connect(federation_port(b))
        asked = await peer.next("schemas")
        assert asked["names"] == ["echo"]
        offer = Offer("echo", "Echoes text back.", (xsd_of(Echo),), (xsd_of(EchoReply),))
        await peer.send({"t": "offer", "listeners": [offer.to_json()]})
        await b.wait_for_line(r"reloaded for newly pinned peer schemas")
        async with BusClient(b.url, "alice", secret=b.secret, cafile=b.cafile) as bus:
            thread = await bus.send(envelope(Echo(text="hi"), "alpha:echo"))
            call = await peer.next("call")
            env = parse_envelope(call["envelope"].encode())
            assert env.sender == "beta" and env.to == "echo"
            bad = b'<echoreply xmlns="https://xml-pipeline.org/ns/echo/reply/v1"><x/></echoreply>'
            await peer.send({"t": "reply", "id": 1, "thread": env.thread,
                             "envelope": build_envelope("echo", env.thread, bad).decode()})
            answer = await answer_on(bus, thread)
            assert frame_kind(answer)[1] == "huh" and b"invalid-payload" in answer
            await b.wait_for_line(r"security kind=federation-reply-refused .*peer=alpha")
            assert (await peer.next("ack"))["id"] == 1  # not sent again forever
        await peer.send({"t": "offer", "listeners": [offer.to_json()]})  # unsolicited
        await b.wait_for_line(r"security kind=federation-unexpected-frame .*kind=offer")
    finally:
        await b.stop(signal.SIGKILL)


async def test_a_callable_organism_its_agent_answers_a_peers_client(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    """beta exports its LLM agent `tutor` (its model a fake OpenAI server on loopback;
    it asks beta's own calculator, under beta's budgets); alpha imports it and its
    client asks `beta:tutor`, getting the agent's final text as the answer."""
    from agentd.platform.demo import MathQuestion
    from tests.llm_servers import FakeLLM, tutor_script

    alpha, beta = link_pair(tmp_path, imports=["tutor"], exports=["tutor"])
    async with FakeLLM("openai", tutor_script) as server:  # beta's model, on loopback
        def live(doc: dict[str, Any]) -> None:
            backend = doc["llm"]["backends"][0]
            backend.pop("cassette", None)
            backend.update(provider="openai", base_url=server.base_url, model="fake-1")

        edit_config(beta, live)
        b = await start(daemons, beta)
        dial(alpha, b, imports=["tutor"])
        a = await start(daemons, alpha)
        await a.wait_for_line(r"reloaded for newly pinned peer schemas")
        async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
            answer = await answer_of(bus, MathQuestion(text="What is (2 + 3) * 7?"),
                                     "beta:tutor")
    env = parse_envelope(answer)
    assert env.sender == "beta:tutor", answer
    assert env.payload.tag == "{https://xml-pipeline.org/ns/core/v1}answer", answer
    assert "35" in (env.payload.findtext("{https://xml-pipeline.org/ns/core/v1}text") or "")
