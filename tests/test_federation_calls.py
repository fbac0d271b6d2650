"""A peer calling a real daemon's exported listeners across the federation link,
and every way a hostile peer can try more: a listener not exported, a privileged
payload, a forged `from`, a meta question, a flood, garbage; then the daemon killed
with SIGKILL mid-call (the call runs once and is answered once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.exceptions import ConnectionClosed

from agentd._envelope import parse_envelope
from agentd._xml import c14n
from agentd._xmlify import from_xml
from agentd.federation import Identity, load_identity
from agentd.tools.calculator import Add
from agentd.tools.echo import Echo, EchoReply
from tests.daemon_process import DaemonProcess, edit_config
from tests.federation_peer import RawPeer
from tests.organisms.listeners import Done, Hold
from tests.test_federation_daemons import federation_port, organism

ALPHA = Identity("alpha", Ed25519PrivateKey.generate())


def serving_beta(tmp: Path, **federation: Any) -> Path:
    beta = organism(tmp, "beta")

    def edit(doc: dict[str, Any]) -> None:
        doc["gateways"] = [{"name": "alpha", "public_key": ALPHA.public_line,
                            "profile": "public", "export": ["echo", "hold"]}]
        doc["federation"].update(federation)

    edit_config(beta, edit)
    return beta


@pytest.fixture
async def beta(tmp_path: Path) -> AsyncIterator[DaemonProcess]:
    d = DaemonProcess(serving_beta(tmp_path))
    await d.start()
    yield d
    if d.proc is not None and d.proc.returncode is None:
        await d.stop(signal.SIGKILL)


async def peer_of(daemon: DaemonProcess) -> RawPeer:
    key = load_identity(daemon.home / "identity.key", "beta").key.public_key()
    return await RawPeer(ALPHA, "beta", key).connect(federation_port(daemon))


def payload_of(reply: dict[str, Any]) -> bytes:
    return c14n(parse_envelope(reply["envelope"].encode()).payload)


async def closed_as_unexpected(daemon: DaemonProcess, peer: RawPeer) -> None:
    """The daemon refused a frame as unexpected: a security event, the link closed 1008."""
    assert peer.ws is not None
    await daemon.wait_for_line(r"security kind=federation-unexpected-frame")
    await peer.ws.wait_closed()
    assert peer.ws.close_code == 1008


async def test_an_exported_listener_answers_across_the_link(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    await peer.call("c1", Echo(text="hello"), to="echo")
    accepted = await peer.next("accepted", id="c1")
    reply = await peer.next("reply", thread=accepted["thread"])
    assert from_xml(EchoReply, payload_of(reply)).text == "hello"
    assert "<from>echo</from>" in reply["envelope"]
    await peer.ack(reply)
    await peer.close()


async def test_a_listener_not_exported_is_unroutable(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    await peer.call("c1", Add(a=1, b=2), to="calculator.add")
    refused = await peer.next("refused", id="c1")
    assert refused["code"] == "unroutable"
    await beta.wait_for_line(r"security kind=federation-not-exported")
    await peer.call("c2", Add(a=1, b=2), to=None)  # by payload key alone: refused too
    assert (await peer.next("refused", id="c2"))["code"] == "unroutable"


async def test_a_priv_payload_is_refused_as_security(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    priv = b'<shutdown xmlns="https://xml-pipeline.org/ns/privileged/v1"/>'
    await peer.call("c1", priv, to="echo")
    assert (await peer.next("refused", id="c1"))["code"] == "unroutable"
    await beta.wait_for_line(r"security kind=federation-priv-from-peer")


async def test_a_forged_from_is_refused_as_security(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    await peer.call("c1", Echo(text="x"), to="echo", sender="echo")
    assert (await peer.next("refused", id="c1"))["code"] == "invalid-envelope"
    await beta.wait_for_line(r"security kind=federation-forged-from")


async def test_meta_questions_need_allow_remote(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    question = b'<list-capabilities xmlns="https://xml-pipeline.org/ns/core/v1"/>'
    await peer.call("c1", question, to=None)
    assert (await peer.next("refused", id="c1"))["code"] == "unroutable"


async def test_an_invalid_payload_is_refused_and_nothing_runs(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    await peer.call("c1", b'<echo xmlns="https://xml-pipeline.org/ns/echo/v1"><x/></echo>',
                    to="echo")
    assert (await peer.next("refused", id="c1"))["code"] == "invalid-payload"


async def test_garbage_after_the_handshake_closes_the_link(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    assert peer.ws is not None
    await peer.ws.send(b"\x00not json")
    await closed_as_unexpected(beta, peer)


async def test_frames_sharing_a_message_are_each_handled_and_checked(
    beta: DaemonProcess,
) -> None:
    """Lines of one message are frames like any other: each call answered, and a line
    that is not a frame closes the link as a lone one would."""
    peer = await peer_of(beta)
    assert peer.ws is not None
    calls = [{"t": "call", "id": f"m{i}", "envelope": peer.envelope(Echo(text=str(i)), "echo")}
             for i in range(3)]
    await peer.ws.send("\n".join(json.dumps(c) for c in calls).encode())
    for i in range(3):
        accepted = await peer.next("accepted", id=f"m{i}")
        reply = await peer.next("reply", thread=accepted["thread"])
        assert from_xml(EchoReply, payload_of(reply)).text == str(i)
    await peer.ws.send(json.dumps(calls[0]).encode() + b"\n\x00not json")
    await closed_as_unexpected(beta, peer)


async def test_a_small_frame_limit_bounds_frames_not_the_messages_that_share_them(
    tmp_path: Path,
) -> None:
    """A peer coalesces up to 16 KiB whatever this side's `max_frame_bytes`: calls
    sharing a message longer than the limit are each served; one frame over it
    closes the link as a lone message over it would."""
    d = DaemonProcess(serving_beta(tmp_path, max_frame_bytes=2048))
    await d.start()
    try:
        peer = await peer_of(d)
        assert peer.ws is not None
        calls = [json.dumps({"t": "call", "id": f"s{i}",
                             "envelope": peer.envelope(Echo(text=f"{i}" * 200), "echo")})
                 for i in range(8)]
        message = "\n".join(calls).encode()
        assert len(message) > 2048 and max(len(c) for c in calls) < 2048
        await peer.ws.send(message)
        for i in range(8):
            accepted = await peer.next("accepted", id=f"s{i}")
            reply = await peer.next("reply", thread=accepted["thread"])
            assert from_xml(EchoReply, payload_of(reply)).text == f"{i}" * 200
        big = json.dumps({"t": "call", "id": "big",
                          "envelope": peer.envelope(Echo(text="x" * 3000), "echo")})
        await peer.ws.send((calls[0] + "\n" + big).encode())
        async with asyncio.timeout(30):
            await peer.ws.wait_closed()
        assert peer.ws.close_code == 1009
        assert d.proc is not None and d.proc.returncode is None  # still serving
    finally:
        await d.stop(signal.SIGKILL)


async def test_a_call_past_the_admission_cap_is_refused_without_echoing_a_bad_id(
    tmp_path: Path,
) -> None:
    """Two calls in one message with one admission slot: the second is refused
    `rate-limited`, and an id that is not a call id is not sent back."""
    d = DaemonProcess(serving_beta(tmp_path, max_inflight_calls=1))
    await d.start()
    try:
        peer = await peer_of(d)
        assert peer.ws is not None
        first = {"t": "call", "id": "cap1", "envelope": peer.envelope(Echo(text="1"), "echo")}
        second = {"t": "call", "id": "not a call id " + "x" * 3000,
                  "envelope": peer.envelope(Echo(text="2"), "echo")}
        await peer.ws.send((json.dumps(first) + "\n" + json.dumps(second)).encode())
        refused = await peer.next("refused")
        assert refused["id"] == "" and refused["code"] == "rate-limited"
        accepted = await peer.next("accepted", id="cap1")
        reply = await peer.next("reply", thread=accepted["thread"])
        assert from_xml(EchoReply, payload_of(reply)).text == "1"
    finally:
        await d.stop(signal.SIGKILL)


async def test_a_flooding_peer_meets_its_own_rate_limit(tmp_path: Path) -> None:
    d = DaemonProcess(serving_beta(tmp_path, rate_per_s=1.0, rate_burst=3))
    await d.start()
    try:
        peer = await peer_of(d)
        for i in range(10):
            await peer.call(f"f{i}", Echo(text=str(i)), to="echo")
        outcomes = [await peer.next_of_call(f"f{i}") for i in range(10)]
        assert outcomes.count("accepted") <= 4
        assert "rate-limited" in outcomes
        assert d.proc is not None and d.proc.returncode is None  # still serving
    finally:
        await d.stop(signal.SIGKILL)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_peer_that_never_reads_is_cut_off_not_buffered(beta: DaemonProcess) -> None:
    """A peer floods calls (each answered with a refusal) and reads nothing back: the
    link's send queue is bounded, the link is closed as a security event, and the
    daemon's memory does not follow the flood."""
    assert beta.proc is not None
    peer = await peer_of(beta)
    assert peer.ws is not None
    before = rss_mib(beta.proc.pid)
    burst = "\n".join('{"t":"call","id":"' + "x" * 60 + str(i) + '"}' for i in range(500))

    async def flood() -> None:
        assert peer.ws is not None
        with contextlib.suppress(ConnectionClosed):
            while True:  # never reads: websockets stops reading once 16 frames wait
                await peer.ws.send(burst)

    flooding = asyncio.create_task(flood())
    try:
        await beta.wait_for_line(r"security kind=federation-peer-not-reading", timeout=120)
    finally:
        flooding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flooding
    assert rss_mib(beta.proc.pid) - before < 200  # the queue's cap is 16 MiB
    peer.ws.transport.abort()
    fresh = await peer_of(beta)  # the gateway takes the peer again
    await fresh.call("after", Echo(text="ok"), to="echo")
    assert await fresh.next_of_call("after") == "accepted"
    await fresh.close()


