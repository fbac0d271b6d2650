"""Client authentication for the main bus.

A client proves itself with its first frame: a TOTP code (RFC 6238: SHA-1, 6
digits, 30 s step, one step of tolerance either side) or a session token that an
earlier `auth-ok` gave it.

Invariants:
- Every failure looks the same from outside: `authenticate` returns None, whatever
  the cause (unknown client, wrong or reused code, lockout, bad session, garbage).
  The cause goes to the log only.
- Every TOTP or session request costs the same work whether or not the client id
  exists or is locked out: an unknown id is checked against a fixed dummy secret,
  so response time does not tell which ids exist.
- A TOTP step, once accepted for a client, is never accepted again: the last
  accepted step is persisted before `auth-ok` goes out, so a restart does not
  reopen the window. When the state is in the kernel too (postgres), the session
  a login opens is committed there before `auth-ok` goes out (`take_commit`), so a
  standby that takes over right after knows the token the client was just given.
- Session tokens are 256-bit random strings; only their SHA-256 is kept (in memory
  and on disk), with an absolute expiry. A lockout revokes all of a client's tokens.
- `max_failures` failures within `failure_window_s` lock the client out for
  `lockout_s`; a locked-out client fails even with a correct code, and failures
  while locked do not extend the lockout (an attacker cannot lock a client out for
  longer than one lockout per window of failures).
- The state file (`auth-state.json`, mode 0600) is written atomically: tmp file,
  fsync, rename, fsync of the folder. It is this module's own file, never the
  kernel's database.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentd._delivery import parse_seq
from agentd._errors import AgentdError, ConfigError, Rejection
from agentd._schemas import NS_AUTH, NS_DELIVERY, NS_STREAM, schema
from agentd._secrets import SecretFileError, read_secret_file, write_private_atomic
from agentd._xml import ShapeLimits, escape_text, parse_untrusted
from agentd.config import (
    AuthConfig,
    ClientEntry,
    normalise_secret,
    read_clients_text,
)

log = logging.getLogger("agentd.auth")

STATE_FILE = "auth-state.json"
TOTP_STEP_S = 30
TOTP_DIGITS = 6
MAX_AUTH_FRAME_BYTES = 4096
# auth, client, totp or session, a seq and the stream opt-in, none with an
# attribute: anything beyond is refused before the schema validator, which reports
# one error per attribute.
_AUTH_SHAPE = ShapeLimits(max_attributes=4, max_elements=8)
MAX_SESSIONS_PER_CLIENT = 64  # oldest tokens are dropped beyond this
_X = "{" + NS_AUTH + "}"
# Checked in place of a real secret for an unknown client id (its result is ignored).
DUMMY_TOTP_SECRET = "AGENTDDUMMYSECRETAGENTDDUMMYSECR"


class AuthFileError(AgentdError):
    """The clients file or the auth state file cannot be used."""


@dataclass(frozen=True)
class ClientsDiff:
    """What a new clients file changes: client ids added, removed, and changed (a new
    secret or profile); `rekeyed` are the changed ones whose secret is new."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    rekeyed: tuple[str, ...] = ()

    @property
    def withdrawn(self) -> tuple[str, ...]:
        """Clients whose existing sessions and connections must end."""
        return tuple(sorted((*self.removed, *self.rekeyed)))


@dataclass
class _ClientState:
    last_step: int = -1  # the last TOTP step accepted (never accepted again)
    sessions: dict[str, float] = field(default_factory=dict)  # sha256 hex -> expires (epoch)
    locked_until: float = 0.0  # epoch seconds
    failures: deque[float] = field(default_factory=deque)  # in memory only


# ---- frames ---------------------------------------------------------------------


@dataclass(frozen=True)
class AuthRequest:
    client: str
    totp: str | None = None
    session: str | None = None
    # The last delivery seq the client received (`<d:seq>`; 0: none yet), or None: a
    # client that does not acknowledge delivery (its frames leave the outbox once
    # written to its socket).
    delivered: int | None = None
    stream: bool = False  # `<s:stream/>`: partials for every thread of the session


_SEQ, _STREAM = "{" + NS_DELIVERY + "}seq", "{" + NS_STREAM + "}stream"


