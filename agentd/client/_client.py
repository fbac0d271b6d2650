"""`Client`: calls to an organism over the main bus, for programs and `agentd send`.

    async with Client.connect(url, "alice", secret_file="agentd-home/alice.totp",
                              cafile="agentd-home/tls/cert.pem") as c:
        total = await c.call(Add(a=2, b=3))      # Sum(value=5), or raises Huh

One connection (`BusClient`) read by one task, which hands each frame to the call it
belongs to (`Calls`, sans-I/O) or, for a thread this client did not start, to
`on_other` and `others`. A call waits through `approval-required` (an event for
`on_event` / `stream`) until its outcome, for `timeout` seconds, or, once parked,
until the approval expires plus `timeout`. A dropped connection is resumed with the
session token (the daemon keeps answers for an absent client in its outbox and
replays them); envelopes are never sent twice. Delivery is acknowledged: the client
logs in with the last delivery seq it received, acknowledges what it reads (one
`ack` per burst of frames) and drops a frame resent with a seq it has. URLs are
tried in order: the next only when one cannot be reached, never after a refused
login (a second try of the same TOTP code is a reused code). The session token may be kept in a file
(`session_file`, "URL\\nTOKEN", mode 0600) so that another process within the same
30 s TOTP step logs in with it instead of reusing the code.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from agentd._credentials import read_secret, read_session_file
from agentd._delivery import ask_previews, resume_frame
from agentd._errors import AgentdError
from agentd.client._calls import (
    Answer,
    ApprovalRequired,
    Call,
    Calls,
    Event,
    Huh,
    Other,
)
from agentd.client._connection import AuthenticationFailed, BusClient, BusError

log = logging.getLogger("agentd.client")

OTHERS_KEPT = 1000  # frames of other threads kept in `Client.others`
# After a drop, rounds over the URLs 0.2 s, 0.4 s, ... (at most 2 s) apart, for
# this long: a daemon restarted after a crash (systemd, then its recovery) is back
# within it, and the session token still logs in.
RESUME_S = 30.0
RESUME_MAX_DELAY_S = 2.0


class Exchange:
    """One envelope sent and what comes back on its thread: `events()` until the
    outcome, or `result()`. Made by `Client.start`."""

    def __init__(self, client: Client, call: Call, timeout: float) -> None:
        self.thread = call.thread
        self._client = client
        self._call = call
        self._timeout = timeout
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self.done = False

    def _put(self, item: Event | BaseException) -> None:
        self._queue.put_nowait(item)

    async def events(self) -> AsyncIterator[Event]:
        """Each event of the call in order; the last is its `Answer`. Raises `Huh`
        for a refusal, `TimeoutError` if no outcome came in time, `BusError` if the
        connection was lost and could not be resumed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"no answer within {self._timeout:g} s "
                                       f"on thread {self.thread}")
                try:
                    async with asyncio.timeout(left):
                        item = await self._queue.get()
                except TimeoutError:
                    continue  # re-checked against the deadline above
                if isinstance(item, BaseException):
                    self.done = True
                    raise item
                if isinstance(item, ApprovalRequired):
                    # Waiting for a human: the gate's expiry bounds it (the daemon
                    # answers `huh denied` then), and the handler has `timeout` after.
                    until = _epoch(item.expires)
                    if until is not None:
                        deadline = max(deadline,
                                       loop.time() + until - time.time() + self._timeout)
                if isinstance(item, Answer):
                    self.done = True
                    yield item
                    return
                yield item
        finally:
            if not self.done:
                self.done = True
                self._client._forget(self._call)

    async def result(self, on_event: Callable[[Event], object] | None = None) -> Any:
        """The response payload (an @xmlify instance when its class is known here,
        else its C14N XML); raises `Huh`. `on_event` sees every event before it."""
        async for event in self.events():
            if on_event is not None:
                on_event(event)
            if isinstance(event, Answer):
                return event.payload
        raise BusError("the call ended without an outcome")  # pragma: no cover


