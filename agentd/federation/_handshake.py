"""The federation handshake, sans I/O: frames in, frames out, a verdict.

After TLS, on the `/federation` WebSocket:

    dialer   -> HELLO {name, nonce_d, max_frame}
    acceptor -> HELLO {name, nonce_a, max_frame}, PROOF {sig_a}
    dialer   -> PROOF {sig_d}
    acceptor -> READY

Each signature covers, with the signer's role, both organism names, both nonces
and the TLS `tls-exporter` value of this connection (`transcript`). So:

- a signature is bound to one TLS connection: a relay that terminates TLS with
  its own certificate has different exporter values on its two sides, and the
  signatures it forwards do not verify;
- a recorded handshake replayed later meets fresh nonces and a fresh exporter;
- the role label keeps one side's signature from being reflected as the other's.

`max_frame` is the largest frame the sender takes on the link (its
`max_frame_bytes`); it is not signed, as nothing on the link can change it but the
two ends of the TLS channel, and it only tells the other side what not to send.

Every failure raises `HandshakeFailed` with a precise reason for the log; the
transport tells the peer only `HANDSHAKE_FAILED`, the same for every cause. The
peer's key is looked up by the name it claims among the declared gateways: an
undeclared name and a wrong key fail the same way, at the same step (the
acceptor answers an undeclared name with a real HELLO and PROOF and fails at the
dialer's PROOF), so the answer does not reveal which names are declared.
"""

from __future__ import annotations

import base64
import binascii
import enum
import secrets
import struct
from collections.abc import Callable, Mapping

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agentd._errors import AgentdError
from agentd._states import step
from agentd.config.sections import DEFAULT_FRAME_BYTES, MIN_FRAME_BYTES
from agentd.federation._frames import encode
from agentd.federation._identity import Identity

PROTOCOL = b"agentd-federation-1"
HANDSHAKE_FAILED = "federation handshake failed"  # the one reason a peer is told
NONCE_BYTES = 32
MAX_FRAME = 1024  # handshake frames are small; a larger one is hostile
MIN_FRAME_LIMIT = MIN_FRAME_BYTES  # the least `max_frame_bytes` a side may announce
MAX_FRAME_LIMIT = 1 << 31
_NAME_MAX = 64


class HandshakeFailed(AgentdError):
    """The handshake failed; `str()` is for the log, never for the peer."""


class Role(enum.Enum):
    DIALER = "dialer"
    ACCEPTOR = "acceptor"


class HsState(enum.Enum):
    START = "start"
    AWAIT_HELLO = "await-hello"  # dialer: sent HELLO; acceptor: nothing yet
    AWAIT_PROOF = "await-proof"  # dialer: has the acceptor's HELLO; acceptor: sent its proof
    AWAIT_READY = "await-ready"  # dialer: sent its proof
    DONE = "done"
    FAILED = "failed"


class HsEvent(enum.Enum):
    START = "start"
    HELLO = "hello"
    PROOF = "proof"
    READY = "ready"
    FAIL = "fail"


TRANSITIONS: Mapping[HsState, Mapping[HsEvent, HsState]] = {
    HsState.START: {HsEvent.START: HsState.AWAIT_HELLO, HsEvent.FAIL: HsState.FAILED},
    HsState.AWAIT_HELLO: {HsEvent.HELLO: HsState.AWAIT_PROOF, HsEvent.FAIL: HsState.FAILED},
    HsState.AWAIT_PROOF: {
        HsEvent.PROOF: HsState.AWAIT_READY, HsEvent.READY: HsState.DONE,
        HsEvent.FAIL: HsState.FAILED,
    },
    HsState.AWAIT_READY: {HsEvent.READY: HsState.DONE, HsEvent.FAIL: HsState.FAILED},
    HsState.DONE: {},
    HsState.FAILED: {HsEvent.FAIL: HsState.FAILED},
}


