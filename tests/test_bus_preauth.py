"""Connections that have not authenticated yet are capped per source address and in
all: idle sockets cannot lock clients out. Real TLS sockets on loopback, from
several source addresses of 127.0.0.0/8; the caps' bookkeeping is also tested as a
plain object, and a costly refusal is charged to its sender's rate."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.frames import Frame, Opcode

from agentd._errors import HuhCode
from agentd._schemas import NS_AUTH, NS_DELIVERY, NS_STREAM, schema
from agentd.bus import BusSession, SessionLimits, auth_frame
from agentd.bus._auth import parse_auth_frame
from agentd.bus._limits import TokenBucket, UnauthenticatedSlots
from agentd.pump import SubmitResult
from agentd.tools.calculator import Add
from tests.test_bus_support import Rig, start_rig, stop_rig

# ---- the caps as values -------------------------------------------------------------


def test_slots_are_capped_per_address_and_in_all() -> None:
    slots = UnauthenticatedSlots(total=4, per_address=2)
    assert slots.take("10.0.0.1") and slots.take("10.0.0.1")
    assert not slots.take("10.0.0.1")  # its own cap
    assert slots.take("10.0.0.2") and slots.take("10.0.0.3")
    assert not slots.take("10.0.0.4")  # the total
    slots.release("10.0.0.1")
    assert slots.held_by("10.0.0.1") == 1 and slots.count == 3
    assert slots.take("10.0.0.4")
    slots.release("10.0.0.9")  # never held: nothing changes
    assert slots.count == 4


def test_a_costly_refusal_is_charged_to_the_senders_rate() -> None:
    bucket = TokenBucket(rate=10.0, burst=20, now=0.0)
    session = BusSession(SessionLimits(100, 60.0, 1 << 22, 1 << 18))
    session.auth_result(("alice", "token"), bucket)
    session.outbox_loaded(())
    refused = SubmitResult("t", code=HuhCode.INVALID_PAYLOAD)
    actions = session.submitted("t", refused, 0.0, size=200 * 1024)
    assert bucket.tokens == -20.0  # 200 tokens owed, at most a burst in debt
    # Its socket is not read until the debt is paid (2.1 s of its rate).
    assert not session.reading
    assert [type(a).__name__ for a in actions] == ["PauseReading", "SetTimer"]
    assert actions[1].at == pytest.approx(2.1)
    assert session.next_deadline() == pytest.approx(2.1)
    assert session.tick(1.0)[1] == () and not session.reading
    assert [type(a).__name__ for a in session.tick(2.1)[1]] == ["ResumeReading"]
    assert bucket.take(2.2)


def test_an_accepted_envelope_costs_one_token_whatever_its_size() -> None:
    bucket = TokenBucket(rate=10.0, burst=20, now=0.0)
    session = BusSession(SessionLimits(100, 60.0, 1 << 22, 1 << 18))
    session.auth_result(("alice", "token"), bucket)
    session.outbox_loaded(())
    session.submitted("t", SubmitResult("t", seq=1), 0.0, size=200 * 1024)
    session.submitted("t", SubmitResult("t", code=HuhCode.RATE_LIMITED), 0.0, size=1 << 17)
    assert bucket.tokens == 20.0
    assert session.reading


def test_an_auth_frame_of_many_attributes_never_reaches_the_schema_validator() -> None:
    # The validator reports one error per attribute: about 1 ms for 4 KiB, before a
    # client has even authenticated.
    auth_schema = schema(NS_AUTH)
    good = auth_frame("alice", totp="123456")
    assert parse_auth_frame(good) is not None and len(auth_schema.error_log) == 0
    crowded = good.replace(b"<auth ", b"<auth " + " ".join(
        f'a{i}="1"' for i in range(300)).encode() + b" ")
    assert len(crowded) < 4096
    assert parse_auth_frame(crowded) is None
    assert len(auth_schema.error_log) == 0  # the last validation is still the good one


# ---- real sockets ------------------------------------------------------------------------


@pytest.fixture
async def capped(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await start_rig(
        tmp_path, bus={"max_unauthenticated_per_ip": 3, "max_unauthenticated": 5}
    )
    try:
        yield r
    finally:
        await stop_rig(r)


def trusting(rig: Rig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(rig.cafile))
    ctx.check_hostname = False
    return ctx


class Idle:
    """TLS sockets that never speak: what an attacker holds."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.writers: list[asyncio.StreamWriter] = []

    async def open(self, source: str) -> asyncio.StreamReader:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.rig.bus.port, ssl=trusting(self.rig), local_addr=(source, 0)
        )
        self.writers.append(writer)
        return reader

    async def cut_at_once(self, source: str) -> bool:
        """Whether a new socket from `source` is closed without a byte sent."""
        reader = await self.open(source)
        try:
            async with asyncio.timeout(5):
                return await reader.read(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def test_idle_sockets_from_one_address_are_capped(capped: Rig) -> None:
    idle = Idle(capped)
    try:
        for _ in range(3):
            await idle.open("127.0.0.2")
        assert await idle.cut_at_once("127.0.0.2")
        assert capped.bus.unauthenticated.held_by("127.0.0.2") == 3
        # Another address is not locked out by them.
        async with capped.client("alice") as alice:
            assert capped.bus.unauthenticated.count == 3  # alice's slot went with her auth
            assert alice.session
    finally:
        await idle.close()


async def test_idle_sockets_are_capped_in_all_and_never_crowd_out_a_client(
    capped: Rig,
) -> None:
    alice = await capped.login("alice")  # authenticated before the flood
    idle = Idle(capped)
    try:
        for source in ("127.0.0.2", "127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"):
            await idle.open(source)
        assert await idle.cut_at_once("127.0.0.4")
        assert capped.bus.unauthenticated.count == 5
        frames = await alice.exchange(Add(a=20, b=22), timeout=30)
        assert b"<value>42</value>" in frames[-1]
    finally:
        await alice.close()
        await idle.close()


# ---- after a refusal ----------------------------------------------------------------


class RawSocket:
    """A WebSocket spoken by hand over TLS: it keeps sending after the server closed,
    which no client library does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, rig: Rig) -> RawSocket:
        reader, writer = await asyncio.open_connection("127.0.0.1", rig.bus.port,
                                                       ssl=trusting(rig))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /bus HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                      f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 101 " in head.split(b"\r\n")[0], head
        return cls(reader, writer)

    def send(self, opcode: Opcode, data: bytes) -> None:
        self.writer.write(Frame(opcode, data).serialize(mask=True))

    async def until(self, opcode: Opcode) -> Frame:
        async with asyncio.timeout(10):
            while True:
                frame = await self._next()
                if frame.opcode is opcode:
                    return frame

    async def _next(self) -> Frame:
        """One frame from the server (never masked, never fragmented here)."""
        head = await self.reader.readexactly(2)
        length = head[1] & 0x7F
        if length == 126:
            length = int.from_bytes(await self.reader.readexactly(2), "big")
        elif length == 127:
            length = int.from_bytes(await self.reader.readexactly(8), "big")
        return Frame(Opcode(head[0] & 0x0F), await self.reader.readexactly(length))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def test_frames_sent_after_a_refused_auth_are_not_kept(tmp_path: Path) -> None:
    """A peer refused (wrong TOTP) is sent close 4401 but may go on sending until the
    closing handshake times out: none of it may pile up in the daemon."""
    rig = await start_rig(tmp_path)
    sock = await RawSocket.open(rig)
    try:
        (conn,) = rig.bus._live
        sock.send(Opcode.BINARY, auth_frame("alice", totp="000000"))
        closing = await sock.until(Opcode.CLOSE)
        assert int.from_bytes(closing.data[:2], "big") == 4401
        for _ in range(32):
            sock.send(Opcode.BINARY, b"<x>" + b"A" * (64 * 1024) + b"</x>")
        sock.send(Opcode.PING, b"sync")  # answered once every frame before it is read
        assert (await sock.until(Opcode.PONG)).data == b"sync"
        assert not conn._inbox and not conn._fragments
    finally:
        await sock.close()
        await stop_rig(rig)


def test_an_auth_frame_carries_the_last_delivery_seq_and_the_stream_opt_in() -> None:
    plain = parse_auth_frame(auth_frame("alice", session="s" * 22))
    assert plain is not None and (plain.delivered, plain.stream) == (None, False)
    both = parse_auth_frame(auth_frame("alice", session="s" * 22, delivered=17, stream=True))
    assert both is not None and (both.delivered, both.stream) == (17, True)
    seq = f'<d:seq xmlns:d="{NS_DELIVERY}">'
    base = auth_frame("alice", totp="123456")
    for bad in (f"{seq}-1</d:seq>", f"{seq}1e3</d:seq>", f"{seq}{'9' * 19}</d:seq>",
                f"{seq}1</d:seq>{seq}2</d:seq>", f'<s:stream xmlns:s="{NS_STREAM}"/>{seq}1</d:seq>',
                f'<s:stream xmlns:s="{NS_STREAM}">yes</s:stream>'):
        assert parse_auth_frame(base.replace(b"</auth>", bad.encode() + b"</auth>")) is None, bad
