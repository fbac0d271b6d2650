"""The main bus: a TLS WebSocket server at `/bus` (CONTRACT section 3).

The server is a transport. It authenticates a connection, turns each frame into one
`submit_nowait(client, bytes)` call (or, when the pump is full, one awaited
`submit`), and writes what `deliver` hands it back to the right socket. Every
decision about an envelope (identity, route, schema) is the pump's.

A connection moves through explicit states:

    AUTHENTICATING -> REPLAYING -> OPEN -> DRAINING -> CLOSED
          |               |          |
          +---------------+----------+--> CLOSED (failure, client gone, overflow)

Invariants:
- Nothing is read after the first frame until the client has authenticated and its
  outbox has been queued, so outbox frames go out in order before any new frame.
- A connection's envelopes are submitted in arrival order; envelopes on different
  threads do not wait for each other's journal commit, envelopes on one thread do
  (so per-thread order holds even while the pump waits for room).
- Memory per connection is bounded: websockets buffers at most `max_queue` frames
  of at most `max_envelope_bytes` before it stops reading the socket; we stop
  asking for frames while `max_inflight` envelopes are unanswered or while the send
  queue is above `read_pause_bytes`; a send queue beyond `send_queue_limit` (a
  client that does not read) closes the connection with 1008. Frames that carry an
  `outbox_id` are durable in the kernel's outbox, so closing loses none of them.
- `deliver` never blocks and never raises: it queues, and one short-lived writer
  task per connection drains the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from agentd import _metrics as metrics
from agentd._core import Huh
from agentd._envelope import NIL_THREAD, build_envelope
from agentd._errors import HuhCode
from agentd._schemas import NS_ENV
from agentd.bus._auth import ClientAuth, auth_ok_frame
from agentd.bus._limits import InflightWindow, TokenBucket
from agentd.bus._tls import server_context
from agentd.config import BusConfig, TlsConfig

log = logging.getLogger("agentd.bus")

BUS_PATH = "/bus"
CLOSE_AUTH_FAILED = 4401
CLOSE_AUTH_TIMEOUT = 4408
AUTH_FAILED_REASON = "authentication failed"

SubmitFn = Callable[[str, bytes], Awaitable[object]]
# `Pump.submit_nowait`: admit now, or None when the pump has no room (then `submit`).
SubmitNowFn = Callable[[str, bytes], "object | None"]

_CORE_HEAD = f'<message xmlns="{NS_ENV}"><meta><from>core</from>'.encode()
_THREAD_RE = re.compile(
    rb"<thread>\s*([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\s*</thread>"
)
_RATE_LIMITED = Huh.of(HuhCode.RATE_LIMITED).to_bytes()


class OutboxSource(Protocol):
    """The kernel's durable outbox, as the bus sees it."""

    async def pending(self, client: str) -> list[tuple[int, str, bytes]]:
        """(outbox_id, thread, data) not yet delivered to `client`, in order."""
        ...

    def delivered(self, client: str, outbox_id: int) -> None:
        """The frame was written to the client's socket."""
        ...


class ConnState(Enum):
    AUTHENTICATING = "authenticating"
    REPLAYING = "replaying"  # authenticated; the outbox is being queued
    OPEN = "open"
    DRAINING = "draining"  # server shutting down: no more reads, sends flush
    CLOSED = "closed"


def is_accepted_frame(data: bytes) -> bool:
    """True for the pump's `accepted` envelopes (the only frames that do not answer
    an envelope). `from` = core is reserved, so a listener cannot fake this."""
    return data.startswith(_CORE_HEAD) and b"</meta><accepted " in data[: len(_CORE_HEAD) + 400]


def thread_hint(data: bytes) -> str:
    """The `thread` of an envelope before it is parsed (for routing the answer back
    to this connection and for `huh rate-limited`); NIL if not found."""
    m = _THREAD_RE.search(data, 0, 4096)
    return m.group(1).decode() if m else NIL_THREAD


