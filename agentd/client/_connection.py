"""The bus connection under `Client`: one authenticated WebSocket, frames in and out.

Tests and benchmarks use it directly for what `Client` hides (raw frames, hostile
input, a chosen TOTP code):

    async with BusClient("wss://127.0.0.1:8765/bus", "alice", secret=SECRET,
                         cafile="agentd-home/tls/cert.pem") as bus:
        thread = await bus.send(Add(a=2, b=3))          # or envelope / payload bytes
        async for frame in bus:                         # envelopes, C14N bytes
            ...
        frames = await bus.exchange(Add(a=1, b=1))      # send and wait for the answer

Authentication is the first frame (docs/protocol.md): a TOTP code computed from
`secret`, or a `session` token from an earlier `auth-ok` (`bus.session` after
connecting). With `delivered` (the last delivery seq received, 0 for none) the
client asks for acknowledged delivery: the daemon keeps each outbox frame until
`ack(seq)` says it arrived, and resends the ones after `delivered` at login. The
client only wraps bare payloads: it never decides a route and sets `from` to its
own id (the server checks it anyway).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agentd._delivery import ack_frame
from agentd._envelope import build_envelope, parse_envelope, thread_hint
from agentd._errors import AgentdError, Rejection
from agentd._schemas import NS_CORE, NS_ENV
from agentd._threads import new_uuid
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import is_xmlified, spec_of
from agentd.bus import auth_frame, client_context, current_totp, parse_auth_ok

__all__ = ["AuthenticationFailed", "BusClient", "BusError", "frame_kind", "is_answer"]

_MESSAGE = "{" + NS_ENV + "}message"
_CORE = "{" + NS_CORE + "}"


class BusError(AgentdError):
    """The bus could not be reached or the connection broke. `certificate` is True
    when the server's certificate was not trusted (the fix is a CA file)."""

    def __init__(self, message: str, *, certificate: bool = False) -> None:
        super().__init__(message)
        self.certificate = certificate


