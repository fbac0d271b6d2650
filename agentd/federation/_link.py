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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.http11 import Request, Response

from agentd.config import FederationConfig, GatewayConfig
from agentd.federation._binding import ChannelBindingUnavailable, tls_exporter
from agentd.federation._gateway import Backoff, LinkEvent, LinkState, keeps_link, transition
from agentd.federation._handshake import HANDSHAKE_FAILED, Handshake, HandshakeFailed, Role
from agentd.federation._identity import Identity, fingerprint, parse_public_line

log = logging.getLogger("agentd.federation")

FEDERATION_PATH = "/federation"
CLOSE_POLICY = 1008
MAX_PENDING_HANDSHAKES = 16
SECURITY_KINDS = frozenset({"federation-handshake-failed", "federation-unexpected-frame"})

Audit = Callable[[str, Mapping[str, str]], None]


@dataclass
class GatewayLink:
    """One gateway's live state (what `agentctl status` shows)."""

    config: GatewayConfig
    public_key: Ed25519PublicKey
    state: LinkState = LinkState.DOWN
    since: float = field(default_factory=time.time)
    attempts: int = 0  # failed dials since the last success
    connection: Connection | None = None
    dialed: bool = False  # whether the up link is one we dialed
    up_count: int = 0  # how many times a link came up
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def apply(self, event: LinkEvent) -> None:
        new = transition(self.state, event)
        if new is not self.state:
            self.state, self.since = new, time.time()
        self.changed.set()

    def status(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "state": self.state.value,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "direction": ("out" if self.dialed else "in") if self.state is LinkState.UP else "",
            "url": self.config.url or "",
            "failed_dials": self.attempts,
            "peer_key": fingerprint(self.public_key),
        }


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
    ) -> None:
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

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        host, _, port = self.config.listen.rpartition(":")
        self._server = await serve(
            self._accepted,
            host.strip("[]"),
            int(port),
            ssl=self.server_ssl or federation_server_context(self.config),
            process_request=self._upgrade,
            max_size=self.config.max_frame_bytes,
            compression=None,
            open_timeout=self.config.handshake_timeout_s,
            server_header=None,
            logger=logging.getLogger("agentd.federation.websockets"),
        )
        log.info("federation listening url=wss://%s:%d%s", host, self.port, FEDERATION_PATH)
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
        return [link.status() for link in self.links.values()]

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
            peer = await self._handshake(ws, Role.ACCEPTOR, None)
        finally:
            self._pending -= 1
        if peer is not None:
            await self._run(self.links[peer], ws, dialed=False)

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
            ws = await self._dial(url, ctx, link)
            if ws is not None:
                link.attempts = 0
                await self._run(link, ws, dialed=True)
                continue
            link.apply(LinkEvent.FAILED)
            delay = self.backoff.delay(link.attempts, self.rng())
            link.attempts += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)

    async def _dial(
        self, url: str, ctx: ssl.SSLContext, link: GatewayLink
    ) -> ClientConnection | None:
        try:
            ws = await connect(
                url,
                ssl=ctx,
                proxy=None,  # never a proxy from the environment
                compression=None,
                max_size=self.config.max_frame_bytes,
                open_timeout=self.config.handshake_timeout_s,
                user_agent_header=None,
                logger=logging.getLogger("agentd.federation.websockets"),
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError, ssl.SSLError) as exc:
            log.info("federation dial gateway=%s failed: %s", link.config.name, exc)
            return None
        peer = await self._handshake(ws, Role.DIALER, link.config.name)
        return ws if peer is not None else None

    # ---- both ------------------------------------------------------------------

    async def _handshake(self, ws: Connection, role: Role, expect: str | None) -> str | None:
        """The authenticated peer's name, or None after closing with the generic reason."""
        claimed = expect or ""
        try:
            binding = tls_exporter(ws.transport.get_extra_info("ssl_object"))
            hs = Handshake(role, self.identity, binding, self.peers, expect=expect)
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
            return hs.peer
        except (HandshakeFailed, ChannelBindingUnavailable, TimeoutError, ConnectionClosed) as exc:
            cause = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            self.audit("federation-handshake-failed", {
                "role": role.value, "peer": claimed, "address": _address(ws), "cause": cause,
            })
            await ws.close(CLOSE_POLICY, HANDSHAKE_FAILED)
            return None

    async def _run(self, link: GatewayLink, ws: Connection, dialed: bool) -> None:
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
        link.up_count += 1
        log.info("federation gateway=%s up (%s)", peer, "dialed" if dialed else "accepted")
        try:
            await self._receive(link, ws)
        finally:
            if link.connection is ws:
                link.connection = None
                if link.state is LinkState.UP:
                    link.apply(LinkEvent.LOST)
                    log.info("federation gateway=%s down", peer)

    async def _receive(self, link: GatewayLink, ws: Connection) -> None:
        """After the handshake. Messages across the link are not built yet: a peer
        that sends one gets a policy close and a security event."""
        with contextlib.suppress(ConnectionClosed):
            async for _frame in ws:
                self.audit("federation-unexpected-frame", {"peer": link.config.name})
                await ws.close(CLOSE_POLICY, "unexpected frame")
                return


def _address(ws: Connection) -> str:
    peer = ws.transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