class _Connection:
    __slots__ = (
        "client",
        "closed_waiter",
        "held",
        "inflight",
        "room",
        "sendq",
        "sendq_bytes",
        "state",
        "submits",
        "threads",
        "writer",
        "ws",
    )

    def __init__(self, ws: ServerConnection, client: str, inflight: InflightWindow) -> None:
        self.ws = ws
        self.client = client
        self.state = ConnState.REPLAYING
        self.inflight = inflight
        # The containers below exist only while in use: an idle connection costs what
        # websockets and TLS cost, plus this object (the budget is 40 KiB).
        self.sendq: deque[tuple[bytes, int | None]] | None = None  # frames to write
        self.sendq_bytes = 0
        self.writer: asyncio.Task[None] | None = None
        self.room: asyncio.Future[None] | None = None  # set while the reader waits
        self.closed_waiter: asyncio.Task[None] | None = None
        self.held: list[tuple[str, bytes, int | None]] | None = None  # while REPLAYING
        self.submits: dict[str, asyncio.Task[None]] | None = None  # thread -> its latest
        self.threads: dict[str, None] | None = None  # recent threads, for affinity

    def wake(self) -> None:
        room = self.room
        if room is not None and not room.done():
            room.set_result(None)


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
        self.inflight_ttl_s = inflight_ttl_s
        self.send_queue_limit = max(send_queue_limit, 2 * cfg.max_envelope_bytes)
        self.read_pause_bytes = min(read_pause_bytes, self.send_queue_limit // 2)
        self.drain_timeout_s = drain_timeout_s
        self.ping_interval_s = ping_interval_s
        self._server: Server | None = None
        self._by_client: dict[str, list[_Connection]] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._active = 0  # WebSocket connections with a running handler
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()  # get_running_loop() costs a getpid()
        # At most ~1 MiB of whole frames buffered per connection before websockets
        # stops reading the socket (bounded memory for a client we do not read).
        high = max(2, min(16, (1024 * 1024) // max(cfg.max_envelope_bytes, 1)))
        self._server = await serve(
            self._handle,
            cfg.host,
            cfg.port,
            ssl=self.ssl_context,
            process_request=self._process_request,
            compression="deflate" if cfg.compression else None,
            max_size=cfg.max_envelope_bytes,
            max_queue=(high, max(1, high // 4)),
            open_timeout=cfg.auth_timeout_s,
            ping_interval=self.ping_interval_s,
            ping_timeout=self.ping_interval_s,
            close_timeout=5,
            server_header=None,
            logger=logging.getLogger("agentd.bus.websockets"),
        )
        log.info("bus listening url=wss://%s:%d%s", cfg.host, self.port, BUS_PATH)

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
        return self._active

    async def close(self, code: int = 1001) -> None:
        """Stop accepting, stop reading, let queued frames flush (bounded), then close
        every connection with `code`."""
        if self._server is None or self._closing:
            return
        self._closing = True
        server = self._server
        server.close(close_connections=False)  # stops accepting; handlers keep running
        conns = [c for cs in self._by_client.values() for c in cs]
        for conn in conns:
            if conn.state is ConnState.OPEN:
                conn.state = ConnState.DRAINING
            conn.wake()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while any(c.sendq or c.writer for c in conns) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        closing = [
            asyncio.create_task(ws.close(code, "going away")) for ws in server.connections
        ]
        if closing:
            await asyncio.wait(closing, timeout=10)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await server.wait_closed()
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
            for c in conns:
                if c.threads and thread in c.threads and c.state is not ConnState.CLOSED:
                    conn = c
                    break
        self._push(conn, thread, data, outbox_id)

    def reload_tls(self, tls: TlsConfig) -> None:
        """Serve `tls`'s certificate and key to connections made from now on (open
        ones keep theirs). The pair is loaded into a fresh context first, so a bad
        pair raises `TlsSetupError` and changes nothing."""
        server_context(tls)  # raises on a missing file or a key that does not match
        self.ssl_context.load_cert_chain(str(tls.cert), str(tls.key))
        log.info("bus certificate reloaded cert=%s", tls.cert)

    def disconnect(self, client: str) -> int:
        """Close every connection of `client` with 4401 and the one generic reason (its
        access was withdrawn: removed from the clients file, or given a new secret).
        Frames still queued for it stay in its outbox. Returns how many were closed."""
        conns = list(self._by_client.get(client, ()))
        for conn in conns:
            log.info("closing connection client=%s reason=access-withdrawn", client)
            self._spawn(conn.ws.close(CLOSE_AUTH_FAILED, AUTH_FAILED_REASON))
        return len(conns)

    def _push(self, conn: _Connection, thread: str, data: bytes, outbox_id: int | None) -> None:
        state = conn.state
        if state is ConnState.REPLAYING:
            if conn.held is None:
                conn.held = []
            conn.held.append((thread, data, outbox_id))
            return
        if state is ConnState.CLOSED:
            return
        if not is_accepted_frame(data) and conn.inflight.answered(thread):
            conn.wake()
        self._enqueue(conn, data, outbox_id)

    def _enqueue(self, conn: _Connection, data: bytes, outbox_id: int | None) -> None:
        if conn.sendq is None:
            conn.sendq = deque()
        conn.sendq.append((data, outbox_id))
        conn.sendq_bytes += len(data)
        if conn.sendq_bytes > self.send_queue_limit:
            self._overflow(conn)
            return
        if conn.writer is None:
            conn.writer = self._loop.create_task(self._write(conn))

    def _overflow(self, conn: _Connection) -> None:
        log.warning(
            "client does not read; closing client=%s queued_bytes=%d",
            conn.client, conn.sendq_bytes,
        )
        conn.state = ConnState.CLOSED
        conn.sendq = None
        conn.sendq_bytes = 0
        conn.wake()
        self._spawn(conn.ws.close(1008, "send queue overflow"))

    async def _write(self, conn: _Connection) -> None:
        """Drain the send queue. Frames queued together are written in one batch: one
        TLS write and one flow-control wait for up to 64 frames or 256 KiB (an
        answer usually follows its `accepted` within the same loop turn)."""
        ws, outbox = conn.ws, self.outbox
        batched = hasattr(ws, "send_context") and hasattr(ws.protocol, "send_text")
        try:
            # conn.sendq is read again after every write: an overflow or a close
            # drops it (None) while this task waits.
            while sendq := conn.sendq:
                batch: list[tuple[bytes, int | None]] = []
                size = 0
                while sendq and len(batch) < 64 and size < 256 * 1024:
                    item = sendq.popleft()
                    batch.append(item)
                    size += len(item[0])
                conn.sendq_bytes -= size
                if batched and len(batch) > 1:
                    async with ws.send_context():
                        for data, _ in batch:
                            ws.protocol.send_text(data)
                        _write_joined(ws)
                else:
                    for data, _ in batch:
                        await ws.send(data, text=True)
                if outbox is not None:
                    for _, outbox_id in batch:
                        if outbox_id is not None:
                            outbox.delivered(conn.client, outbox_id)
                if conn.room is not None and conn.sendq_bytes < self.read_pause_bytes:
                    conn.wake()
        except ConnectionClosed:
            pass
        except Exception:  # pragma: no cover - a bug here must not kill the loop
            log.exception("bus writer failed client=%s", conn.client)
        finally:
            conn.writer = None
            if conn.sendq is not None and not conn.sendq:
                conn.sendq = None  # an idle connection keeps no queue

    # ---- connections ----------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        if urlsplit(request.path).path != BUS_PATH:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        if self._closing or self._active >= self.cfg.max_connections:
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, "try again later\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        if self._closing or self._active >= self.cfg.max_connections:
            await ws.close(1013, "try again later")
            return
        self._active += 1
        metrics.bus_connections.inc()
        conn: _Connection | None = None
        try:
            who = await self._authenticate(ws)
            if who is None:
                return
            client, token = who
            window = InflightWindow(self.cfg.max_inflight, self.inflight_ttl_s)
            conn = _Connection(ws, client, window)
            self._by_client.setdefault(client, []).append(conn)
            await ws.send(auth_ok_frame(client, token), text=True)
            await self._replay(conn)
            await self._read(conn)
        except ConnectionClosed:
            pass
        finally:
            self._active -= 1
            metrics.bus_connections.dec()
            if conn is not None:
                self._forget(conn)

    async def _authenticate(self, ws: ServerConnection) -> tuple[str, str] | None:
        try:
            async with asyncio.timeout(self.cfg.auth_timeout_s):
                first = await ws.recv(decode=False)
        except TimeoutError:
            metrics.auth_failures.inc()
            log.info("auth timeout peer=%s", _peer(ws))
            await ws.close(CLOSE_AUTH_TIMEOUT, "authentication timeout")
            return None
        result = self.auth.authenticate(first)
        if result is None:
            metrics.auth_failures.inc()
            log.info("auth refused peer=%s", _peer(ws))
            await ws.close(CLOSE_AUTH_FAILED, AUTH_FAILED_REASON)
            return None
        return result

    async def _replay(self, conn: _Connection) -> None:
        """Queue the client's outbox, then what arrived meanwhile, then go OPEN."""
        replayed: set[int] = set()
        if self.outbox is not None:
            pending = await self.outbox.pending(conn.client)
            for replay_id, _thread, frame in pending:
                replayed.add(replay_id)
                self._enqueue(conn, frame, replay_id)
            if pending:
                log.info("outbox replay client=%s frames=%d", conn.client, len(pending))
        held, conn.held = conn.held or [], None
        if conn.state is ConnState.CLOSED:
            return
        conn.state = ConnState.DRAINING if self._closing else ConnState.OPEN
        for thread, data, outbox_id in held:
            if outbox_id is not None and outbox_id in replayed:
                continue
            self._push(conn, thread, data, outbox_id)

    async def _read(self, conn: _Connection) -> None:
        ws, client, inflight = conn.ws, conn.client, conn.inflight
        loop = asyncio.get_running_loop()
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket(
                self.cfg.rate_per_s, self.cfg.rate_burst, loop.time()
            )
        max_threads = max(1024, 4 * self.cfg.max_inflight)
        nowait = self.submit_nowait
        while True:
            if inflight.full or conn.sendq_bytes >= self.read_pause_bytes:
                await self._wait_room(conn)
            if conn.state is not ConnState.OPEN:
                return
            data = await ws.recv(decode=False)
            if conn.state is not ConnState.OPEN:
                return  # shutting down: not submitted, the client resends after 1001
            now = loop.time()
            thread = thread_hint(data)
            if not bucket.take(now):
                metrics.envelopes_rejected.labels(HuhCode.RATE_LIMITED.value).inc()
                self._enqueue(conn, build_envelope("core", thread, _RATE_LIMITED, to=client), None)
                continue
            threads = conn.threads
            if threads is None:
                threads = conn.threads = {}
            threads.pop(thread, None)  # most recent last
            threads[thread] = None
            if len(threads) > max_threads:
                del threads[next(iter(threads))]
            # Counted before submitting: the answer may arrive before submit returns.
            inflight.submitted(thread, now)
            submits = conn.submits
            previous = submits.get(thread) if submits else None
            if nowait is not None and (previous is None or previous.done()):
                # The common case, with no task: the pump has room and no earlier
                # envelope of this thread is still waiting for it.
                try:
                    result = nowait(client, data)
                except Exception:
                    log.exception("submit failed client=%s", client)
                    inflight.answered(thread)
                    continue
                if result is not None:
                    self._submitted(conn, thread, result)
                    continue
            if submits is None:
                submits = conn.submits = {}
            task = loop.create_task(self._submit(conn, thread, data, previous))
            submits[thread] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _submit(
        self, conn: _Connection, thread: str, data: bytes, previous: asyncio.Task[None] | None
    ) -> None:
        """One envelope into the pump. Envelopes on different threads are submitted
        concurrently (the pump journals them in the order the tasks start, and a
        journal commit is shared by a batch); one thread's envelopes wait for each
        other, so their order is kept even while the pump waits for room."""
        if previous is not None and not previous.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(previous)
        try:
            result = await self.submit(conn.client, data)
        except Exception:
            log.exception("submit failed client=%s", conn.client)
            conn.inflight.answered(thread)
            conn.wake()
            return
        finally:
            submits = conn.submits
            if submits is not None and submits.get(thread) is asyncio.current_task(self._loop):
                del submits[thread]
        self._submitted(conn, thread, result)

    def _submitted(self, conn: _Connection, thread: str, result: object) -> None:
        real = getattr(result, "thread", thread)
        if real != thread:
            # The hint was wrong (e.g. input too broken to have a thread): the answer
            # came on another thread, so release the slot counted under the hint.
            if conn.inflight.answered(thread):
                conn.wake()
            if getattr(result, "accepted", False):
                conn.inflight.submitted(real, self._loop.time())

    async def _wait_room(self, conn: _Connection) -> None:
        """Backpressure: block the reader (so the socket fills and the client's sends
        stall) until an answer frees a slot or the send queue drains."""
        loop = asyncio.get_running_loop()
        inflight = conn.inflight
        if conn.closed_waiter is None:
            conn.closed_waiter = loop.create_task(conn.ws.wait_closed())
        while conn.state is ConnState.OPEN and (
            inflight.full or conn.sendq_bytes >= self.read_pause_bytes
        ):
            conn.room = loop.create_future()
            deadline = inflight.oldest_deadline() if inflight.full else None
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait({conn.room, conn.closed_waiter}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            conn.room = None
            if conn.closed_waiter.done():
                raise ConnectionClosed(None, None)
            released = inflight.expire(loop.time())
            if released:
                log.warning("in-flight envelopes never answered client=%s released=%d",
                            conn.client, released)

    def _forget(self, conn: _Connection) -> None:
        conn.state = ConnState.CLOSED
        conns = self._by_client.get(conn.client)
        if conns is not None:
            with contextlib.suppress(ValueError):
                conns.remove(conn)
            if not conns:
                del self._by_client[conn.client]
        if conn.closed_waiter is not None:
            conn.closed_waiter.cancel()
        # Durable frames still queued go to another live connection of the client
        # (they would otherwise wait for its next authentication).
        leftover = [(d, i) for d, i in conn.sendq or () if i is not None]
        conn.sendq = None
        if leftover and conns:
            for data, outbox_id in leftover:
                self._push(conns[-1], NIL_THREAD, data, outbox_id)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _write_joined(ws: ServerConnection) -> None:
    """Hand the frames the protocol has buffered to the transport in one write, where
    websockets' `send_data` writes each frame alone: the TLS transport makes every
    write() a record and a send() of its own, and every send() to a peer wakes it
    once more. (`send_context` then finds nothing left to write.)"""
    chunks = ws.protocol.data_to_send()
    if all(chunks):
        if chunks:
            ws.transport.write(b"".join(chunks) if len(chunks) > 1 else chunks[0])
        return
    for chunk in chunks:  # an EOF marker among them: as websockets' send_data does
        if chunk:
            ws.transport.write(chunk)
        elif ws.transport.can_write_eof():
            ws.transport.write_eof()
        else:
            ws.transport.close()


def _peer(ws: ServerConnection) -> str:
    try:
        host, port = ws.remote_address[:2]
        return f"{host}:{port}"
    except Exception:
        return "?"