def parse_auth_frame(frame: bytes) -> AuthRequest | None:
    """The first frame, checked against `schemas/auth.xsd`; None if it is not one."""
    try:
        root = parse_untrusted(frame, max_bytes=MAX_AUTH_FRAME_BYTES, shape=_AUTH_SHAPE)
    except Rejection:
        return None
    if root.tag != _X + "auth" or not schema(NS_AUTH).validate(root):
        return None
    client = (root[0].text or "").strip()
    second = root[1]
    text = (second.text or "").strip()
    delivered: int | None = None
    stream = False
    extras = list(root[2:])
    # In order, each at most once: `<d:seq>` digits, then an empty `<s:stream/>`.
    if extras and extras[0].tag == _SEQ:
        seq = extras.pop(0)
        delivered = parse_seq(seq.text)
        if delivered is None or len(seq) or seq.attrib:
            return None
    if extras and extras[0].tag == _STREAM:
        opt = extras.pop(0)
        if len(opt) or opt.attrib or (opt.text or "").strip():
            return None
        stream = True
    if extras:
        return None
    if second.tag == _X + "totp":
        return AuthRequest(client, totp=text, delivered=delivered, stream=stream)
    return AuthRequest(client, session=text, delivered=delivered, stream=stream)


def auth_frame(
    client: str, *, totp: str | None = None, session: str | None = None,
    delivered: int | None = None, stream: bool = False,
) -> bytes:
    """The client's first frame (used by `BusClient` and tests). `delivered`: the
    last delivery seq received (0 for none), which also asks for acknowledged
    delivery; `stream`: partials for every thread of the session."""
    if (totp is None) == (session is None):
        raise ValueError("give exactly one of totp or session")
    inner = f"<totp>{escape_text(totp)}</totp>" if totp is not None else (
        f"<session>{escape_text(session or '')}</session>"
    )
    if delivered is not None:
        inner += f'<d:seq xmlns:d="{NS_DELIVERY}">{int(delivered)}</d:seq>'
    if stream:
        inner += f'<s:stream xmlns:s="{NS_STREAM}"></s:stream>'
    return (
        f'<auth xmlns="{NS_AUTH}"><client>{escape_text(client)}</client>{inner}</auth>'
    ).encode()


def auth_ok_frame(client: str, session: str) -> bytes:
    return (
        f'<auth-ok xmlns="{NS_AUTH}"><client>{escape_text(client)}</client>'
        f"<session>{session}</session></auth-ok>"
    ).encode()


def parse_auth_ok(frame: bytes) -> tuple[str, str] | None:
    """(client, session) from an `auth-ok` frame, or None."""
    try:
        root = parse_untrusted(frame, max_bytes=MAX_AUTH_FRAME_BYTES)
    except Rejection:
        return None
    if root.tag != _X + "auth-ok" or not schema(NS_AUTH).validate(root):
        return None
    return (root[0].text or "").strip(), (root[1].text or "").strip()


# ---- the clients file -------------------------------------------------------------




def read_clients_file(path: Path) -> dict[str, ClientEntry]:
    """Read and check `{clients: {id: {totp_secret, profile}}}`; every problem is listed."""
    try:
        text = read_secret_file(path, "clients file").decode("utf-8")
        return read_clients_text(text, str(path))
    except SecretFileError as exc:
        raise AuthFileError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise AuthFileError(f"clients file {path}: cannot read: {exc}") from None
    except ConfigError as exc:
        raise AuthFileError(f"clients file {path}:\n  " + "\n  ".join(exc.issues)) from None


# ---- authentication ---------------------------------------------------------------


def diff_clients(old: Mapping[str, ClientEntry], new: Mapping[str, ClientEntry]) -> ClientsDiff:
    """What replacing the clients `old` with `new` changes."""
    changed = sorted(c for c in new.keys() & old.keys() if new[c] != old[c])
    return ClientsDiff(
        added=tuple(sorted(new.keys() - old.keys())),
        removed=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(changed),
        rekeyed=tuple(c for c in changed if new[c].totp_secret != old[c].totp_secret),
    )


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def totp_code(secret: str, step: int) -> str:
    """The RFC 6238 code (HMAC-SHA-1, 6 digits) of a base32 `secret` for a 30 s step
    number. Computed here, not by pyotp: pyotp 2.10 and later refuse secrets under
    112 bits, and a client's secret may have 80 (the configuration's minimum, which
    the usual authenticator examples have)."""
    key = base64.b32decode(secret.upper() + "=" * (-len(secret) % 8))
    digest = hmac.new(key, step.to_bytes(8, "big"), hashlib.sha1).digest()
    offset = digest[-1] & 0x0F
    value = int.from_bytes(digest[offset:offset + 4], "big") & 0x7FFFFFFF
    return f"{value % 10 ** TOTP_DIGITS:0{TOTP_DIGITS}d}"


