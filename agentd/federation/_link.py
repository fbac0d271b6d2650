"""The federation's I/O: the `/federation` endpoint, one dialer per gateway with a
URL, and the authenticated links. The decisions live in `_handshake` (who the
peer is) and `_gateway` (link states, backoff, which of two links survives).

Invariants:
- Nothing but a handshake frame is read from a link before the handshake is done;
  a handshake that has not finished within `handshake_timeout_s` fails.
- Every handshake failure closes with the same code and reason
  (`HANDSHAKE_FAILED`) and is reported as the security event
  `federation-handshake-failed`, with the precise cause in the event only.
- At most `MAX_PENDING_HANDSHAKES` accepted connections are unauthenticated at a
  time; more are refused at the HTTP upgrade.
- Dialers never use a proxy from the environment and speak only TLS 1.3 (the
  channel binding needs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import ssl
import time
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.http11 import Request, Response

from agentd._errors import GENERIC_MESSAGES, HuhCode
from agentd._xml import DEFAULT_SHAPE, ShapeLimits
from agentd.bus import TokenBucket
from agentd.config import FederationConfig, GatewayConfig
from agentd.federation._binding import ChannelBindingUnavailable, tls_exporter
from agentd.federation._calls import CallRefused, admit_call, call_id_of
from agentd.federation._frames import (
    SEND_QUEUE_BYTES,
    FrameQueue,
    FrameTooLarge,
    encode_within,
    lines,
    message_limit,
    too_big,
)
from agentd.federation._gateway import Backoff, LinkEvent, LinkState, keeps_link
from agentd.federation._handshake import (
    HANDSHAKE_FAILED,
    Handshake,
    HandshakeFailed,
    Role,
)
from agentd.federation._identity import Identity, parse_public_line
from agentd.federation._outbox import GatewayOutbox
from agentd.federation._peers import MAX_PENDING_REPLIES, Audit, CallHost, GatewayLink
from agentd.federation._pins import SchemaPins
from agentd.federation._remote import (
    MAX_OFFERS,
    RemoteCalls,
    calls_for,
    sweep_forever,
)
from agentd.federation._replies import ReplyWindow

log = logging.getLogger("agentd.federation")

FEDERATION_PATH = "/federation"
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009  # as websockets closes on a message over its max_size
MAX_PENDING_HANDSHAKES = 16
SECURITY_KINDS = frozenset({
    "federation-handshake-failed", "federation-unexpected-frame", "federation-forged-from",
    "federation-priv-from-peer", "federation-not-exported", "federation-schema-changed",
    "federation-reply-refused", "federation-bad-offer", "federation-schema-mismatch",
    "federation-peer-not-reading",
})

def federation_server_context(config: FederationConfig) -> ssl.SSLContext:
    from agentd.bus import server_context

    ctx = server_context(config.tls)  # the bus's hardened settings and key checks
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def gateway_client_context(gateway: GatewayConfig) -> ssl.SSLContext:
    """Without `cafile` the certificate is not checked: the peer is identified by
    its signature over this channel's exporter value, which a relay cannot forge."""
    from agentd.bus import client_context

    ctx = client_context(gateway.cafile, verify=gateway.cafile is not None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


class Federation:
    """The endpoint, the dialers and the links of one organism."""

    def __init__(
        self,
        identity: Identity,
        config: FederationConfig,
        gateways: tuple[GatewayConfig, ...],
        audit: Audit,
        server_ssl: ssl.SSLContext | None = None,
        rng: Callable[[], float] = random.random,
        host: CallHost | None = None,
        allow_meta: bool = False,
        max_envelope_bytes: int = 262144,
        shape: ShapeLimits = DEFAULT_SHAPE,
        state_dir: Path | None = None,
        on_pinned: Callable[[], None] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.host = host
        self.allow_meta = allow_meta
        self.max_envelope_bytes = max_envelope_bytes
        self.shape = shape  # the pump's bound on an envelope's shape
        self.identity = identity
        self.config = config
        self.audit = audit
        self.rng = rng
        self.server_ssl = server_ssl
        self.backoff = Backoff(config.backoff_initial_s, config.backoff_max_s)
        self.links = {
            g.name: GatewayLink(g, parse_public_line(g.public_key)) for g in gateways
        }
        self.peers = {name: link.public_key for name, link in self.links.items()}
        self._server: Server | None = None
        self._dialers: list[asyncio.Task[None]] = []
        self._pending = 0
        self._stopping = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.outbox = GatewayOutbox(host, self._send, self._tasks)
        # Calls being admitted, by thread: a duplicate waits for the first's outcome.
        self._admitting: dict[str, asyncio.Future[tuple[bool, HuhCode | None]]] = {}
        # Calling the peer's listeners: calls in flight, pins, offers not yet accepted.
        self.outgoing = {name: calls_for(name) for name, link in self.links.items()
                         if link.config.import_}
        self.pins = SchemaPins(state_dir, self.outgoing, audit, on_pinned)
        for name, calls in self.outgoing.items():
            for remote in self.links[name].config.import_:
                pinned = remote in self.pins.pins.get(name, {})
                calls.imports[remote] = "pinned" if pinned else "unpinned"

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        host, _, port = self.config.listen.rpartition(":")
        self._server = await serve(
            self._accepted,
            host.strip("[]"),
            int(port),
            ssl=self.server_ssl or federation_server_context(self.config),
            process_request=self._upgrade,
            max_size=message_limit(self.config.max_frame_bytes),
            compression=None,
            open_timeout=self.config.handshake_timeout_s,
            server_header=None,
            logger=logging.getLogger("agentd.federation.websockets"),
        )
        log.info("federation listening url=wss://%s:%d%s", host, self.port, FEDERATION_PATH)
        for name, calls in self.outgoing.items():
            calls.adopt(self._sender(self.links[name]), self.audit)
        if self.outgoing:
            self._tasks.add(asyncio.create_task(sweep_forever(self._stopping),
                                                name="federation-sweep"))
        for link in self.links.values():
            if link.config.url is not None:
                self._dialers.append(asyncio.create_task(
                    self._dial_forever(link), name=f"federation-dial-{link.config.name}"))

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self._stopping.set()
        for calls in self.outgoing.values():
            calls.release()
        for call in list(self._tasks):
            call.cancel()
        for task in self._dialers:
            task.cancel()
        for task in self._dialers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links.values():
            link.apply(LinkEvent.STOP)
            if link.connection is not None:
                await link.connection.close(1001, "going away")
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def status(self) -> list[dict[str, Any]]:
        """Each gateway's link, the state and pinned SHA-256 of what it imports, and the
        SHA-256 of what it exports (what the peer's operator may declare in
        `schema_pins`)."""
        out = []
        for name, link in self.links.items():
            row = link.status(self.outgoing[name].imports if name in self.outgoing else None)
            pins = self.pins.pins.get(name, {})
            row["import_sha256"] = {n: pins[n].digest for n in link.config.import_ if n in pins}
            offers = self.host.offers(list(link.config.export)) if self.host is not None else []
            row["export_sha256"] = {o.name: o.digest for o in offers}
            out.append(row)
        return out

    # ---- accepting -------------------------------------------------------------

    def _upgrade(self, connection: ServerConnection, request: Request) -> Response | None:
        if request.path != FEDERATION_PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        if self._pending >= MAX_PENDING_HANDSHAKES or self._stopping.is_set():
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "busy\n")
        return None

    async def _accepted(self, ws: ServerConnection) -> None:
        self._pending += 1
        try:
            authenticated = await self._handshake(ws, Role.ACCEPTOR, None)
        finally:
            self._pending -= 1
        if authenticated is not None:
            peer, limit = authenticated
            await self._run(self.links[peer], ws, dialed=False, peer_max_frame=limit)

    # ---- dialing ---------------------------------------------------------------

    async def _dial_forever(self, link: GatewayLink) -> None:
        url = link.config.url
        assert url is not None
        ctx = gateway_client_context(link.config)
        while not self._stopping.is_set():
            while link.state is LinkState.UP:
                link.changed.clear()
                await link.changed.wait()
            link.apply(LinkEvent.DIAL)
            up = await self._dial(url, ctx, link)
            if up is not None:
                link.attempts = 0
                await self._run(link, *up, dialed=True)
                continue
            link.apply(LinkEvent.FAILED)
            delay = self.backoff.delay(link.attempts, self.rng())
            link.attempts += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _dial(
        self, url: str, ctx: ssl.SSLContext, link: GatewayLink
    ) -> tuple[ClientConnection, int] | None:
        try:
            ws = await connect(
                url,
                ssl=ctx,
                proxy=None,  # never a proxy from the environment
                compression=None,
                max_size=message_limit(self.config.max_frame_bytes),
                open_timeout=self.config.handshake_timeout_s,
                user_agent_header=None,
                logger=logging.getLogger("agentd.federation.websockets"),
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError, ssl.SSLError) as exc:
            log.info("federation dial gateway=%s failed: %s", link.config.name, exc)
            return None
        authenticated = await self._handshake(ws, Role.DIALER, link.config.name)
        return None if authenticated is None else (ws, authenticated[1])

    # ---- both ------------------------------------------------------------------

    async def _handshake(self, ws: Connection, role: Role, expect: str | None
                         ) -> tuple[str, int] | None:
        """The authenticated peer's name and the largest frame it takes, or None
        after closing with the generic reason."""
        claimed = expect or ""
        try:
            binding = tls_exporter(ws.transport.get_extra_info("ssl_object"))
            hs = Handshake(role, self.identity, binding, self.peers, expect=expect,
                           max_frame=self.config.max_frame_bytes)
            async with asyncio.timeout(self.config.handshake_timeout_s):
                for frame in hs.start():
                    await ws.send(frame)
                while not hs.done:
                    data = await ws.recv(decode=False)
                    try:
                        out = hs.receive(data if isinstance(data, bytes) else data.encode())
                    finally:
                        claimed = hs.claimed or claimed
                    for frame in out:
                        await ws.send(frame)
            assert hs.peer is not None
            return hs.peer, hs.peer_max_frame
        except (HandshakeFailed, ChannelBindingUnavailable, TimeoutError, ConnectionClosed) as exc:
            cause = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            self.audit("federation-handshake-failed", {
                "role": role.value, "peer": claimed, "address": _address(ws), "cause": cause,
            })
            await ws.close(CLOSE_POLICY, HANDSHAKE_FAILED)
            return None

    async def _run(self, link: GatewayLink, ws: Connection, peer_max_frame: int,
                   dialed: bool) -> None:
        """Hold an authenticated link until it closes (or a better one replaces it)."""
        local, peer = self.identity.name, link.config.name
        if link.state is LinkState.UP and link.connection is not None:
            if not keeps_link(local, peer, dialed):
                await ws.close(1000, "duplicate link")
                return
            old = link.connection
            link.connection = None
            await old.close(1000, "duplicate link")
        link.apply(LinkEvent.AUTHENTICATED)
        link.connection, link.dialed = ws, dialed
        link.peer_max_frame = peer_max_frame
        link.up_count += 1
        log.info("federation gateway=%s up (%s) address=%s", peer,
                 "dialed" if dialed else "accepted", _address(ws))
        try:
            await self._receive(link, ws)
        finally:
            if link.connection is ws:
                link.connection = None
                if link.state is LinkState.UP:
                    link.apply(LinkEvent.LOST)
                    log.info("federation gateway=%s down", peer)

    async def _receive(self, link: GatewayLink, ws: Connection) -> None:
        """After the handshake: the peer's calls and acknowledgements, and a writer
        for our frames (replies from the outbox first, then as the pump makes them)."""
        link.bucket = TokenBucket(self.config.rate_per_s, self.config.rate_burst, time.monotonic())
        queue = FrameQueue(max_bytes=max(SEND_QUEUE_BYTES, 4 * link.peer_max_frame))
        link.sending = queue
        link.replies = ReplyWindow(MAX_PENDING_REPLIES)
        writer = asyncio.create_task(_write(ws, queue),
                                     name=f"federation-write-{link.config.name}")
        calls = self.outgoing.get(link.config.name)
        if calls is not None:  # what we import: its schemas first, then our calls again
            with contextlib.suppress(FrameTooLarge):  # logged; nothing gets pinned
                self._send(link, {"t": "schemas", "names": list(link.config.import_)})
                link.offer_expected = True
            calls.link_up()
        most = self.config.max_frame_bytes
        try:
            await self.outbox.load(link)
            with contextlib.suppress(ConnectionClosed):
                async for message in ws:
                    for frame in lines(message):
                        if too_big(frame, most):  # what max_size does to a lone frame
                            await ws.close(CLOSE_TOO_BIG, "frame too big")
                            return
                        if not await self._frame(link, ws, frame):
                            return
        finally:
            if link.sending is queue:  # not replaced by a newer link meanwhile
                link.sending = None
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    async def _frame(self, link: GatewayLink, ws: Connection, data: str | bytes) -> bool:
        """One frame from an authenticated peer; False once the link is closed."""
        peer = link.config.name
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:  # also: not UTF-8, nested past 1024 levels
            msg = None
        kind = msg.get("t") if isinstance(msg, dict) else None
        if kind == "call" and self.host is not None and link.config.export:
            assert isinstance(msg, dict)
            self._spawn_call(link, msg)
            return True
        if kind == "ack" and isinstance(msg, dict) and isinstance(msg.get("id"), int):
            self.outbox.acknowledged(link, msg["id"])
            return True
        if kind == "schemas" and isinstance(msg, dict) and self.host is not None:
            names = msg.get("names")
            assert link.bucket is not None  # a schema request costs a call's token
            if (isinstance(names, list) and len(names) <= MAX_OFFERS
                    and link.bucket.take(time.monotonic())):
                asked = [n for n in names if isinstance(n, str) and n in link.config.export]
                offers = self.host.offers(asked)
                try:
                    self._send(link, {"t": "offer", "listeners": [o.to_json() for o in offers]})
                except FrameTooLarge:  # logged; an empty offer pins nothing
                    self._send(link, {"t": "offer", "listeners": []})
                return True
        calls = self.outgoing.get(peer)
        if calls is not None and isinstance(msg, dict) and self._answer_frame(link, calls, msg):
            return True
        self.audit("federation-unexpected-frame", {"peer": peer, "kind": str(kind)[:32]})
        await ws.close(CLOSE_POLICY, "unexpected frame")
        return False

    def _spawn_call(self, link: GatewayLink, msg: dict[str, object]) -> None:
        if link.admitting >= self.config.max_inflight_calls:
            try:
                call_id = call_id_of(msg)
            except CallRefused:  # never echo what the peer sent unchecked
                call_id = ""
            self._send(link, {"t": "refused", "id": call_id,
                              "code": HuhCode.RATE_LIMITED.value,
                              "message": GENERIC_MESSAGES[HuhCode.RATE_LIMITED]})
            return
        link.admitting += 1
        task = asyncio.create_task(self._call(link, msg))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._call_done(link, done))

    def _call_done(self, link: GatewayLink, task: asyncio.Task[None]) -> None:
        link.admitting -= 1
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("federation call failed", exc_info=task.exception())

    async def _call(self, link: GatewayLink, msg: dict[str, object]) -> None:
        """Admit one call: refused, a duplicate (answered like the original), or
        submitted to the pump; `accepted` is sent only once the pump committed it."""
        peer = link.config.name
        host = self.host
        assert host is not None
        try:
            call_id = call_id_of(msg)
        except CallRefused:
            self._send(link, {"t": "refused", "id": "", "code": HuhCode.MALFORMED.value})
            return
        try:
            assert link.bucket is not None
            if not link.bucket.take(time.monotonic()):
                raise CallRefused(HuhCode.RATE_LIMITED, "call rate")
            call = admit_call(msg, peer, link.config.export, self.allow_meta,
                              self.max_envelope_bytes, self.shape)
        except CallRefused as exc:
            if exc.event is not None:
                self.audit(f"federation-{exc.event}", {"peer": peer, "detail": exc.detail})
            self._send(link, {"t": "refused", "id": call_id, "code": exc.code.value,
                              "message": GENERIC_MESSAGES[exc.code]})
            return
        original = self._admitting.get(call.thread)
        if original is not None:  # the same call again while the first is in admission
            accepted, code = await asyncio.shield(original)
        else:
            # Registered before the first await, so a duplicate arriving meanwhile
            # waits for this outcome instead of being submitted a second time.
            future: asyncio.Future[tuple[bool, HuhCode | None]] = (
                asyncio.get_running_loop().create_future())
            self._admitting[call.thread] = future
            accepted, code = False, HuhCode.INTERNAL
            try:
                # Admitted before? In memory, or (for a call the peer marks as a
                # resend: after a lost link or a crash) in the journal.
                if await host.thread_exists(call.thread, msg.get("again") is True):
                    accepted, code = True, None
                else:
                    result = await host.submit(peer, call.envelope, call.parsed, call.hops,
                                               call.traceparent)
                    accepted, code = bool(result.accepted), result.code
            except Exception:
                log.exception("federation call from %s failed", peer)
            finally:
                del self._admitting[call.thread]
                future.set_result((accepted, code))
        if accepted:
            self._send(link, {"t": "accepted", "id": call.call_id, "thread": call.thread})
        else:
            code = HuhCode(code or HuhCode.INTERNAL)
            self._send(link, {"t": "refused", "id": call.call_id, "code": code.value,
                              "message": GENERIC_MESSAGES[code]})

    def _send(self, link: GatewayLink, frame: dict[str, object]) -> bool:
        """Queue `frame` for the link's writer; False if the link is down. Raises
        `FrameTooLarge` (and logs it) for a frame the peer would close the link on."""
        if link.sending is None:
            return False
        try:
            data = encode_within(frame, link.peer_max_frame)
        except FrameTooLarge as exc:
            log.error("federation gateway=%s: a %s frame of %d bytes is over the %d the "
                      "peer takes (its federation.max_frame_bytes); not sent",
                      link.config.name, frame.get("t"), exc.size, exc.limit)
            raise
        if link.sending.put(data):
            return True
        self._not_reading(link)
        return False

    def _not_reading(self, link: GatewayLink) -> None:
        """The peer let `SEND_QUEUE_BYTES` of our frames pile up: close the link (what
        is durable goes again on the next one)."""
        ws, link.sending = link.connection, None
        log.warning("federation gateway=%s: the peer does not read; closing the link",
                    link.config.name)
        self.audit("federation-peer-not-reading", {"peer": link.config.name})
        if ws is not None:
            task = asyncio.create_task(ws.close(CLOSE_POLICY, "peer does not read"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _sender(self, link: GatewayLink) -> Callable[[dict[str, object]], bool]:
        return lambda frame: self._send(link, frame)

    # ---- calling the peer's listeners ------------------------------------------------

    def _answer_frame(self, link: GatewayLink, calls: RemoteCalls, msg: dict[str, Any]) -> bool:
        """A frame answering our calls (or our schema request); False: not one."""
        kind, call_id, thread = msg.get("t"), msg.get("id"), msg.get("thread")
        if kind == "accepted" and isinstance(call_id, str) and isinstance(thread, str):
            calls.accepted(call_id, thread)
        elif kind == "refused" and isinstance(call_id, str):
            calls.refused(call_id, str(msg.get("code")))
        elif (kind == "reply" and isinstance(call_id, int) and isinstance(thread, str)
              and isinstance(msg.get("envelope"), str)):
            calls.reply(call_id, thread, msg["envelope"])
        elif kind == "offer" and isinstance(msg.get("listeners"), list) and link.offer_expected:
            link.offer_expected = False  # one offer per request: never unsolicited
            local = self.host.local_classes() if self.host is not None else {}
            self.pins.offers(link, calls, msg["listeners"], local)
        else:
            return False
        return True

    def accept_offers(self) -> list[str]:
        """A reload accepts the changed schemas offered since the last one: they
        become the pins. Returns `GATEWAY:LISTENER` of each."""
        return self.pins.accept()


    def deliver(self, client: str, thread: str, data: bytes, outbox_id: int | None) -> bool:
        """A frame the pump has for the gateway `client` (False: not a gateway).
        Replies are durable (outbox rows); core frames without a row (`accepted`,
        an immediate `huh`) are what `accepted`/`refused` already told the peer."""
        link = self.links.get(client)
        if link is None:
            return False
        if outbox_id is not None and link.sending is not None:
            self.outbox.deliver(link, thread, data, outbox_id)
        return True

async def _write(ws: Connection, queue: FrameQueue) -> None:
    """A link's writer: our frames, in order, until the link closes."""
    with contextlib.suppress(ConnectionClosed):
        while True:
            await ws.send(await queue.message())


def _address(ws: Connection) -> str:
    peer = ws.transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
