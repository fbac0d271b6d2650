"""The out-of-band server: a Unix socket adapter around the protocol in `_protocol`.

Invariants:

- The socket is never reachable by anyone but its owner: it is bound inside a fresh
  private directory (mkdtemp: mode 0700, so nobody else can even reach the name),
  chmod'ed to 0600, made to listen, and only then renamed to its final path. The
  rename is atomic, so at no moment does `socket_path` name a socket that is open to
  others or that refuses connections. No umask is touched (it is process-wide).
- A file already at `socket_path` is replaced only when it is a socket that nobody
  answers on (a crashed daemon's); a live listener or anything that is not a socket
  is refused. On close the socket is unlinked only if it is still ours (same inode).
- Every connection's peer credentials (SO_PEERCRED, taken by the kernel at connect
  time) must be root, the daemon's own uid or one of `allowed_uids`, and the peer
  must not be one of the daemon's confined children (a handler worker, an exec
  tool, an MCP server, or anything they started: `confined(pid)`), which run as the
  daemon's uid unless `isolation.user` is set; otherwise the connection is closed
  before a byte is read, and the refusal is a security event.
- A frame that fails verification is answered and its connection closed: a peer
  gets one refusal per connection, never a stream of them on one.
- Each connection is an explicit state machine (READING -> EXECUTING -> READING …
  -> CLOSED); `close()` cancels connections that are waiting for a request and
  gives those executing a command a grace period to send their answer.
- Every refusal is answered with its code and counted (`oob_commands{command,outcome}`
  and `security_events{kind}`); the first few from a peer in an interval are logged
  and passed to `audit(kind, fields)` one by one, the rest as one `repeated-refusals`
  event with their count when the interval ends (`_refusals`), so a flood costs a
  bounded number of journal rows. Every command that ran is passed to
  `audit("oob-command", fields)` with its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from lxml import etree

from agentd import _metrics as metrics
from agentd._errors import AgentdError
from agentd.confine import is_confined_child
from agentd.oob._keys import load_authorized_keys
from agentd.oob._protocol import (
    COMMAND_NAMES,
    DEFAULT_MAX_NONCES,
    DEFAULT_SKEW_S,
    MAX_FRAME_BYTES,
    ErrorCode,
    FrameDecoder,
    FrameTooLarge,
    Refusal,
    Verifier,
    build_response,
    encode_frame,
    error_response,
)
from agentd.oob._refusals import REPEATED_KIND, RefusalLimiter

log = logging.getLogger("agentd.oob")

AuditSink = Callable[[str, Mapping[str, str]], None]
_COMMAND_CODES = frozenset({"invalid", "failed", "unknown-command"})
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
_READ_SIZE = 65536


class CommandFailed(AgentdError):
    """Raised by `Commands.run`: the command was refused (`invalid`,
    `unknown-command`) or failed (`failed`). `message` goes to the operator."""

    def __init__(self, code: str, message: str) -> None:
        if code not in _COMMAND_CODES:
            code = ErrorCode.FAILED.value
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# The key id whose signed command is running: a command that records who decided
# (an approval) reads it here rather than from its arguments, which the operator
# writes.
operator_key_id: contextvars.ContextVar[str] = contextvars.ContextVar(
    "agentd_oob_operator_key_id", default="")


class Commands(Protocol):
    async def run(self, name: str, args: Mapping[str, str]) -> etree._Element | str:
        """The content of `<result>`: an element (appended inside it) or text.

        Names: status, reload (dry-run=true|false), introspect (what=capabilities|
        schema|example|prompt|threads|thread|timers, name=, thread=), journal (thread=,
        limit=), approvals, approve (id=, payload-sha256=?), deny (id=, reason=?),
        shutdown (mode=graceful|now). Raises `CommandFailed`. `shutdown`
        must schedule the shutdown and return, not await `OobServer.close()`, so that
        its answer can still be sent.
        """
        ...


class OobSocketError(AgentdError):
    """The socket cannot be created at its path (in use, not a socket, too long…)."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    def fields(self) -> dict[str, str]:
        return {"uid": str(self.uid), "pid": str(self.pid), "gid": str(self.gid)}