def current_totp(secret: str, clock: Callable[[], float] = time.time) -> str:
    """The code for now (what a client sends, what `agentd totp` prints)."""
    return totp_code(secret, int(clock() // TOTP_STEP_S))


class ClientAuth:
    """Who may connect to the bus, and the TOTP/session/lockout state that decides it."""

    def __init__(
        self,
        entries: dict[str, ClientEntry],
        state_path: Path,
        cfg: AuthConfig,
        *,
        clock: Callable[[], float] = time.time,
        code_at: Callable[[str, int], str] = totp_code,
    ) -> None:
        self._entries = entries
        self._state_path = state_path
        self._cfg = cfg
        self._clock = clock
        self._code_at = code_at  # (secret, step) -> code; injectable to count the work
        self._state: dict[str, _ClientState] = {c: _ClientState() for c in entries}
        self.on_lockout: Callable[[str], None] | None = None
        self._save: Callable[[dict[str, str]], Awaitable[object] | None] | None = None
        self._commit: Awaitable[object] | None = None  # see `take_commit`

    @classmethod
    def load(
        cls,
        clients_file: Path,
        state_dir: Path,
        cfg: AuthConfig,
        *,
        clock: Callable[[], float] = time.time,
    ) -> ClientAuth:
        """Read the clients file (refused unless mode 0600 or stricter) and the
        persisted state (sessions, last accepted steps, lockouts)."""
        return cls.restore(read_clients_file(Path(clients_file)), state_dir, cfg, clock=clock)

    @classmethod
    def restore(
        cls,
        entries: Mapping[str, ClientEntry],
        state_dir: Path,
        cfg: AuthConfig,
        *,
        clock: Callable[[], float] = time.time,
        saved: Mapping[str, str] | None = None,
        save: Callable[[dict[str, str]], Awaitable[object] | None] | None = None,
    ) -> ClientAuth:
        """`entries` already read and checked (the daemon's preflight), with the
        persisted state (sessions, last accepted steps, lockouts). `saved` and `save`:
        that state also in the kernel, one JSON text per client (on PostgreSQL a
        standby that takes over reads it there); `saved` wins over the file when it
        has any client; `save` returns the kernel's commit, which `take_commit`
        hands to whoever must wait for it."""
        auth = cls(dict(entries), Path(state_dir) / STATE_FILE, cfg, clock=clock)
        auth._save = save
        if saved:
            try:
                auth._load({c: json.loads(body) for c, body in saved.items()})
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise AuthFileError(f"the kernel's bus authentication state is "
                                    f"unreadable ({exc})") from None
        else:
            auth._read_state()
        return auth

    # -- public surface

    def profiles(self) -> dict[str, str]:
        return {c: e.profile for c, e in self._entries.items()}

    def authenticate(self, frame: bytes) -> tuple[str, str] | None:
        """The first frame -> (client, session token), or None for any failure."""
        self._commit = None  # only this call's write is waited for
        req = parse_auth_frame(frame)
        if req is None:
            log.info("auth failed reason=malformed-frame")
            return None
        now = self._clock()
        entry = self._entries.get(req.client)
        # The verification runs before any decision, whatever the client id: an
        # unknown id costs the same as a wrong code for a known one.
        secret = entry.totp_secret if entry is not None else DUMMY_TOTP_SECRET
        st = self._state[req.client] if entry is not None else _ClientState()
        step: int | None = None
        reused = False
        session_expires: float | None = None
        if req.totp is not None:
            step, reused = self._match_totp(secret, st, req.totp, now)
        elif req.session is not None:
            session_expires = st.sessions.get(_hash_token(req.session))
        if entry is None:
            log.info("auth failed client=%s reason=unknown-client", req.client)
            return None
        if now < st.locked_until:
            log.info("auth failed client=%s reason=locked-out", req.client)
            return None
        if req.totp is not None:
            if step is None:
                self._fail(req.client, st, now, "reused-code" if reused else "wrong-code")
                return None
            st.last_step = step
            token = secrets.token_urlsafe(32)
            self._add_session(st, token, now)
            self._write_state()
            log.info("auth ok client=%s method=totp", req.client)
            return req.client, token
        if req.session is None or session_expires is None or session_expires <= now:
            self._fail(req.client, st, now,
                       "unknown-session" if session_expires is None else "expired-session")
            return None
        log.info("auth ok client=%s method=session", req.client)
        return req.client, req.session

    def take_commit(self) -> Awaitable[object] | None:
        """The kernel's commit of the state the last `authenticate` wrote (None when
        it wrote none, or keeps no state in the kernel). The bus sends `auth-ok` only
        once it is done: the session must outlive a takeover that follows at once."""
        commit, self._commit = self._commit, None
        return commit

    def diff(self, entries: dict[str, ClientEntry]) -> ClientsDiff:
        return diff_clients(self._entries, entries)

    def replace(self, entries: dict[str, ClientEntry]) -> ClientsDiff:
        """Take a re-read clients file (`agentctl reload`). Added clients can log in at
        once; removed clients cannot, and their sessions are revoked; a client whose
        secret changed loses its sessions (they were opened with the old secret) and
        may use the new secret's current code at once (no code of the new secret was
        used yet); a new profile applies to conversations started from now on. The
        used TOTP step of a removed client is kept, so adding it back cannot reopen a
        code. The caller closes the withdrawn clients' connections."""
        diff = self.diff(entries)
        for client in diff.added:
            self._state.setdefault(client, _ClientState())
        for client in diff.withdrawn:
            self._state[client].sessions.clear()
        for client in diff.rekeyed:
            self._state[client].last_step = -1
        self._entries = dict(entries)
        if diff.withdrawn:
            self._write_state()
        return diff

    # -- decisions

    def _match_totp(
        self, secret: str, st: _ClientState, code: str, now: float
    ) -> tuple[int | None, bool]:
        """(the step `code` is good for, or None; whether it matched a step already
        used: a reused code, which only the log is told)."""
        current = int(now // TOTP_STEP_S)
        found: int | None = None
        used = False
        for step in (current - 1, current, current + 1):
            # Compare all three so the time taken does not depend on which matched.
            same = hmac.compare_digest(self._code_at(secret, step), code)
            if same and step > st.last_step and found is None:
                found = step
            used |= same and step <= st.last_step
        return found, used

    def _fail(self, client: str, st: _ClientState, now: float, reason: str) -> None:
        """Count a failure of a known client; lock it out at `max_failures`."""
        log.info("auth failed client=%s reason=%s", client, reason)
        window = self._cfg.failure_window_s
        st.failures.append(now)
        while st.failures and st.failures[0] <= now - window:
            st.failures.popleft()
        if len(st.failures) >= self._cfg.max_failures:
            st.failures.clear()
            st.locked_until = now + self._cfg.lockout_s
            st.sessions.clear()  # a lockout revokes every session token
            self._write_state()
            log.warning(
                "client locked out client=%s lockout_s=%s (sessions revoked)",
                client, self._cfg.lockout_s,
            )
            if self.on_lockout is not None:
                try:
                    self.on_lockout(client)
                except Exception:  # the journal hook must not break authentication
                    log.exception("on_lockout hook failed client=%s", client)

    def _add_session(self, st: _ClientState, token: str, now: float) -> None:
        for digest, expires in list(st.sessions.items()):
            if expires <= now:
                del st.sessions[digest]
        st.sessions[_hash_token(token)] = now + self._cfg.session_ttl_s
        while len(st.sessions) > MAX_SESSIONS_PER_CLIENT:
            del st.sessions[next(iter(st.sessions))]

    # -- persistence

    def _read_state(self) -> None:
        path = self._state_path
        if not path.exists():
            return
        try:
            raw = read_secret_file(path, "auth state file")
        except SecretFileError as exc:
            raise AuthFileError(str(exc)) from None
        try:
            data = json.loads(raw)
            clients = data["clients"]
            if data.get("version") != 1 or not isinstance(clients, dict):
                raise ValueError("unknown layout")
            self._load(clients)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Starting without it would reopen used TOTP codes for replay.
            raise AuthFileError(
                f"auth state file {path} is unreadable ({exc}); if it is damaged, stop "
                "agentd, delete it (clients must then log in again with TOTP) and restart"
            ) from None

    def _load(self, clients: Mapping[str, Any]) -> None:
        for client, body in clients.items():
            st = self._state.get(client)
            if st is None:  # a client removed from the clients file
                continue
            st.last_step = int(body.get("last_step", -1))
            st.locked_until = float(body.get("locked_until", 0.0))
            st.sessions = {str(k): float(v) for k, v in body.get("sessions", {}).items()}

    def _write_state(self) -> None:
        now = self._clock()
        clients: dict[str, dict[str, object]] = {}
        for client, st in self._state.items():
            sessions = {k: v for k, v in st.sessions.items() if v > now}
            clients[client] = {
                "last_step": st.last_step,
                "locked_until": st.locked_until,
                "sessions": sessions,
            }
        if self._save is not None:  # every client: a cleared one replaces its old row
            self._commit = self._save(
                {c: json.dumps(body, sort_keys=True) for c, body in clients.items()})
        kept = {c: body for c, body in clients.items()
                if body["last_step"] != -1 or body["sessions"] or _locked(body, now)}
        body = json.dumps({"version": 1, "clients": kept}, sort_keys=True).encode()
        write_private_atomic(self._state_path, body)


def _locked(body: Mapping[str, Any], now: float) -> bool:
    return float(body["locked_until"]) > now


__all__ = [
    "AuthFileError",
    "AuthRequest",
    "ClientAuth",
    "ClientEntry",
    "ClientsDiff",
    "auth_frame",
    "auth_ok_frame",
    "current_totp",
    "normalise_secret",
    "parse_auth_frame",
    "parse_auth_ok",
    "read_clients_file",
    "totp_code",
    "write_private_atomic",
]