async def test_the_same_call_twice_runs_once(beta: DaemonProcess) -> None:
    peer = await peer_of(beta)
    await peer.call("dup", Echo(text="once"), to="echo")
    await peer.call("dup", Echo(text="once"), to="echo", again=True)
    first = await peer.next("accepted", id="dup")
    second = await peer.next("accepted", id="dup")
    assert first["thread"] == second["thread"]
    reply = await peer.next("reply", thread=first["thread"])
    await peer.ack(reply)
    await peer.call("after", Echo(text="barrier"), to="echo")
    barrier = await peer.next("accepted", id="after")
    await peer.next("reply", thread=barrier["thread"])
    replies = [f for f in peer.received if f["t"] == "reply" and f["thread"] == first["thread"]]
    assert len(replies) == 1


async def test_callee_killed_mid_call_answers_once_after_restart(tmp_path: Path) -> None:
    home = serving_beta(tmp_path)
    d = DaemonProcess(home, env={"AGENTD_TEST_HOLD": "block"})
    await d.start()
    port = federation_port(d)
    try:
        peer = await peer_of(d)
        await peer.call("k1", Hold(n=7), to="hold")
        accepted = await peer.next("accepted", id="k1")
        await d.stop(signal.SIGKILL)  # the handler is blocked: no reply yet
        edit_config(home, lambda doc: doc["federation"].update(listen=f"127.0.0.1:{port}"))
        d = DaemonProcess(home)  # hold answers now
        await d.start()
        peer = await peer_of(d)
        # The caller did not see `accepted` (as far as it knows): it sends again.
        await peer.call("k1", Hold(n=7), to="hold", again=True)
        again = await peer.next("accepted", id="k1")
        assert again["thread"] == accepted["thread"]
        reply = await peer.next("reply", thread=accepted["thread"])
        done = from_xml(Done, payload_of(reply))
        assert (done.seq, done.by) == (7, "redelivered")  # the recovered call, not a new one
        await peer.ack(reply)
        await peer.call("k2", Hold(n=8), to="hold")  # a barrier: later than any duplicate
        k2 = await peer.next("accepted", id="k2")
        await peer.next("reply", thread=k2["thread"])
        answers = [f for f in peer.received if f["t"] == "reply"
                   and f["thread"] == accepted["thread"]]
        assert len(answers) == 1
    finally:
        await d.stop(signal.SIGKILL)


async def test_an_unacknowledged_reply_is_sent_again_on_the_next_link(
    beta: DaemonProcess,
) -> None:
    peer = await peer_of(beta)
    await peer.call("r1", Echo(text="again"), to="echo")
    accepted = await peer.next("accepted", id="r1")
    first = await peer.next("reply", thread=accepted["thread"])
    await peer.close()  # no ack: the row stays in beta's outbox
    peer = await peer_of(beta)
    second = await peer.next("reply", thread=accepted["thread"])
    assert second["id"] == first["id"]
    await peer.ack(second)
    await peer.close()
    peer = await peer_of(beta)  # acknowledged: not sent a third time
    await peer.call("r2", Echo(text="barrier"), to="echo")
    barrier = await peer.next("accepted", id="r2")
    await peer.next("reply", thread=barrier["thread"])
    assert not [f for f in peer.received if f.get("thread") == accepted["thread"]]

