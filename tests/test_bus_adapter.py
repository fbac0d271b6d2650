"""The bus adapter (`BusConnection`) driven without a socket: websockets' own client
protocol writes the bytes a client would send, a transport double records what the
server writes. The real server, auth and pump are those of test_bus_support; only the
socket is replaced, so these tests see the wire exactly (status lines, close codes,
how many writes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from agentd._envelope import build_envelope
from agentd._xmlify import spec_of
from agentd.bus import BusConnection, auth_frame, parse_auth_ok
from agentd.bus._adapter import text_frames
from agentd.tools.calculator import Add
from agentd.tools.echo import Echo
from tests.test_bus_support import Rig, start_rig, stop_rig


class RecordingTransport(asyncio.Transport):
    """What the adapter needs of a transport; records writes, never blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.reading = True
        self.protocol: asyncio.Protocol | None = None
        self.written = asyncio.Event()  # set on every write (for timer-driven frames)

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.written.set()

    def close(self) -> None:
        if not self.closed and self.protocol is not None:
            # As a real transport: the protocol hears of it in a later callback.
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)
        self.closed = True

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 50000) if name == "peername" else default


OPEN_WIRES: list[Wire] = []


class Wire:
    """One client (websockets' sans-I/O ClientProtocol) wired to one BusConnection."""

    def __init__(self, rig: Rig, path: str = "/bus", extensions: Any = None) -> None:
        self.client = ClientProtocol(parse_uri(f"wss://127.0.0.1:{rig.bus.port}{path}"),
                                     extensions=extensions)
        self.transport = RecordingTransport()
        self.conn: BusConnection = rig.bus.new_connection()
        self.transport.protocol = self.conn
        self.conn.connection_made(self.transport)
        OPEN_WIRES.append(self)
        self.pending: list[Any] = []  # events pulled together with an earlier one
        self.client.send_request(self.client.connect())
        self.push()

    def push(self) -> None:
        """What the client has to send, into the server."""
        for chunk in self.client.data_to_send():
            if chunk:
                self.conn.data_received(chunk)

    def pull(self) -> list[Any]:
        """What the server wrote, into the client: its events."""
        writes, self.transport.writes = self.transport.writes, []
        for chunk in writes:
            self.client.receive_data(chunk)
        return self.client.events_received()

    def send(self, data: bytes) -> None:
        self.client.send_text(data)
        self.push()

    async def next_frame(self) -> Frame:
        """Wait for the server's next write (a timer may cause it); its one frame."""
        if self.pending:
            return self.pending.pop(0)
        self.transport.written.clear()
        await asyncio.wait_for(self.transport.written.wait(), 5)
        [frame] = self.pull()
        assert isinstance(frame, Frame)
        return frame


async def next_turn() -> None:
    """Let callbacks already scheduled with call_soon run (one loop iteration)."""
    await asyncio.sleep(0)


async def stop(rig: Rig) -> None:
    """Cut every wire (as a client vanishing would), then stop the server."""
    while OPEN_WIRES:
        OPEN_WIRES.pop().transport.abort()
    await stop_rig(rig)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = await start_rig(tmp_path, bus={"max_envelope_bytes": 4096})
    yield r
    await stop(r)


async def logged_in(rig: Rig, extensions: Any = None) -> Wire:
    wire = Wire(rig, extensions=extensions)
    [response] = wire.pull()
    assert isinstance(response, Response) and response.status_code == 101
    wire.send(auth_frame("alice", totp=rig.code("alice")))
    rig.next_step()
    await next_turn()  # the outbox is read in a task
    await next_turn()
    # On a slow machine a keepalive ping may already follow the auth-ok: keep it
    # for the test's next_frame().
    ok, *wire.pending = wire.pull()
    assert parse_auth_ok(ok.data) is not None
    return wire


async def test_a_path_other_than_bus_gets_404_and_the_socket_closes(rig: Rig) -> None:
    wire = Wire(rig, "/metrics")
    [response] = wire.pull()
    assert isinstance(response, Response) and response.status_code == 404
    assert response.body == b"not found\n"
    assert wire.transport.closed and wire.conn.session is None


async def test_a_full_server_answers_503(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"max_connections": 1})
    try:
        first = Wire(r)
        assert first.pull()[0].status_code == 101
        second = Wire(r)
        [response] = second.pull()
        assert response.status_code == 503 and response.body == b"try again later\n"
    finally:
        await stop(r)


async def test_unauthenticated_sockets_past_the_address_cap_are_cut_until_one_authenticates(
    tmp_path: Path,
) -> None:
    r = await start_rig(tmp_path, bus={"max_unauthenticated_per_ip": 2})
    sockets: list[RecordingTransport] = []

    def socket_accepted() -> RecordingTransport:
        """A socket whose TLS handshake is done, before its first byte."""
        transport = RecordingTransport()
        transport.protocol = conn = r.bus.new_connection()
        conn.connection_made(transport)
        sockets.append(transport)
        return transport

    try:
        first, _second = Wire(r), Wire(r)
        assert socket_accepted().closed  # a third from 127.0.0.1: cut before a byte
        first.pull()
        first.send(auth_frame("alice", totp=r.code("alice")))
        await next_turn()  # the outbox is read in a task
        await next_turn()
        [ok] = first.pull()
        assert parse_auth_ok(ok.data) is not None
        assert not socket_accepted().closed  # first's slot went with its authentication
        assert socket_accepted().closed
    finally:
        for transport in sockets:
            transport.abort()
        await stop(r)


async def test_the_first_frame_is_authentication_and_a_bad_one_closes_4401(rig: Rig) -> None:
    wire = Wire(rig)
    wire.pull()
    wire.send(b"hello")
    [close] = wire.pull()
    assert isinstance(close, Frame) and close.opcode is Opcode.CLOSE
    assert Close.parse(close.data) == Close(4401, "authentication failed")
    assert rig.bus.connections == 0


