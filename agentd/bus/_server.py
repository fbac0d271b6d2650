"""The main bus: a TLS WebSocket server at `/bus`.

The server is a transport. It listens, keeps the registry of authenticated
connections by client, and routes what the pump's `deliver` hands it to the right
connection. Each connection is a `BusConnection` (the asyncio and websockets side)
driving a `BusSession` (every decision about one connection: authentication
order, replay, in-flight window, rate limit, send queue, closing). Every decision
about an envelope (identity, route, schema) is the pump's.

Invariants:
- `deliver` never blocks and never raises: it queues on the chosen connection,
  whose frames leave together at the end of the loop turn.
- An answer goes to the connection of the client that last sent on its thread,
  else to the client's newest connection; with none, a frame without `outbox_id`
  is dropped and one with it stays in the kernel's outbox.
- `connections` counts sessions from the opening handshake until their close
  (the metric `bus_connections` moves with it); `max_connections` caps it.
- A connection holds one of the `max_unauthenticated` slots (at most
  `max_unauthenticated_per_ip` from one source address) from the end of its TLS
  handshake until it authenticates or goes; past a cap it is cut at once, before
  a byte of it is read. The TLS handshake itself is bounded by `auth_timeout_s`.
  So idle sockets hold at most that many of the `max_connections` sessions, and an
  authenticated connection is never closed to make room for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from agentd import _metrics as metrics
from agentd._envelope import NIL_THREAD
from agentd._streams import StreamHub
from agentd.bus._adapter import BUS_PATH, BusConnection
from agentd.bus._auth import ClientAuth
from agentd.bus._feed import OutboxSource, SubmitFn, SubmitNowFn
from agentd.bus._limits import TokenBucket, UnauthenticatedSlots
from agentd.bus._session import BusSession, SessionLimits, choose_session
from agentd.bus._tls import reload_pair, server_context
from agentd.config import BusConfig, TlsConfig

log = logging.getLogger("agentd.bus")
PREVIEW_BACKLOG = 64 * 1024



class BusServer:
    def __init__(
        self,
        cfg: BusConfig,
        auth: ClientAuth,
        submit: SubmitFn,
        outbox: OutboxSource | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        inflight_ttl_s: float = 120.0,
        send_queue_limit: int = 4 * 1024 * 1024,
        read_pause_bytes: int = 256 * 1024,
        drain_timeout_s: float = 2.0,
        ping_interval_s: float | None = 20.0,
        submit_nowait: SubmitNowFn | None = None,
    ) -> None:
        self.cfg = cfg
        self.auth = auth
        self.submit = submit
        self.submit_nowait = submit_nowait
        self.outbox = outbox
        self.ssl_context = ssl_context if ssl_context is not None else server_context(cfg.tls)
        if self.ssl_context.minimum_version < ssl.TLSVersion.TLSv1_2:
            self.ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        send_queue_limit = max(send_queue_limit, 2 * cfg.max_envelope_bytes)
        self.limits = SessionLimits(
            max_inflight=cfg.max_inflight,
            inflight_ttl_s=inflight_ttl_s,
            send_queue_limit=send_queue_limit,
            read_pause_bytes=min(read_pause_bytes, send_queue_limit // 2),
        )
        self.drain_timeout_s = drain_timeout_s
        self.ping_interval_s = ping_interval_s
        # Called with each session once it is closed (its `close_code` says how).
        self.on_session_closed: Callable[[BusSession], None] | None = None
        # Previews of models' text: who asked (auth frames, envelopes), resumes.
        self.streams: StreamHub | None = None
        self._server: asyncio.Server | None = None
        self._by_client: dict[str, list[BusConnection]] = {}
        self._open: set[BusConnection] = set()  # sessions not yet closed
        self._live: set[BusConnection] = set()  # sockets not yet gone
        self._all_gone: asyncio.Event | None = None
        self._buckets: dict[str, TokenBucket] = {}
        self.unauthenticated = UnauthenticatedSlots(
            cfg.max_unauthenticated, cfg.max_unauthenticated_per_ip
        )
        self._awaiting_auth: dict[BusConnection, str] = {}  # connection -> its address
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        self.loop = asyncio.get_running_loop()  # get_running_loop() costs a getpid()
        self._server = await self.loop.create_server(
            self.new_connection, cfg.host, cfg.port, ssl=self.ssl_context,
            ssl_handshake_timeout=cfg.auth_timeout_s,
        )
        log.info("bus listening url=wss://%s:%d%s", cfg.host, self.port, BUS_PATH)

    def new_connection(self) -> BusConnection:
        """The protocol for one accepted socket (the listening socket's factory; a
        test may feed one from a transport of its own)."""
        return BusConnection(self)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the bus is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def listening(self) -> bool:
        return self._server is not None and not self._closing and self._server.is_serving()

    @property
    def connections(self) -> int:
        return len(self._open)

    @property
    def accepting(self) -> bool:
        """Whether an opening handshake gets 101 (else 503)."""
        return not self._closing and len(self._open) < self.cfg.max_connections

    def connections_of(self, client: str) -> list[BusConnection]:
        """The client's authenticated, open connections, oldest first."""
        return list(self._by_client.get(client, ()))

    async def close(self, code: int = 1001) -> None:
        """Stop accepting, stop reading, let queued frames flush (bounded), then close
        every connection with `code`."""
        if self._server is None or self._closing:
            return
        self._closing = True
        self._server.close()  # stops accepting; connections stay
        live = list(self._live)
        for conn in live:
            conn.shutdown()
        loop = self.loop
        deadline = loop.time() + self.drain_timeout_s
        while any(conn.sending for conn in live) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self._all_gone = asyncio.Event()
        for conn in live:
            conn.go_away(code)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):  # twice a close handshake's own limit
                if self._live:
                    await self._all_gone.wait()
                await self._server.wait_closed()
        log.info("bus closed")

    # ---- the pump's side ---------------------------------------------------------

    def deliver(self, client: str, thread: str, data: bytes, outbox_id: int | None = None) -> None:
        """Queue one frame for `client`. Never blocks. With no connection, a frame
        without `outbox_id` is dropped; one with it stays in the outbox."""
        conns = self._by_client.get(client)
        if not conns:
            return
        conn = conns[-1]
        if len(conns) > 1:
            conn = conns[choose_session([c.session for c in conns if c.session], thread)]
        conn.deliver(thread, data, outbox_id)

    def busy(self, client: str) -> bool:
        """The client's newest connection is behind: its socket's buffer is full or
        `PREVIEW_BACKLOG` bytes wait for it (a preview then waits, to be joined to
        the next, rather than queue behind them). Frames queued within this loop
        turn alone do not count: many streams share one connection."""
        conns = self._by_client.get(client)
        session = conns[-1].session if conns else None
        return session is not None and (
            not session.writable or session.queued_bytes >= PREVIEW_BACKLOG)

    def reload_tls(self, tls: TlsConfig) -> None:
        """Serve `tls`'s certificate and key to connections made from now on (open
        ones keep theirs). The pair is loaded into a fresh context first, so a bad
        pair raises `TlsSetupError` and changes nothing."""
        reload_pair(self.ssl_context, tls)
        log.info("bus certificate reloaded cert=%s", tls.cert)

    def disconnect(self, client: str) -> int:
        """Close every connection of `client` with 4401 and the one generic reason (its
        access was withdrawn: removed from the clients file, or given a new secret).
        Frames still queued for it stay in its outbox. Returns how many were closed."""
        conns = list(self._by_client.get(client, ()))
        for conn in conns:
            log.info("closing connection client=%s reason=access-withdrawn", client)
            conn.withdraw()
        return len(conns)

    # ---- the connections' side ------------------------------------------------------

    def connection_accepted(self, conn: BusConnection, address: str) -> bool:
        """A socket from `address` finished its TLS handshake: whether it may stay,
        holding an unauthenticated slot until it authenticates or goes."""
        if self._closing:
            return False
        if not self.unauthenticated.take(address):
            metrics.bus_refused_unauthenticated.inc()
            log.info("connection refused peer=%s unauthenticated=%d from_peer=%d", address,
                     self.unauthenticated.count, self.unauthenticated.held_by(address))
            return False
        self._awaiting_auth[conn] = address
        return True

    def _release_slot(self, conn: BusConnection) -> None:
        address = self._awaiting_auth.pop(conn, None)
        if address is not None:
            self.unauthenticated.release(address)

    def session_opened(self, conn: BusConnection) -> BusSession:
        """The opening handshake succeeded: a session, AUTHENTICATING."""
        self._open.add(conn)
        self._live.add(conn)
        metrics.bus_connections.inc()
        return BusSession(self.limits)

    def bucket(self, client: str) -> TokenBucket:
        """The client's rate limit, shared by all its connections."""
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket(
                self.cfg.rate_per_s, self.cfg.rate_burst, self.loop.time()
            )
        return bucket

    def authenticated(self, conn: BusConnection) -> None:
        assert conn.session is not None
        self._release_slot(conn)
        self._by_client.setdefault(conn.session.client, []).append(conn)
        if conn.session.streams and self.streams is not None:
            self.streams.session_opened(conn.session.client)

    def session_closed(
        self, conn: BusConnection, leftover: Sequence[tuple[bytes, int]] = ()
    ) -> None:
        """The session closed (idempotent). Durable frames it still held go to another
        live connection of the client (they would otherwise wait for its next
        authentication)."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        metrics.bus_connections.dec()
        session = conn.session
        assert session is not None
        if session.streams and self.streams is not None:
            self.streams.session_closed(session.client)
        conns = self._by_client.get(session.client)
        if conns is not None:
            with contextlib.suppress(ValueError):
                conns.remove(conn)
            if not conns:
                del self._by_client[session.client]
            else:
                for data, outbox_id in leftover:
                    conns[-1].deliver(NIL_THREAD, data, outbox_id)
        if self.on_session_closed is not None:
            self.on_session_closed(session)

    def connection_lost(self, conn: BusConnection) -> None:
        self._release_slot(conn)
        self._live.discard(conn)
        if not self._live and self._all_gone is not None:
            self._all_gone.set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