class Client:
    """A bus client for calls; see the module docstring. Make it with `connect`."""

    def __init__(
        self,
        urls: str | Sequence[str],
        client_id: str,
        *,
        secret: str | None = None,
        secret_file: str | Path | None = None,
        session: str | None = None,
        session_file: str | Path | None = None,
        cafile: str | Path | None = None,
        verify: bool = True,
        open_timeout: float = 10.0,
        on_other: Callable[[Other], object] | None = None,
        stream: bool = False,
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("Client needs at least one bus URL")
        for url in self.urls:
            if not url.startswith("wss://"):
                # The first frame is a credential: never sent where it could be read.
                raise ValueError(f"the bus speaks TLS only: a wss:// URL, not {url[:40]!r}")
        self.client_id = client_id
        self.secret = secret if secret is not None else (
            read_secret(secret_file) if secret_file is not None else None)
        self.session_file = Path(session_file) if session_file is not None else None
        self.session = session
        self._session_url: str | None = None
        if session is None and self.session_file is not None:
            issued_by, token = read_session_file(self.session_file)
            if issued_by is None or issued_by in self.urls:  # only to the buses named
                self.session, self._session_url = token, issued_by
        if self.secret is None and self.session is None:
            raise ValueError("Client needs a TOTP secret (secret or secret_file) or a "
                             "session token (session or session_file)")
        self.cafile = cafile
        self.verify = verify
        self.open_timeout = open_timeout
        # How soon a dead link is noticed (a ping unanswered within ping_timeout).
        self.ping_interval, self.ping_timeout = ping_interval, ping_timeout
        self.on_other = on_other
        self.stream_all = stream  # previews on every thread of the session
        self.others: deque[Other] = deque(maxlen=OTHERS_KEPT)
        self.url: str | None = None  # the URL of the live connection
        self._conn: BusClient | None = None
        self._calls = Calls()
        self._exchanges: dict[int, Exchange] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self._acked = 0  # the last delivery seq acknowledged
        self._acking: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, urls: str | Sequence[str], client_id: str, **kw: Any) -> Client:
        """A client for `async with`: it logs in on entering, closes on leaving."""
        return cls(urls, client_id, **kw)

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ---- the connection ----------------------------------------------------------

    async def open(self) -> None:
        """Log in to the first URL that can be reached. Raises `AuthenticationFailed`
        (4401: nothing tells which cause; see docs/user-guide.md) or `BusError`."""
        self._conn = await self._login()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def aclose(self) -> None:
        self._closing = True
        if self._acking is not None and not self._acking.done():
            with contextlib.suppress(Exception):
                await self._acking  # the last frames read are not resent next time
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._conn is not None:
            await self._conn.close()
        self._fail_all(BusError("the client was closed"))

    async def _login(self) -> BusClient:
        failures: list[str] = []
        certificate = False
        for url in self.urls:
            try:
                return await self._login_to(url)
            except AuthenticationFailed:
                raise
            except BusError as exc:
                certificate = certificate or exc.certificate
                failures.append(str(exc))
        if len(failures) == 1:
            raise BusError(failures[0], certificate=certificate)
        raise BusError(f"cannot connect to any of {len(failures)} URLs: "
                       + "; ".join(failures), certificate=certificate)

    async def _login_to(self, url: str) -> BusClient:
        """Log in to `url`: with the session token if there is one for it, then (if
        that is refused) with a TOTP code."""
        token = self.session  # any of the URLs given: one organism (a primary, a standby)
        if token is not None:
            conn = self._bus(url, session=token)
            try:
                await conn.connect()
                return self._logged_in(url, conn)
            except AuthenticationFailed:
                if self.secret is None:
                    raise
                log.info("session token refused by %s; logging in with a TOTP code", url)
                self.session = None
                if self.session_file is not None:
                    self.session_file.unlink(missing_ok=True)
        if self.secret is None:
            raise BusError(f"no session token for {url} and no TOTP secret")
        conn = self._bus(url, secret=self.secret)
        await conn.connect()
        return self._logged_in(url, conn)

    def _bus(self, url: str, **kw: Any) -> BusClient:
        return BusClient(url, self.client_id, cafile=self.cafile, verify=self.verify,
                         open_timeout=self.open_timeout, delivered=self._calls.delivered,
                         stream=self.stream_all, ping_interval=self.ping_interval,
                         ping_timeout=self.ping_timeout, **kw)

    def _logged_in(self, url: str, conn: BusClient) -> BusClient:
        self.url = url
        self._acked = max(self._acked, conn.delivered or 0)  # the login said so
        if conn.session and (conn.session != self.session or self._session_url != url):
            self.session, self._session_url = conn.session, url
            if self.session_file is not None:
                from agentd.bus import write_private_atomic

                try:
                    write_private_atomic(self.session_file, f"{url}\n{conn.session}\n".encode())
                except OSError as exc:  # a cache: the next process logs in with TOTP
                    log.warning("cannot write session file %s: %s", self.session_file, exc)
        return conn

    async def _resume(self) -> BusClient:
        """After a drop: the session token on each URL, round after round for
        `RESUME_S` seconds."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + RESUME_S
        delay = 0.2
        while True:
            try:
                return await self._login()
            except AuthenticationFailed:
                raise
            except BusError:
                if loop.time() + delay > give_up:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESUME_MAX_DELAY_S)

    async def _read(self) -> None:
        while True:
            conn = self._conn
            assert conn is not None
            try:
                frame = await conn.recv()
            except BusError as exc:
                if self._closing:
                    return
                log.info("bus connection lost (%s); resuming the session", exc)
                try:
                    self._conn = await self._resume()
                    for stream, (_, seq) in list(self._calls.streams.items()):
                        # The partials sent while the connection was down, again.
                        await self._conn.send_raw(
                            resume_frame(self.client_id, stream, seq + 1))
                except BusError as again:
                    self._fail_all(BusError(f"connection lost and not resumed: {again}"))
                    return
                continue
            try:
                call, event = self._calls.feed(frame)
            except AgentdError as exc:  # not an envelope: the daemon never sends one
                log.warning("ignoring a frame that is not an envelope: %s", exc)
                continue
            if self._calls.delivered > self._acked and self._acking is None:
                # After the frames already read are handled: one ack for a burst.
                self._acking = asyncio.get_running_loop().create_task(self._ack())
            if event is None:
                continue  # resent after a reconnect: already handled
            if call is None:
                assert isinstance(event, Other)
                self.others.append(event)
                if self.on_other is not None:
                    try:
                        self.on_other(event)
                    except Exception:  # the caller's bug must not stop every call
                        log.exception("on_other failed")
                continue
            exchange = self._exchanges.get(id(call))
            if exchange is not None:
                if isinstance(event, Answer | Huh):
                    del self._exchanges[id(call)]
                exchange._put(event)

    async def _ack(self) -> None:
        """Acknowledge the highest delivery seq read (a lost ack only means the
        frames are resent at the next login, and dropped here as duplicates)."""
        again = True
        try:
            await asyncio.sleep(0)
            seq, conn = self._calls.delivered, self._conn
            if conn is not None and seq > self._acked:
                await conn.ack(seq)
                self._acked = seq
        except BusError:
            again = False  # the next frame read after the resume acknowledges
        finally:
            self._acking = None
            if again and self._calls.delivered > self._acked and not self._closing:
                self._acking = asyncio.get_running_loop().create_task(self._ack())

    def _forget(self, call: Call) -> None:
        self._calls.forget(call)
        self._exchanges.pop(id(call), None)

    def _fail_all(self, exc: BaseException) -> None:
        for exchange in list(self._exchanges.values()):
            exchange._put(exc)
            self._forget(exchange._call)

    # ---- calls ------------------------------------------------------------------------

    async def start(
        self, payload: bytes | str | Any, *, to: str | None = None, thread: str | None = None,
        timeout: float = 60.0, previews: bool = False,
    ) -> Exchange:
        """Send `payload` (an @xmlify object, payload bytes, or a whole envelope) on
        `thread` (new if None), to the listener `to` if given; the `Exchange` waits
        for what comes back. `previews`: ask for `Partial`s of the model's text on
        this thread (`<s:stream/>` in the envelope's meta)."""
        if self._conn is None or self._reader is None or self._reader.done():
            raise BusError("not connected")
        frame, thread_id = self._conn.wrap(payload, thread, to)
        if previews:
            frame = ask_previews(frame)
        call = self._calls.start(thread_id)
        exchange = self._exchanges[id(call)] = Exchange(self, call, timeout)
        try:
            await self._conn.send_raw(frame)
        except BusError:
            self._forget(call)
            raise
        return exchange

    async def call(
        self, payload: bytes | str | Any, *, to: str | None = None, thread: str | None = None,
        timeout: float = 60.0, on_event: Callable[[Event], object] | None = None,
    ) -> Any:
        """Send and return the response payload (see `Exchange.result`); raises `Huh`."""
        exchange = await self.start(payload, to=to, thread=thread, timeout=timeout)
        return await exchange.result(on_event)

    async def stream(
        self, payload: bytes | str | Any, *, to: str | None = None, thread: str | None = None,
        timeout: float = 60.0,
    ) -> AsyncIterator[Event]:
        """Send, asking for previews, and yield each event (`Accepted`, `Partial`s
        of a model's text and each stream's `Final`, `ApprovalRequired`, ..., the
        `Answer` last); raises `Huh`."""
        exchange = await self.start(payload, to=to, thread=thread, timeout=timeout,
                                    previews=True)
        async for event in exchange.events():
            yield event


def _epoch(text: str) -> float | None:
    try:
        return dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


__all__ = ["Client", "Exchange", "read_secret", "read_session_file"]