def peer_credentials(sock: socket.socket) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


def peer_allowed(uid: int, own_uid: int, allowed_uids: Iterable[int]) -> bool:
    return uid == 0 or uid == own_uid or uid in allowed_uids


def command_label(name: str | None) -> str:
    """Metric label for a command name (bounded: names come from unverified input)."""
    if not name:
        return "none"
    return name if name in COMMAND_NAMES else "other"


def command_title(name: str, args: Mapping[str, str]) -> str:
    """How the journal names a command that ran: `introspect` with what it looked at
    (`introspect thread`), so an audit entry says which subcommand ran."""
    what = args.get("what")
    return f"{name} {what}" if name == "introspect" and what else name


class ServerState(Enum):
    NEW = "new"
    SERVING = "serving"
    CLOSING = "closing"
    CLOSED = "closed"


class ConnectionState(Enum):
    READING = "reading"      # waiting for (the rest of) a request frame
    EXECUTING = "executing"  # verifying, running a command, sending its answer
    CLOSED = "closed"


@dataclass(eq=False)
class _Connection:
    peer: Peer
    task: asyncio.Task[object] | None
    state: ConnectionState = ConnectionState.READING
    requests: int = field(default=0)


class OobServer:
    def __init__(self, socket_path: Path, authorized_keys: Path, commands: Commands, *,
                 allowed_uids: Iterable[int] = (), max_frame_bytes: int = MAX_FRAME_BYTES,
                 clock_skew_s: float = DEFAULT_SKEW_S, audit: AuditSink | None = None,
                 clock: Callable[[], float] = time.time, max_nonces: int = DEFAULT_MAX_NONCES,
                 idle_timeout_s: float = 60.0, max_connections: int = 64,
                 confined: Callable[[int], bool] = is_confined_child,
                 refusal_interval_s: float = 10.0) -> None:
        self.socket_path = Path(socket_path)
        self.authorized_keys = Path(authorized_keys)
        self._commands = commands
        self.allowed_uids = frozenset(allowed_uids)
        self.max_frame_bytes = max_frame_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._audit_sink = audit
        self._clock = clock
        self._own_uid = os.geteuid()
        self._verifier = Verifier({}, clock_skew_s=clock_skew_s,
                                  max_frame_bytes=max_frame_bytes, max_nonces=max_nonces)
        self._state = ServerState.NEW
        self._server: asyncio.AbstractServer | None = None
        self._inode: tuple[int, int] | None = None
        self._connections: set[_Connection] = set()
        self._confined = confined
        self._refusals = RefusalLimiter(refusal_interval_s)
        self._full = RefusalLimiter(refusal_interval_s, burst=1, max_peers=1)
        self._flush: asyncio.TimerHandle | None = None

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def connections(self) -> int:
        """Operator connections open now (each counts against `max_connections`)."""
        return len(self._connections)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._verifier.keys)

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Load the keys, replace a stale socket, then listen.

        The socket is bound in a fresh mkdtemp directory (mode 0700: no other user can
        reach the name inside it, whatever the socket's own mode), chmod'ed to 0600,
        put in listening state, and only then renamed to `socket_path`. So the path
        never names a socket that is wider than 0600 or that refuses connections,
        and no process-wide umask is changed. Raises `OobSocketError` when a live
        listener or a non-socket is at the path, `AuthorizedKeysError` for bad keys.
        """
        if self._state is not ServerState.NEW:
            raise RuntimeError(f"OobServer.start() in state {self._state.value}")
        if not hasattr(socket, "SO_PEERCRED"):
            raise OobSocketError("this platform has no SO_PEERCRED; the OOB channel "
                                 "cannot check who connects")
        self._verifier.keys = load_authorized_keys(self.authorized_keys)
        if not self._verifier.keys:
            log.warning("oob: %s holds no keys; every privileged command will be refused",
                        self.authorized_keys)
        path = self.socket_path
        if len(os.fsencode(path)) > _UNIX_PATH_MAX:
            raise OobSocketError(f"socket path {path} is longer than {_UNIX_PATH_MAX} bytes")
        await self._remove_stale(path)
        sock = self._bind_private(path)
        try:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)
        except BaseException:
            sock.close()
            self._unlink_if_ours()
            raise
        self._state = ServerState.SERVING
        log.info("oob: listening on %s (keys: %s)", path, ", ".join(self.key_ids) or "none")

    def _bind_private(self, path: Path) -> socket.socket:
        try:
            tmpdir = tempfile.mkdtemp(prefix=".oob", dir=path.parent)  # mode 0700
        except OSError as exc:
            raise OobSocketError(f"cannot create the socket in {path.parent}: "
                                 f"{(exc.strerror or str(exc)).lower()}") from None
        tmp = Path(tmpdir) / "s"
        if len(os.fsencode(tmp)) > _UNIX_PATH_MAX:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise OobSocketError(f"socket directory {path.parent} is too long a path to bind "
                                 f"in (limit {_UNIX_PATH_MAX} bytes)")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(tmp))
            os.chmod(tmp, 0o600)
            sock.listen(128)
            os.rename(tmp, path)  # atomic; replaces a stale socket left in a race
            st = os.lstat(path)
            self._inode = (st.st_dev, st.st_ino)
        except OSError as exc:
            sock.close()
            raise OobSocketError(f"cannot create socket {path}: "
                                 f"{(exc.strerror or str(exc)).lower()}") from None
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
        return sock

    async def _remove_stale(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise OobSocketError(f"{path} exists and is not a socket; refusing to replace it")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), 2.0)
        except ConnectionRefusedError:
            pass  # nobody listens: a crashed daemon's socket
        except FileNotFoundError:
            return
        except TimeoutError:
            raise OobSocketError(f"{path} is a live socket (it accepts but is busy); "
                                 f"is another agentd running?") from None
        except OSError as exc:
            raise OobSocketError(f"cannot probe existing socket {path}: "
                                 f"{(exc.strerror or str(exc)).lower()}") from None
        else:
            writer.close()
            raise OobSocketError(f"another process is listening on {path}; "
                                 f"is agentd already running?")
        with contextlib.suppress(FileNotFoundError):
            again = os.lstat(path)
            if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
                log.warning("oob: removed stale socket %s (nothing answered on it)", path)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, let running commands answer (up to `grace_s`), unlink."""
        if self._state is ServerState.NEW:
            self._state = ServerState.CLOSED
            return
        if self._state is not ServerState.SERVING:
            return
        self._state = ServerState.CLOSING
        if self._flush is not None:
            self._flush.cancel()
        self._report_repeated(float("inf"))
        assert self._server is not None
        self._server.close()
        me = asyncio.current_task()
        waiting: list[asyncio.Task[object]] = []
        for conn in list(self._connections):
            if conn.task is None or conn.task is me:
                continue  # a command closing the server from its own connection
            if conn.state is ConnectionState.READING:
                conn.task.cancel()
            waiting.append(conn.task)
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._unlink_if_ours()
        self._state = ServerState.CLOSED
        log.info("oob: closed %s", self.socket_path)

    def _unlink_if_ours(self) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(self.socket_path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.socket_path)

    def reload_keys(self, keys: Mapping[str, Ed25519PublicKey] | None = None) -> None:
        """Re-read authorized_keys, or install `keys` already read (and so validated)
        with `load_authorized_keys`. On any error the keys in use are kept and
        `AuthorizedKeysError` (a `ConfigError`) is raised. Requests already verified
        are not affected; the next one sees the new keys."""
        if keys is None:
            keys = load_authorized_keys(self.authorized_keys)
        self._verifier.keys = dict(keys)
        log.info("oob: authorized keys reloaded (%s)", ", ".join(sorted(keys)) or "none")

    def remember_nonces(self, seen: Iterable[tuple[str, float]]) -> int:
        """Seed the replay cache with (nonce, time seen) pairs from before a restart
        (the daemon reads them back from its journal), so a request captured shortly
        before a restart cannot be replayed after it. Returns how many are in force."""
        now = self._clock()
        kept = 0
        for nonce, seen_at in seen:
            if now - seen_at < 2 * self._verifier.clock_skew_s:
                self._verifier.nonces.add(nonce, seen_at)
                kept += 1
        return kept

    # --- connections ---------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = peer_credentials(writer.get_extra_info("socket"))
        except OSError as exc:
            log.warning("oob: cannot read peer credentials (%s); closing", exc)
            writer.close()
            return
        if not peer_allowed(peer.uid, self._own_uid, self.allowed_uids):
            self._security_event("peer-refused", {
                **peer.fields(), "detail": "uid is not root, the daemon's uid or allowed",
            }, peer)
            writer.close()
            return
        if self._confined(peer.pid):
            self._security_event("peer-refused", {
                **peer.fields(), "detail": "a confined child of the daemon (a handler "
                "worker, an exec tool, an MCP server or what they started)",
            }, peer)
            writer.close()
            return
        if len(self._connections) >= self.max_connections:
            now = self._clock()
            for summary in self._full.due(now):
                log.warning("oob: %d more connections refused in %.0f s: %d were open",
                            summary.count, self._full.interval_s, self.max_connections)
            if self._full.admit("all", "full", now):
                log.warning("oob: %d connections open; refusing uid=%d pid=%d (further "
                            "refusals are counted for %.0f s)", len(self._connections),
                            peer.uid, peer.pid, self._full.interval_s)
            writer.close()
            return
        conn = _Connection(peer, asyncio.current_task())
        self._connections.add(conn)
        try:
            await self._converse(conn, reader, writer)
        except (ConnectionError, TimeoutError):
            pass
        except Exception:
            log.exception("oob: connection from uid=%d pid=%d failed", peer.uid, peer.pid)
        finally:
            conn.state = ConnectionState.CLOSED
            self._connections.discard(conn)
            writer.close()

    async def _converse(self, conn: _Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        decoder = FrameDecoder(self.max_frame_bytes)
        deadline = loop.time() + self.idle_timeout_s
        while self._state is ServerState.SERVING:
            remaining = deadline - loop.time()
            if remaining <= 0:
                log.info("oob: closing idle connection uid=%d pid=%d", conn.peer.uid,
                         conn.peer.pid)
                return
            data = await asyncio.wait_for(reader.read(_READ_SIZE), remaining)
            if not data:
                return
            try:
                frames = decoder.receive_data(data)
            except FrameTooLarge as too_large:
                conn.state = ConnectionState.EXECUTING
                self._refused(too_large, conn.peer)
                await self._send(writer, error_response(too_large.code, too_large.message))
                return
            for frame in frames:
                conn.state = ConnectionState.EXECUTING
                conn.requests += 1
                response, close = await self.handle_frame(frame, conn.peer)
                await self._send(writer, response)
                conn.state = ConnectionState.READING
                if close or self._state is not ServerState.SERVING:
                    return
            if frames:
                deadline = loop.time() + self.idle_timeout_s

    async def _send(self, writer: asyncio.StreamWriter, response: bytes) -> None:
        writer.write(encode_frame(response))
        await asyncio.wait_for(writer.drain(), self.idle_timeout_s)

    async def handle_frame(self, frame: bytes, peer: Peer) -> tuple[bytes, bool]:
        """One request frame in, (response frame body, close the connection?) out.
        The whole request path, usable without a socket."""
        try:
            cmd = self._verifier.verify(frame, self._clock())
        except Refusal as refusal:
            self._refused(refusal, peer)
            # Closed whatever the refusal: a peer that does not sign gets no second try
            # on the same connection (one connection could carry thousands a second).
            return error_response(refusal.code, refusal.message), True
        started = time.perf_counter()
        outcome, message = "ok", ""
        try:
            token = operator_key_id.set(cmd.key_id)
            try:
                result = await self._commands.run(cmd.name, cmd.args)
            except CommandFailed as failed:
                outcome, message = failed.code, failed.message
                response = error_response(failed.code, failed.message)
            else:
                response = build_response(result)
                if len(response) > self.max_frame_bytes:
                    outcome = ErrorCode.FAILED.value
                    message = (f"the result is {len(response)} bytes, over the "
                               f"{self.max_frame_bytes}-byte frame limit; narrow the request")
                    response = error_response(outcome, message)
            finally:
                operator_key_id.reset(token)
        except ValueError as exc:  # a result that XML cannot carry
            log.warning("oob: command %s returned a result XML cannot carry: %s", cmd.name, exc)
            outcome, message = ErrorCode.FAILED.value, "the result cannot be encoded as XML"
            response = error_response(outcome, message)
        except Exception:
            log.exception("oob: command %s failed", cmd.name)
            outcome, message = ErrorCode.FAILED.value, "internal error (see the daemon's log)"
            response = error_response(outcome, message)
        elapsed_ms = (time.perf_counter() - started) * 1000
        metrics.oob_commands.labels(command_label(cmd.name), outcome).inc()
        fields = {
            "channel": "oob", "key_id": cmd.key_id, "command": command_title(cmd.name, cmd.args),
            "args": json.dumps(dict(cmd.args), sort_keys=True, ensure_ascii=False),
            "nonce": cmd.nonce, "issued_at": cmd.issued_at.isoformat(), "outcome": outcome,
            **peer.fields(), "duration_ms": f"{elapsed_ms:.1f}",
        }
        if message:
            fields["error"] = message
        log.info("oob command key_id=%s command=%r args=%s outcome=%s uid=%d",
                 cmd.key_id, fields["command"], fields["args"], outcome, peer.uid)
        self._audit("oob-command", fields)
        return response, False

    # --- reporting -----------------------------------------------------------------

    def _refused(self, refusal: Refusal, peer: Peer) -> None:
        metrics.oob_commands.labels(
            command_label(refusal.fields.get("command")), refusal.code.value).inc()
        self._security_event(refusal.kind, {
            "code": refusal.code.value, **peer.fields(), **refusal.fields,
            "message": refusal.message, "detail": refusal.detail,
        }, peer)

    def _security_event(self, kind: str, fields: Mapping[str, str], peer: Peer) -> None:
        metrics.security_events.labels(kind).inc()
        now = self._clock()
        self._report_repeated(now)
        if not self._refusals.admit(f"uid={peer.uid} pid={peer.pid}", kind, now):
            self._schedule_report()
            return
        self._report(kind, {"channel": "oob", **fields})

    def _schedule_report(self) -> None:
        if self._flush is not None or self._state is not ServerState.SERVING:
            return

        def report() -> None:
            self._flush = None
            self._report_repeated(self._clock())
            if self._refusals.pending():
                self._schedule_report()

        self._flush = asyncio.get_running_loop().call_later(self._refusals.interval_s,
                                                            report)

    def _report_repeated(self, now: float) -> None:
        for summary in self._refusals.due(now):
            self._report(REPEATED_KIND, {
                "channel": "oob", "peer": summary.peer, "count": str(summary.count),
                "kinds": ",".join(f"{k}:{n}" for k, n in summary.kinds.items()),
                "detail": f"refusals counted, not journaled one by one, in "
                          f"{self._refusals.interval_s:.0f} s",
            })

    def _report(self, kind: str, fields: Mapping[str, str]) -> None:
        log.warning("security event kind=%s %s", kind,
                    " ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in fields.items()))
        self._audit(kind, fields)

    def _audit(self, kind: str, fields: Mapping[str, str]) -> None:
        if self._audit_sink is None:
            return
        try:
            self._audit_sink(kind, fields)
        except Exception:
            log.exception("oob: the audit sink failed on %s", kind)