def transcript(role: Role, dialer: str, acceptor: str, dialer_nonce: bytes,
               acceptor_nonce: bytes, binding: bytes) -> bytes:
    """What `role` signs: every field length-prefixed, so no two field lists
    serialise to the same bytes."""
    out = [PROTOCOL, role.value.encode()]
    out += [dialer.encode(), acceptor.encode(), dialer_nonce, acceptor_nonce, binding]
    return b"".join(struct.pack(">H", len(f)) + f for f in out)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(value: object, size: int, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * size:
        raise HandshakeFailed(f"{what}: not a base64 string")
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise HandshakeFailed(f"{what}: not base64") from None
    if len(data) != size:
        raise HandshakeFailed(f"{what}: {len(data)} bytes, expected {size}")
    return data


def _frame(kind: str, **fields: str) -> bytes:
    return encode({"t": kind, **fields})


def _parse(frame: bytes) -> dict[str, object]:
    if len(frame) > MAX_FRAME:
        raise HandshakeFailed(f"handshake frame of {len(frame)} bytes")
    try:
        value = orjson.loads(frame)  # the reader of the link's other frames (_link.py)
    except orjson.JSONDecodeError:
        raise HandshakeFailed("handshake frame is not JSON") from None
    if not isinstance(value, dict) or not isinstance(value.get("t"), str):
        raise HandshakeFailed("handshake frame without a type")
    return value


class Handshake:
    """One side of one handshake. Feed it the peer's frames with `receive`; send
    what it returns; `peer` is the authenticated peer's name once `done`."""

    def __init__(
        self,
        role: Role,
        identity: Identity,
        binding: bytes,
        peers: Mapping[str, Ed25519PublicKey],
        expect: str | None = None,
        nonce: Callable[[int], bytes] = secrets.token_bytes,
        max_frame: int = DEFAULT_FRAME_BYTES,  # what `max_frame_bytes` is by default
    ) -> None:
        if role is Role.DIALER and expect is None:
            raise ValueError("a dialer knows which peer it dialed")
        self.role = role
        self.identity = identity
        self.binding = binding
        self.peers = peers
        self.expect = expect
        self.state = HsState.START
        self.nonce = nonce(NONCE_BYTES)
        self.peer_nonce = b""
        self.claimed = ""  # the name the peer claims, verified only once `done`
        self.max_frame = max_frame  # what this side takes, announced in its HELLO
        self.peer_max_frame = 0  # what the peer takes, from its HELLO
        self._declared = False

    @property
    def done(self) -> bool:
        return self.state is HsState.DONE

    @property
    def peer(self) -> str | None:
        return self.claimed if self.done else None

    def _to(self, event: HsEvent) -> None:
        self.state = step("federation handshake", TRANSITIONS, self.state, event)

    def fail(self, reason: str) -> HandshakeFailed:
        self.state = HsState.FAILED
        return HandshakeFailed(reason)

    def start(self) -> list[bytes]:
        self._to(HsEvent.START)
        if self.role is Role.DIALER:
            return [self._own_hello()]
        return []

    def receive(self, frame: bytes) -> list[bytes]:
        try:
            return self._receive(_parse(frame))
        except HandshakeFailed as exc:
            raise self.fail(str(exc)) from None

    def _receive(self, msg: dict[str, object]) -> list[bytes]:
        kind, state = msg["t"], self.state
        if kind == "hello" and state is HsState.AWAIT_HELLO:
            return self._hello(msg)
        if kind == "proof" and state is HsState.AWAIT_PROOF and self.role is Role.DIALER:
            self._verify(msg)
            self._to(HsEvent.PROOF)
            return [self._proof()]
        if kind == "proof" and state is HsState.AWAIT_PROOF:
            self._verify(msg)
            if not self._declared:  # unreachable with a valid signature; belt and braces
                raise HandshakeFailed(f"undeclared peer {self.claimed!r}")
            self._to(HsEvent.READY)
            return [_frame("ready")]
        if kind == "ready" and state is HsState.AWAIT_READY:
            self._to(HsEvent.READY)
            return []
        raise HandshakeFailed(f"unexpected {kind!r} frame while {state.value}")

    def _own_hello(self) -> bytes:
        return encode({"t": "hello", "name": self.identity.name, "nonce": _b64(self.nonce),
                       "max_frame": self.max_frame})

    def _hello(self, msg: dict[str, object]) -> list[bytes]:
        name = msg.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX:
            raise HandshakeFailed("hello without a valid name")
        self.peer_nonce = _unb64(msg.get("nonce"), NONCE_BYTES, "nonce")
        limit = msg.get("max_frame")
        if (not isinstance(limit, int) or isinstance(limit, bool)
                or not MIN_FRAME_LIMIT <= limit <= MAX_FRAME_LIMIT):
            raise HandshakeFailed("hello without a valid max_frame")
        self.peer_max_frame = limit
        self.claimed = name
        if self.role is Role.DIALER:
            if name != self.expect:
                raise HandshakeFailed(f"dialed {self.expect!r}, answered by {name!r}")
            self._declared = True
            self._to(HsEvent.HELLO)
            return []
        self._declared = name in self.peers
        self._to(HsEvent.HELLO)
        return [self._own_hello(), self._proof()]

    def _names_nonces(self) -> tuple[str, str, bytes, bytes]:
        if self.role is Role.DIALER:
            return self.identity.name, self.claimed, self.nonce, self.peer_nonce
        return self.claimed, self.identity.name, self.peer_nonce, self.nonce

    def _proof(self) -> bytes:
        signed = transcript(self.role, *self._names_nonces(), self.binding)
        return _frame("proof", sig=_b64(self.identity.key.sign(signed)))

    def _verify(self, msg: dict[str, object]) -> None:
        signature = _unb64(msg.get("sig"), 64, "signature")
        public = self.peers.get(self.claimed)
        if public is None:
            raise HandshakeFailed(f"undeclared peer {self.claimed!r}")
        other = Role.ACCEPTOR if self.role is Role.DIALER else Role.DIALER
        try:
            public.verify(signature, transcript(other, *self._names_nonces(), self.binding))
        except InvalidSignature:
            raise HandshakeFailed(
                f"bad signature from {self.claimed!r} (wrong key, or another TLS channel)"
            ) from None