async def test_an_oversize_frame_closes_with_1009(rig: Rig) -> None:
    wire = await logged_in(rig)
    wire.send(b"<x>" + b"a" * 5000 + b"</x>")
    [close] = wire.pull()
    assert close.opcode is Opcode.CLOSE and Close.parse(close.data).code == 1009
    assert rig.submitted == []


async def test_an_envelope_in_fragments_is_submitted_once_whole(rig: Rig) -> None:
    wire = await logged_in(rig)
    thread = str(uuid.uuid4())
    data = build_envelope("alice", thread, spec_of(Add).to_bytes(Add(a=2, b=3)))
    half = len(data) // 2
    wire.client.send_text(data[:half], fin=False)
    wire.client.send_continuation(data[half:], fin=True)
    wire.push()
    assert rig.submitted == [("alice", data)]


async def test_frames_delivered_in_one_loop_turn_leave_in_one_write(rig: Rig) -> None:
    wire = await logged_in(rig)
    thread = str(uuid.uuid4())
    burst = [build_envelope("echo", thread, spec_of(Echo).to_bytes(Echo(text=f"n{i}")),
                            to="alice") for i in range(50)]
    for frame in burst:
        rig.bus.deliver("alice", thread, frame)
    assert wire.transport.writes == []  # queued, not written, within the turn
    await next_turn()
    assert len(wire.transport.writes) == 1
    assert [f.data for f in wire.pull()] == burst


def test_text_frames_are_the_bytes_websockets_writes() -> None:
    """The adapter frames what it sends itself (no extension negotiated): the same
    bytes as websockets' own text frame, for each length encoding, after what
    websockets had queued."""
    for n in (0, 1, 125, 126, 127, 65535, 65536, 70000):
        data = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
        ours = b"".join(text_frames([], [(data, None)]))
        assert ours == Frame(Opcode.TEXT, data).serialize(mask=False)
    assert text_frames([b"pong"], [(b"a", 1), (b"bc", None)]) == [
        b"pong", b"\x81\x01", b"a", b"\x81\x02", b"bc"]


async def test_frames_of_each_length_encoding_reach_a_client_whole(rig: Rig) -> None:
    wire = await logged_in(rig)
    thread = str(uuid.uuid4())
    burst = [build_envelope("echo", thread, b'<big xmlns="urn:t">' + b"y" * k + b"</big>",
                            to="alice") for k in (1, 70_000, 300)]
    assert len(burst[1]) >= 65536 and 126 <= len(burst[2]) < 65536
    for frame in burst:
        rig.bus.deliver("alice", thread, frame)
    await next_turn()
    assert len(wire.transport.writes) == 1
    got = wire.pull()
    assert [(f.opcode, f.fin) for f in got] == [(Opcode.TEXT, True)] * 3
    assert [f.data for f in got] == burst


async def test_with_compression_on_frames_go_out_compressed(tmp_path: Path) -> None:
    """With permessage-deflate negotiated, websockets frames (and compresses) what
    the adapter sends: the frames arrive whole and marked compressed (RSV1)."""
    r = await start_rig(tmp_path, bus={"compression": True})
    try:
        wire = await logged_in(r, extensions=[ClientPerMessageDeflateFactory()])
        assert wire.client.extensions  # negotiated
        thread = str(uuid.uuid4())
        burst = [build_envelope("echo", thread, spec_of(Echo).to_bytes(Echo(text="z" * k)),
                                to="alice") for k in (10, 4000)]
        for frame in burst:
            r.bus.deliver("alice", thread, frame)
        await next_turn()
        written = b"".join(wire.transport.writes)
        assert written[0] & 0x40 and len(written) < len(burst[1])  # RSV1: compressed
        assert [f.data for f in wire.pull()] == burst
    finally:
        await stop(r)


async def test_reading_pauses_while_the_window_is_full(tmp_path: Path) -> None:
    from tests.test_bus_support import GATE, Gate

    r = await start_rig(tmp_path, bus={"max_inflight": 1})
    GATE["event"] = asyncio.Event()
    try:
        wire = await logged_in(r)
        for i in range(3):
            wire.send(build_envelope("alice", str(uuid.uuid4()),
                                     spec_of(Gate).to_bytes(Gate(n=i))))
        assert not wire.transport.reading and len(r.submitted) == 1
        GATE["event"].set()
        await r.pump.join()  # each answer frees the slot for the next envelope
        assert wire.transport.reading and len(r.submitted) == 3
    finally:
        GATE["event"].set()
        await stop(r)


async def test_the_peer_closing_ends_the_session(rig: Rig) -> None:
    wire = await logged_in(rig)
    wire.client.send_close(1000)
    wire.push()
    assert rig.bus.connections == 0 and not rig.bus.connections_of("alice")
    [close] = wire.pull()
    assert close.opcode is Opcode.CLOSE and wire.transport.closed


async def test_pings_answered_keep_the_connection_an_unanswered_one_closes_1011(
    tmp_path: Path,
) -> None:
    r = await start_rig(tmp_path, server_kw={"ping_interval_s": 0.05})
    try:
        wire = await logged_in(r)
        ping = await wire.next_frame()
        assert ping.opcode is Opcode.PING
        wire.push()  # the client protocol answered with a pong
        assert (await wire.next_frame()).opcode is Opcode.PING  # still open: pinged again
        close = await wire.next_frame()  # that one was not answered
        assert close.opcode is Opcode.CLOSE
        assert Close.parse(close.data) == Close(1011, "keepalive ping timeout")
    finally:
        await stop(r)
