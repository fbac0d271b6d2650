"""Trace context across organisms and from clients, with real `agentd run` processes
and a real OTLP/HTTP receiver on loopback: alpha's client calls `beta:echo`, and
beta's spans for the call are children of alpha's `agentd.federation.call` span in
one trace across both exporters. A client's `traceparent` is ignored unless
`telemetry.accept_client_context`; a peer's malformed one is ignored, never refused."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from agentd._envelope import build_envelope
from agentd._xmlify import to_xml
from agentd.client import BusClient, frame_kind
from agentd.tools.echo import Echo
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.federation_peer import RawPeer
from tests.otlp_receiver import OtlpReceiver, tree
from tests.test_federation_calls import ALPHA, serving_beta
from tests.test_federation_daemons import federation_port
from tests.test_federation_remote import answer_of, dial, link_pair

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = (f'<t:traceparent xmlns:t="https://xml-pipeline.org/ns/trace/v1">'
               f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01</t:traceparent>")


def with_telemetry(home: Path, url: str, **extra: Any) -> None:
    edit_config(home, lambda doc: doc.update(telemetry={"otlp_endpoint": url, **extra}))


def with_traceparent(payload: Any, to: str, thread: str) -> bytes:
    """A client's envelope whose meta carries a W3C traceparent extension."""
    plain = build_envelope("alice", thread, to_xml(payload), to=to).decode()
    return plain.replace("</meta>", TRACEPARENT + "</meta>", 1).encode()


async def test_a_call_to_a_peer_is_one_trace_across_both_organisms(
        tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    with OtlpReceiver() as receiver:
        alpha, beta = link_pair(tmp_path, imports=["echo"], exports=["echo"])
        with_telemetry(alpha, receiver.url)
        with_telemetry(beta, receiver.url)
        b = DaemonProcess(beta)
        daemons.append(b)
        await b.start()
        dial(alpha, b, imports=["echo"])
        a = DaemonProcess(alpha)
        daemons.append(a)
        await a.start()
        await a.wait_for_line(r"reloaded for newly pinned peer schemas")
        async with BusClient(a.url, "alice", secret=a.secret, cafile=a.cafile) as bus:
            answer = await answer_of(bus, Echo(text="across"), "beta:echo")
        thread = frame_kind(answer)[2]
        assert await a.stop() == 0 and await b.stop() == 0  # both exporters flushed
        spans = await asyncio.to_thread(receiver.wait_for, lambda s: {
            x.service for x in s if x.name == "execute_tool echo"} == {"beta"})
    trace = uuid.UUID(thread).hex
    assert tree(spans, trace) == [["agentd.admit", [
        ["execute_tool beta:echo", [["agentd.federation.call", [
            ["agentd.admit", [["execute_tool echo", []]]]]]]]]]]
    in_trace = [s for s in spans if s.trace_id == trace]
    by_name = {(s.service, s.name): s for s in in_trace}
    call = by_name["alpha", "agentd.federation.call"]
    assert call.attributes["agentd.gateway"] == "beta"
    assert call.attributes["agentd.outcome"] == "ok"
    beta_admit = by_name["beta", "agentd.admit"]
    assert beta_admit.parent_id == call.span_id  # the context crossed in the frame
    assert beta_admit.attributes["agentd.client"] == "alpha"
    # Beta's conversation is its own thread (the caller's UUID never crosses).
    echo = by_name["beta", "execute_tool echo"]
    assert echo.attributes["gen_ai.conversation.id"] != thread


async def test_a_peers_malformed_traceparent_is_ignored_and_the_call_still_runs(
        tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    with OtlpReceiver() as receiver:
        home = serving_beta(tmp_path)
        with_telemetry(home, receiver.url)
        beta = DaemonProcess(home)
        daemons.append(beta)
        await beta.start()
        key = beta.home / "identity.key"
        from agentd.federation import load_identity

        peer = await RawPeer(ALPHA, "beta", load_identity(key, "beta").key.public_key()
                             ).connect(federation_port(beta))
        for call_id, bad in (("c1", "00-" + "0" * 32 + "-" + "1" * 16 + "-01"),
                             ("c2", "01-zz"), ("c3", 7)):
            await peer.send({"t": "call", "id": call_id, "traceparent": bad,
                             "envelope": peer.envelope(Echo(text=call_id), "echo", None)})
            accepted = await peer.next("accepted", id=call_id)
            await peer.ack(await peer.next("reply", thread=accepted["thread"]))
        await peer.close()
        assert await beta.stop() == 0
        spans = await asyncio.to_thread(receiver.wait_for, lambda s: len(
            [x for x in s if x.name == "execute_tool echo"]) == 3)
    admits = [s for s in spans if s.name == "agentd.admit"]
    assert len(admits) == 3
    # Each call is a trace of beta's own: its thread's, no parent from the peer.
    assert all(s.parent_id == "" and s.trace_id != "0" * 32 for s in admits)


async def client_trace(tmp_path: Path, daemons: list[DaemonProcess], **extra: Any
                       ) -> tuple[str, list[Any]]:
    home = tmp_path / "home"
    make_home(home)
    with OtlpReceiver() as receiver:
        with_telemetry(home, receiver.url, **extra)
        d = DaemonProcess(home)
        daemons.append(d)
        await d.start()
        thread = str(uuid.uuid4())
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(with_traceparent(Echo(text="hi"), "echo", thread))
        assert frame_kind(frames[-1])[:2] == ("echo", "echoreply")
        assert await d.stop() == 0
        spans = await asyncio.to_thread(receiver.wait_for, lambda s: any(
            x.name == "execute_tool echo" for x in s))
    return thread, spans


async def test_a_clients_traceparent_is_ignored_by_default(
        tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    thread, spans = await client_trace(tmp_path, daemons)
    assert {s.trace_id for s in spans} == {uuid.UUID(thread).hex}
    assert CLIENT_TRACE not in repr(spans) and CLIENT_SPAN not in repr(spans)
    (admit,) = [s for s in spans if s.name == "agentd.admit"]
    assert admit.parent_id == ""


async def test_a_clients_traceparent_is_continued_when_allowed(
        tmp_path: Path, daemons: list[DaemonProcess]) -> None:
    _, spans = await client_trace(tmp_path, daemons, accept_client_context=True)
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}
    (admit,) = [s for s in spans if s.name == "agentd.admit"]
    assert admit.parent_id == CLIENT_SPAN
    assert tree(spans, CLIENT_TRACE) == [["agentd.admit", [["execute_tool echo", []]]]]
