"""The bus's asyncio adapter: the only module that calls websockets on the server side.

`BusConnection` is an `asyncio.Protocol` the loop feeds with bytes. It runs
websockets' sans-I/O `ServerProtocol` for the opening handshake and the framing
(public API only: `receive_data`, `events_received`, `send_text`, `data_to_send`;
the text frames it sends on a connection with no extension are framed here, the
same bytes without a `Frame` object each: `text_frames`),
hands text frames and timer expiries to its `BusSession`, and carries out the
actions the session returns (authenticate, close, pause or resume reading; its
`SessionFeed` submits to the pump and loads and acknowledges the outbox). Frames
queued for one connection within a loop turn leave in a single `transport.write`:
the TLS transport makes every write a record and a send() of its own, so one write
per batch instead of one per frame.

Invariants:
- Every byte websockets wants written is written, in order, the empty chunk (its
  end-of-stream marker) closing the transport.
- A frame is reported `delivered` to the outbox only once it is in the transport,
  or, for a client that acknowledges delivery, once the client acknowledged it.
- After the session is CLOSED nothing more is submitted or sent but the close.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections import deque
from collections.abc import Awaitable, Sequence
from http import HTTPStatus
from typing import Protocol, cast
from urllib.parse import urlsplit

from websockets.extensions.permessage_deflate import enable_server_permessage_deflate
from websockets.frames import Frame, Opcode
from websockets.http11 import Request
from websockets.protocol import State
from websockets.server import ServerProtocol

from agentd import _metrics as metrics
from agentd._streams import StreamHub
from agentd.bus._auth import ClientAuth, parse_auth_frame
from agentd.bus._feed import OrganismSide, SessionFeed
from agentd.bus._limits import TokenBucket
from agentd.bus._session import (
    CLOSE_POLICY,
    Acknowledge,
    Action,
    Authenticate,
    BusSession,
    Close,
    ConnState,
    LoadOutbox,
    PauseReading,
    ResumeReading,
    ResumeStream,
    SetTimer,
    Submit,
)
from agentd.config import BusConfig

log = logging.getLogger("agentd.bus")

# A server's unfragmented text frame: FIN and the text opcode, no mask, the length in
# 7 bits, or 126 and 16 bits, or 127 and 64 bits (RFC 6455 5.2), as websockets writes
# it; heads of the short lengths made once.
_TEXT = 0x81
_SHORT_HEADS = [bytes((_TEXT, n)) for n in range(126)]
_HEAD_16 = struct.Struct("!BBH")
_HEAD_64 = struct.Struct("!BBQ")


def text_frames(chunks: list[bytes], batch: Sequence[tuple[bytes, object]]) -> list[bytes]:
    """`chunks` (what websockets has queued, a pong say: it goes first) followed by
    each frame of `batch` as an unfragmented text frame, header and payload: the
    bytes `ServerProtocol.send_text` writes on a connection with no extension,
    without its per-frame `Frame` object and two copies of the payload."""
    for data, _ in batch:
        n = len(data)
        if n < 126:
            chunks.append(_SHORT_HEADS[n])
        elif n < 65536:
            chunks.append(_HEAD_16.pack(_TEXT, 126, n))
        else:
            chunks.append(_HEAD_64.pack(_TEXT, 127, n))
        chunks.append(data)
    return chunks
ws_log = logging.getLogger("agentd.bus.websockets")

BUS_PATH = "/bus"
CLOSE_TIMEOUT_S = 5.0  # how long a close handshake may take before the socket is cut
WRITE_HIGH_WATER = 32 * 1024  # the transport's buffer above which sends queue up

class ConnectionHost(OrganismSide, Protocol):
    """The server as one of its connections sees it (`BusServer`): the settings,
    the pump and the outbox (`OrganismSide`), and where a connection reports what
    happened to it."""

    cfg: BusConfig
    auth: ClientAuth
    ping_interval_s: float | None
    streams: StreamHub | None  # previews of models' text, and who asked for them

    @property
    def accepting(self) -> bool: ...

    def connection_accepted(self, conn: BusConnection, address: str) -> bool: ...

    def session_opened(self, conn: BusConnection) -> BusSession: ...

    def bucket(self, client: str) -> TokenBucket: ...

    def authenticated(self, conn: BusConnection) -> None: ...

    def session_closed(
        self, conn: BusConnection, leftover: Sequence[tuple[bytes, int]] = ()
    ) -> None: ...

    def connection_lost(self, conn: BusConnection) -> None: ...


class BusConnection(asyncio.Protocol):
    """One TLS connection: websockets' framing + a `BusSession` + the loop."""

    __slots__ = (
        "_close_armed",
        "_feed",
        "_flush_at",
        "_fragments",
        "_inbox",
        "_ping",
        "_processing",
        "_protocol",
        "_timer",
        "server",
        "session",
        "transport",
        "writes",
    )

    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        cfg = server.cfg
        self._protocol = ServerProtocol(
            extensions=enable_server_permessage_deflate(None) if cfg.compression else None,
            max_size=cfg.max_envelope_bytes,
            logger=ws_log,
        )
        self.transport: asyncio.Transport | None = None
        self.session: BusSession | None = None  # once the opening handshake succeeded
        self._feed: SessionFeed | None = None  # with the session: its pump and outbox
        self.writes = 0  # transport writes of frames (one per batch)
        self._inbox: deque[bytes] | None = None  # frames received while reading is paused
        self._fragments: list[bytes] | None = None
        self._processing = False
        self._close_armed = False  # the close timeout is armed
        self._flush_at: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None  # handshake/auth timeout, TTL
        self._ping: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TLS transport is not an asyncio.Transport subclass, but is one.
        self.transport = transport = cast(asyncio.Transport, transport)
        if not self.server.connection_accepted(self, self.peer_address):
            transport.abort()
            return
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        loop = self.server.loop
        # The opening handshake and the first frame each get `auth_timeout_s`.
        self._timer = loop.call_later(self.server.cfg.auth_timeout_s, self._handshake_timeout)

    def data_received(self, data: bytes) -> None:
        protocol = self._protocol
        protocol.receive_data(data)
        events = protocol.events_received()
        self._write_protocol()
        for event in events:
            if isinstance(event, Frame):
                self._frame(event)
            elif isinstance(event, Request):
                self._handshake(event)
        if protocol.close_expected():
            self._expect_close()

    def eof_received(self) -> bool | None:
        self._protocol.receive_eof()
        self._write_protocol()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        for handle in (self._timer, self._ping, self._flush_at):
            if handle is not None:
                handle.cancel()
        self._timer = self._ping = self._flush_at = None
        self._inbox = None
        self._peer_gone()
        self.server.connection_lost(self)

    def pause_writing(self) -> None:
        if self.session is not None:
            self.session.write_paused()

    def resume_writing(self) -> None:
        session = self.session
        if session is not None:
            self._run(session.write_resumed())
            self._schedule_flush()

    # ---- opening handshake -------------------------------------------------------------

    def _handshake(self, request: Request) -> None:
        protocol, server = self._protocol, self.server
        if urlsplit(request.path).path != BUS_PATH:
            response = protocol.reject(HTTPStatus.NOT_FOUND, "not found\n")
        elif not server.accepting:
            response = protocol.reject(HTTPStatus.SERVICE_UNAVAILABLE, "try again later\n")
        else:
            response = protocol.accept(request)
        protocol.send_response(response)
        self._write_protocol()
        if protocol.state is not State.OPEN:
            return
        self.session = session = server.session_opened(self)
        self._feed = SessionFeed(session, server, self._run)
        if self._timer is not None:
            self._timer.cancel()
        loop = server.loop
        self._timer = loop.call_later(server.cfg.auth_timeout_s, self._auth_timeout)
        if server.ping_interval_s:
            self._ping = loop.call_later(server.ping_interval_s, self._keepalive, None)

    def _handshake_timeout(self) -> None:
        self._timer = None
        if self.session is None and self.transport is not None:
            self.transport.abort()

    def _auth_timeout(self) -> None:
        self._timer = None
        session = self.session
        if session is not None and session.state is ConnState.AUTHENTICATING:
            metrics.auth_failures.inc()
            log.info("auth timeout peer=%s", self.peer)
            self._run(session.auth_timed_out())

    def _keepalive(self, sent: bytes | None) -> None:
        """Ping every `ping_interval_s`; a ping unanswered by the next one fails the
        connection as websockets' own keepalive does."""
        self._ping = None
        protocol = self._protocol
        if protocol.state is not State.OPEN:
            return
        if sent is not None:
            protocol.fail(1011, "keepalive ping timeout")
            self._write_protocol()
            self._expect_close()
            return
        data = os.urandom(4)
        protocol.send_ping(data)
        self._write_protocol()
        self._ping = self.server.loop.call_later(self.server.ping_interval_s or 0, self._keepalive,
                                                 data)

    # ---- frames in -----------------------------------------------------------------------

    def _frame(self, frame: Frame) -> None:
        opcode = frame.opcode
        if opcode is Opcode.TEXT or opcode is Opcode.BINARY:
            if not frame.fin:
                self._fragments = [bytes(frame.data)]
                return
            self._message(bytes(frame.data))
        elif opcode is Opcode.CONT:
            if self._fragments is not None:
                self._fragments.append(bytes(frame.data))
                if frame.fin:
                    data, self._fragments = b"".join(self._fragments), None
                    self._message(data)
        elif opcode is Opcode.PONG:
            if self._ping is not None:  # any pong answers the outstanding ping
                self._ping.cancel()
                self._ping = self.server.loop.call_later(
                    self.server.ping_interval_s or 0, self._keepalive, None
                )
        elif opcode is Opcode.CLOSE:
            self._peer_gone()

    def _message(self, data: bytes) -> None:
        session = self.session
        if session is None or session.state is ConnState.CLOSED:
            # Closed (refused, withdrawn, overflowed): the peer may go on sending until
            # the closing handshake times out; nothing of it is read or kept.
            return
        if self._inbox or not session.reading or self._processing:
            if self._inbox is None:
                self._inbox = deque()
            self._inbox.append(data)
            if not self._processing:
                self._drain_inbox()
            return
        self._processing = True
        try:
            self._run(session.frame_received(data, self.server.loop.time()))
        finally:
            self._processing = False
        if self._inbox:
            self._drain_inbox()

    def _drain_inbox(self) -> None:
        """Frames that arrived while reading was paused (one read can carry many)."""
        session, inbox = self.session, self._inbox
        if session is None or inbox is None or self._processing:
            return
        self._processing = True
        try:
            loop = self.server.loop
            while inbox and session.reading:
                self._run(session.frame_received(inbox.popleft(), loop.time()))
        finally:
            self._processing = False
        if not inbox:
            self._inbox = None

    # ---- actions ---------------------------------------------------------------------------

    def _run(self, actions: Sequence[Action]) -> None:
        feed = self._feed
        for action in actions:
            if type(action) is Submit:
                assert feed is not None
                if action.stream and self.server.streams is not None and self.session:
                    self.server.streams.thread_opted_in(self.session.client, action.thread)
                feed.submit(action.thread, action.data)
            elif type(action) is PauseReading:
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.pause_reading()
            elif type(action) is ResumeReading:
                if self.transport is not None and not self.transport.is_closing():
                    self.transport.resume_reading()
                if self._inbox and not self._processing:
                    self.server.loop.call_soon(self._drain_inbox)
            elif type(action) is SetTimer:
                self._set_ttl_timer(action.at)
            elif type(action) is Authenticate:
                self._authenticate(action.frame)
            elif type(action) is LoadOutbox:
                assert feed is not None
                feed.load_outbox()
            elif type(action) is Acknowledge:
                assert feed is not None
                feed.acknowledge(action.ids)
            elif type(action) is ResumeStream:
                if self.server.streams is not None and self.session is not None:
                    self.server.streams.resume(self.session.client, action.stream,
                                               action.from_seq)
            elif type(action) is Close:
                self._close(action.code, action.reason)
        session = self.session
        if session is not None and session.sending:
            self._schedule_flush()

    def _authenticate(self, frame: bytes) -> None:
        session, server = self.session, self.server
        assert session is not None
        who = server.auth.authenticate(frame)
        if who is None:
            metrics.auth_failures.inc()
            log.info("auth refused peer=%s", self.peer)
            self._run(session.auth_result(None))
            return
        commit = server.auth.take_commit()
        if commit is not None:  # the session is in the kernel before the client has it
            server.spawn(self._login_committed(commit, who, frame))
            return
        self._logged_in(who, frame)

    async def _login_committed(
        self, commit: Awaitable[object], who: tuple[str, str], frame: bytes
    ) -> None:
        session = self.session
        assert session is not None
        try:
            await commit
        except Exception as exc:  # the kernel refused it: the token would not survive
            log.warning("login not committed client=%s (%s); closing", who[0], exc)
            if session.state is ConnState.AUTHENTICATING:
                self._run(session.go_away())
            return
        if session.state is ConnState.AUTHENTICATING:  # not timed out or gone meanwhile
            self._logged_in(who, frame)

    def _logged_in(self, who: tuple[str, str], frame: bytes) -> None:
        session, server = self.session, self.server
        assert session is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # Read once more for what the login asks beyond who it is (cheap: at most 4 KiB,
        # once per connection): the last delivery seq the client has.
        request = parse_auth_frame(frame)
        delivered = request.delivered if request is not None else None
        streams = request is not None and request.stream
        self._run(session.auth_result(who, server.bucket(who[0]), delivered, streams))
        server.authenticated(self)

    def _set_ttl_timer(self, at: float) -> None:
        if self._close_armed:
            return  # the timer cuts the closing connection; keep it
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.server.loop.call_at(at, self._ttl_expired)

    def _ttl_expired(self) -> None:
        self._timer = None
        session = self.session
        if session is None:
            return
        released, actions = session.tick(self.server.loop.time())
        if released:
            log.warning("in-flight envelopes never answered client=%s released=%d",
                        session.client, released)
        self._run(actions)
        deadline = session.next_deadline()
        if deadline is not None and not session.reading and self._timer is None:
            self._set_ttl_timer(deadline)

    # ---- frames out --------------------------------------------------------------------------

    def deliver(self, thread: str, data: bytes, outbox_id: int | None) -> None:
        session = self.session
        assert session is not None
        actions = session.deliver(thread, data, outbox_id)
        if actions:
            self._run(actions)
        elif self._flush_at is None and session.writable:
            self._flush_at = self.server.loop.call_soon(self._flush)

    def _schedule_flush(self) -> None:
        if self._flush_at is None:
            self._flush_at = self.server.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Write what the session has queued: one transport write per batch."""
        self._flush_at = None
        session, protocol, transport = self.session, self._protocol, self.transport
        if session is None or transport is None:
            return
        outbox = self.server.outbox
        while session.sending:
            if protocol.state is not State.OPEN or transport.is_closing():
                return  # the peer is going: queued durable frames stay in the outbox
            batch = session.frames_to_send()
            if protocol.extensions:  # permessage-deflate: websockets compresses them
                for data, _ in batch:
                    protocol.send_text(data)
                self._write_protocol()
            else:
                self._write_chunks(text_frames(protocol.data_to_send(), batch))
            self.writes += 1
            if outbox is not None:
                for _, outbox_id in batch:
                    if outbox_id is not None:
                        outbox.delivered(session.client, outbox_id)
            self._run(session.sent())

    def _write_protocol(self) -> None:
        """Hand what websockets has buffered to the transport in one write; its empty
        chunk (end of stream) closes the transport (TLS cannot half-close)."""
        self._write_chunks(self._protocol.data_to_send())

    def _write_chunks(self, chunks: list[bytes]) -> None:
        transport = self.transport
        if not chunks or transport is None:
            return
        if all(chunks):
            transport.write(b"".join(chunks) if len(chunks) > 1 else chunks[0])
            return
        for chunk in chunks:
            if chunk:
                transport.write(chunk)
            else:
                transport.close()

    # ---- endings ---------------------------------------------------------------------------

    def _close(self, code: int, reason: str) -> None:
        session = self.session
        if code == CLOSE_POLICY and session is not None:
            log.warning("client does not read; closing client=%s queued_bytes=%d",
                        session.client, session.peak_queued_bytes)
        protocol = self._protocol
        if protocol.state is State.OPEN:
            if self._flush_at is not None:  # the session dropped its queue
                self._flush_at.cancel()
                self._flush_at = None
            protocol.send_close(code, reason)
            self._write_protocol()
            self._expect_close()
        self.server.session_closed(self)

    def _expect_close(self) -> None:
        """websockets expects the TCP connection to close: cut it if the peer does
        not finish the closing handshake in time (armed once, so a peer that keeps
        sending cannot push the deadline back)."""
        if self._close_armed:
            return
        self._close_armed = True
        if self._timer is not None:
            self._timer.cancel()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._timer = self.server.loop.call_later(CLOSE_TIMEOUT_S, transport.abort)

    def _peer_gone(self) -> None:
        session = self.session
        if session is not None and session.state is not ConnState.CLOSED:
            self.server.session_closed(self, session.peer_gone())

    # ---- the server's side ----------------------------------------------------------------

    def shutdown(self) -> None:
        if self.session is not None:
            self._run(self.session.shutdown())

    def go_away(self, code: int) -> None:
        session = self.session
        if session is None:
            if self.transport is not None:
                self.transport.close()
            return
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush()
        self._run(session.go_away(code))

    def withdraw(self) -> None:
        if self.session is not None:
            self._run(self.session.withdraw())

    @property
    def sending(self) -> bool:
        """Frames are queued for this connection and not yet in the transport."""
        return self._flush_at is not None or bool(self.session and self.session.sendq)

    @property
    def peer_address(self) -> str:
        """The source address (no port): what the unauthenticated caps count by."""
        try:
            assert self.transport is not None
            return str(self.transport.get_extra_info("peername")[0])
        except Exception:
            return "?"

    @property
    def peer(self) -> str:
        try:
            assert self.transport is not None
            host, port = self.transport.get_extra_info("peername")[:2]
            return f"{host}:{port}"
        except Exception:
            return "?"