class AuthenticationFailed(BusError):
    """The server refused the first frame (close code 4401, or 4408 on timeout)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"authentication failed (close code {code}: {reason or 'no reason'})")
        self.code = code
        self.reason = reason


def frame_kind(frame: bytes) -> tuple[str, str, str]:
    """(sender, payload local name, thread) of an envelope frame."""
    env = parse_envelope(frame)
    tag = env.payload.tag
    return env.sender, tag.split("}", 1)[-1] if isinstance(tag, str) else "?", env.thread


def is_answer(frame: bytes) -> bool:
    """True for any frame that answers an envelope (everything but `accepted`)."""
    sender, kind, _ = frame_kind(frame)
    return not (sender == "core" and kind == "accepted")


class BusClient:
    def __init__(
        self,
        url: str,
        client: str,
        *,
        secret: str | None = None,
        session: str | None = None,
        totp: str | None = None,
        cafile: str | Path | None = None,
        verify: bool = True,
        ssl_context: ssl.SSLContext | None = None,
        max_size: int = 1024 * 1024,
        open_timeout: float = 10.0,
        delivered: int | None = None,
        stream: bool = False,
        ping_interval: float | None = 20.0,
        ping_timeout: float | None = 20.0,
    ) -> None:
        if secret is None and session is None and totp is None:
            raise ValueError("BusClient needs a TOTP secret, a code or a session token")
        self.url = url
        self.client = client
        self.secret = secret
        self.session = session
        self._totp = totp
        if not url.startswith("wss://"):
            # The first frame is a credential (a TOTP code, a session token good for
            # hours): never sent where it could be read.
            raise ValueError(f"the bus speaks TLS only: a wss:// URL, not {url[:40]!r}")
        self._ssl: ssl.SSLContext | None = ssl_context or client_context(cafile, verify)
        self.max_size = max_size
        self.open_timeout = open_timeout
        self.delivered = delivered
        self.stream = stream  # previews of models' text on every thread (auth frame)
        # Keepalive: a ping every `ping_interval` s; no pong within `ping_timeout` s
        # and the link is taken for dead (a `Client` then resumes the session).
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._ws: ClientConnection | None = None
        self._backlog: deque[bytes] = deque()

    # ---- connection -----------------------------------------------------------

    async def __aenter__(self) -> BusClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the socket and authenticate; sets `session` from `auth-ok`."""
        try:
            self._ws = await connect(
                self.url,
                ssl=self._ssl,
                compression=None,
                max_size=self.max_size,
                open_timeout=self.open_timeout,
                ping_interval=self.ping_interval,
                ping_timeout=self.ping_timeout,
            )
        except InvalidStatus as exc:
            raise BusError(f"{self.url}: HTTP {exc.response.status_code}") from None
        except ssl.SSLCertVerificationError as exc:
            raise BusError(f"cannot connect to {self.url}: {exc.verify_message or exc}",
                           certificate=True) from None
        except (OSError, ssl.SSLError, TimeoutError, ConnectionClosed) as exc:
            raise BusError(f"cannot connect to {self.url}: {exc}") from None
        if self.session is not None and self._totp is None:
            first = auth_frame(self.client, session=self.session, delivered=self.delivered,
                               stream=self.stream)
        else:
            code = self._totp or current_totp(self.secret or "")
            self._totp = None  # a code is good once
            first = auth_frame(self.client, totp=code, delivered=self.delivered,
                               stream=self.stream)
        ws = self._ws
        try:
            await ws.send(first, text=True)
            reply = await ws.recv(decode=False)
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            raise AuthenticationFailed(
                rcvd.code if rcvd else None, rcvd.reason if rcvd else ""
            ) from None
        ok = parse_auth_ok(reply)
        if ok is None:
            await ws.close()
            raise BusError("the server did not answer with auth-ok")
        self.session = ok[1]

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()

    @property
    def connection(self) -> ClientConnection:
        if self._ws is None:
            raise BusError("not connected")
        return self._ws

    @property
    def kept(self) -> tuple[bytes, ...]:
        """Frames for other threads that `exchange` passed over, oldest first: the
        next `recv` calls return them before anything new."""
        return tuple(self._backlog)

    @property
    def close_code(self) -> int | None:
        return None if self._ws is None else self._ws.close_code

    # ---- frames --------------------------------------------------------------------

    def wrap(
        self, data: bytes | str | Any, thread: str | None = None, to: str | None = None
    ) -> tuple[bytes, str]:
        """An envelope for `data` (envelope bytes are passed through) and the thread
        the server answers it on: its `thread`, or for bytes too broken to parse the
        daemon's reading of them (`thread_hint`: the nil thread if none). `to` names
        the listener for a bare payload; an envelope names its own."""
        if not isinstance(data, bytes | bytearray | str):
            if not is_xmlified(data):
                raise TypeError("send() takes envelope or payload bytes, or an @xmlify object")
            thread = thread or new_uuid()
            return build_envelope(self.client, thread, spec_of(data).to_bytes(data), to), thread
        raw = data.encode() if isinstance(data, str) else bytes(data)
        try:
            root = parse_untrusted(raw, max_bytes=self.max_size)
        except Rejection as exc:
            raise ValueError(f"not well-formed XML: {exc.detail or exc}") from None
        if root.tag == _MESSAGE:
            if to is not None:
                raise ValueError("an envelope names its own recipient (meta/to); "
                                 "`to` is for bare payloads")
            try:
                return raw, parse_envelope(raw, max_bytes=self.max_size).thread
            except Rejection:
                return raw, thread_hint(raw)  # sent as is: the server answers with its huh
        thread = thread or new_uuid()
        return build_envelope(self.client, thread, c14n(root), to), thread

    async def send(
        self, data: bytes | str | Any, thread: str | None = None, to: str | None = None
    ) -> str:
        """Send an envelope, or a bare payload (bytes or an @xmlify object) wrapped
        with `from` = this client on `thread` (new if None). Returns the thread."""
        frame, thread_id = self.wrap(data, thread, to)
        await self.send_raw(frame)
        return thread_id

    async def ack(self, seq: int) -> None:
        """Acknowledge every outbox frame up to delivery seq `seq`."""
        await self.send_raw(ack_frame(self.client, seq))

    async def send_raw(self, frame: bytes | str) -> None:
        """Send one frame exactly as given (tests use it for hostile input)."""
        try:
            if isinstance(frame, str):
                await self.connection.send(frame)
            else:
                await self.connection.send(frame, text=True)
        except ConnectionClosed as exc:
            raise BusError(f"connection closed: {exc}") from None

    async def recv(self, timeout: float | None = None) -> bytes:
        """The next frame (an envelope). Raises TimeoutError, or BusError once closed."""
        if self._backlog:
            return self._backlog.popleft()
        try:
            async with asyncio.timeout(timeout):
                return await self.connection.recv(decode=False)
        except ConnectionClosed as exc:
            raise BusError(f"connection closed: {exc}") from None

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[bytes]:
        while True:
            try:
                yield await self.recv()
            except BusError:
                return

    async def exchange(
        self, data: bytes | str | Any, thread: str | None = None, timeout: float = 30.0
    ) -> list[bytes]:
        """Send and collect the frames on that thread up to and including its answer
        (the first frame that is not `accepted`). Frames for other threads are kept
        for `recv`."""
        thread_id = await self.send(data, thread)
        frames: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        skipped: list[bytes] = []
        try:
            while True:
                frame = await self._next_live(deadline - loop.time())
                _, _, frame_thread = frame_kind(frame)
                if frame_thread != thread_id and thread_id:
                    skipped.append(frame)
                    continue
                frames.append(frame)
                if is_answer(frame):
                    return frames
        finally:
            self._backlog.extend(skipped)

    async def _next_live(self, timeout: float) -> bytes:
        if timeout <= 0:
            raise TimeoutError
        try:
            async with asyncio.timeout(timeout):
                return await self.connection.recv(decode=False)
        except ConnectionClosed as exc:
            raise BusError(f"connection closed: {exc}") from None
