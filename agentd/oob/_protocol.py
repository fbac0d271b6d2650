"""The out-of-band protocol without I/O: framing, signing, verification, responses.

Everything here takes values and returns values (the clock is an argument), so the
whole decision of whether a privileged request is accepted is testable without a
socket. The server and the client are thin adapters around it.

Verification, in this order, each failure a `Refusal` with its
error code: size and hardened parse (`invalid`; a frame that is not well-formed XML
also closes the connection), root element and privileged.xsd (`invalid`), key-id
(`unknown-key`), Ed25519 over the exclusive C14N of `privileged` with `signature`
removed (`bad-signature`), `issued-at` within ±skew of the clock (`stale`), nonce
unseen in the window (`replay`). The nonce is remembered only once the signature and
the time have been checked, so unsigned traffic cannot fill the cache.

Canonical signed bytes: `signature` is removed together with the whitespace after
it (the element's tail, as lxml and ElementTree remove it). A DOM library that
removes only the element node leaves that whitespace in place; both forms are
accepted, and they are the same bytes for the compact requests `sign_request` emits.
The base64 of the signature must be canonical (no whitespace, zero padding bits), so
that no two spellings of one request verify.

Bounded memory: a frame is at most `max_frame_bytes` (the length prefix is checked
before anything is buffered); the nonce cache holds at most `max_entries`, each
forgotten 2 x skew after it was seen; when it is full of live entries new requests
are refused (fail closed) rather than forgetting a nonce that could then be replayed.
"""

from __future__ import annotations

import base64
import binascii
import copy
import secrets
import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from lxml import etree

from agentd._errors import AgentdError, Rejection
from agentd._schemas import NS_PRIV, schema
from agentd._xml import c14n, parse_untrusted

MAX_FRAME_BYTES = 1 << 20
DEFAULT_SKEW_S = 60.0
DEFAULT_MAX_NONCES = 65536
COMMAND_NAMES = frozenset({"status", "reload", "introspect", "journal", "shutdown",
                           "approvals", "approve", "deny", "end-thread", "memory",
                           "trace"})

_Q = f"{{{NS_PRIV}}}"
PRIVILEGED = _Q + "privileged"
RESPONSE = _Q + "privileged-response"
_HEADER = struct.Struct(">I")


class ErrorCode(StrEnum):
    BAD_SIGNATURE = "bad-signature"
    REPLAY = "replay"
    STALE = "stale"
    UNKNOWN_KEY = "unknown-key"
    UNKNOWN_COMMAND = "unknown-command"
    INVALID = "invalid"
    FAILED = "failed"


# The `kind`s the server reports as security events (audit sink, log, metric).
SECURITY_KINDS = frozenset({
    "bad-signature", "replay", "stale", "unknown-key", "invalid", "peer-refused",
    "nonce-cache-full", "repeated-refusals",
})

# Codes that mean "the daemon did not believe who you are or when you asked";
# agentctl exits 4 on them (docs/commands.md).
AUTH_CODES = frozenset({
    ErrorCode.BAD_SIGNATURE.value, ErrorCode.REPLAY.value, ErrorCode.STALE.value,
    ErrorCode.UNKNOWN_KEY.value,
})


class Refusal(AgentdError):
    """A request refused before its command ran.

    `message` goes to the client; `detail` only to the log. `kind` names the security
    event; `close` asks the transport to drop the connection after answering.
    `fields` carries what could be read of the request (claimed, not verified).
    """

    def __init__(self, code: ErrorCode, message: str, *, detail: str = "", kind: str = "",
                 close: bool = False, fields: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.detail = detail or message
        self.kind = kind or code.value
        self.close = close
        self.fields: dict[str, str] = dict(fields or {})


class FrameTooLarge(Refusal):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(ErrorCode.INVALID, f"frame of {size} bytes exceeds {limit} bytes",
                         kind="invalid", close=True)
        self.size = size


# --- framing -----------------------------------------------------------------------


def encode_frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Bytes in, complete frames out. The length prefix is checked before the body is
    buffered, so a hostile prefix costs nothing; the buffer never exceeds one frame
    plus one read."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buffer)

    def receive_data(self, data: bytes) -> list[bytes]:
        """Complete frames now available; raises `FrameTooLarge` on an oversize prefix."""
        self._buffer += data
        frames: list[bytes] = []
        while len(self._buffer) >= 4:
            (size,) = _HEADER.unpack_from(self._buffer)
            if size > self.max_frame_bytes:
                self._buffer.clear()
                raise FrameTooLarge(size, self.max_frame_bytes)
            if len(self._buffer) < 4 + size:
                break
            frames.append(bytes(self._buffer[4:4 + size]))
            del self._buffer[:4 + size]
        return frames


# --- nonce cache -------------------------------------------------------------------


class NonceCacheFull(Refusal):
    def __init__(self, limit: int) -> None:
        super().__init__(
            ErrorCode.FAILED,
            f"too many privileged commands within the replay window ({limit}); retry later",
            kind="nonce-cache-full",
        )


class NonceCache:
    """Nonces seen recently: each is remembered for `ttl_s` after it was seen.

    A request is accepted only when its issued-at is within ±skew of the clock, so a
    nonce seen at time t can be replayed successfully only until t + 2 x skew; the
    ttl is 2 x skew. Expiry is in arrival order (a deque), O(1) amortised.
    """

    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_NONCES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._order: deque[tuple[float, str]] = deque()

    def __len__(self) -> int:
        return len(self._expiry)

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._expiry

    def purge(self, now: float) -> None:
        order, expiry = self._order, self._expiry
        while order and order[0][0] <= now:
            at, nonce = order.popleft()
            if expiry.get(nonce) == at:
                del expiry[nonce]

    def add(self, nonce: str, now: float) -> bool:
        """Remember `nonce`; False when it was already seen within the window.
        Raises `NonceCacheFull` when it cannot be remembered."""
        self.purge(now)
        if nonce in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise NonceCacheFull(self.max_entries)
        at = now + self.ttl_s
        self._expiry[nonce] = at
        self._order.append((at, nonce))
        return True


# --- requests ----------------------------------------------------------------------


@dataclass(frozen=True)
class SignedCommand:
    """A request whose signature, time and nonce have been verified."""

    key_id: str
    nonce: str
    issued_at: datetime
    name: str
    args: Mapping[str, str] = field(default_factory=dict)


def format_time(when: datetime | float) -> str:
    if not isinstance(when, datetime):
        when = datetime.fromtimestamp(when, UTC)
    if when.tzinfo is None:
        raise ValueError("issued_at must be timezone-aware")
    when = when.astimezone(UTC)
    frac = f".{when.microsecond:06d}".rstrip("0") if when.microsecond else ""
    return when.strftime("%Y-%m-%dT%H:%M:%S") + frac + "Z"


def sign_request(private_key: Ed25519PrivateKey, key_id: str, command: str,
                 args: Mapping[str, str] | None = None, *,
                 issued_at: datetime | float | None = None, nonce: str | None = None) -> bytes:
    """A signed `<privileged>` request, ready to frame.

    The bytes on the wire are the exclusive C14N of the unsigned element with the
    `signature` appended, so the signed part is sent exactly as it was signed.
    """
    root = etree.Element(PRIVILEGED, nsmap={None: NS_PRIV})
    etree.SubElement(root, _Q + "key-id").text = key_id
    etree.SubElement(root, _Q + "nonce").text = secrets.token_hex(16) if nonce is None else nonce
    etree.SubElement(root, _Q + "issued-at").text = format_time(
        issued_at if issued_at is not None else datetime.now(UTC))
    cmd = etree.SubElement(root, _Q + "command", name=command)
    for name, value in (args or {}).items():
        etree.SubElement(cmd, _Q + "arg", name=name).text = value
    unsigned = c14n(root)
    signature = base64.b64encode(private_key.sign(unsigned)).decode()
    end = b"</privileged>"
    assert unsigned.endswith(end)
    return unsigned[:-len(end)] + f"<signature>{signature}</signature>".encode() + end


def signed_forms(root: etree._Element) -> list[bytes]:
    """The byte strings a signer may have signed (see the module docstring).
    Removes `signature` from `root` (the caller has read it)."""
    sig = root.find(_Q + "signature")
    if sig is None:
        return [c14n(root)]
    tail = sig.tail
    prev = sig.getprevious()
    root.remove(sig)  # the element's tail goes with it
    forms = [c14n(root)]
    if tail and tail.strip() == "":
        if prev is not None:
            prev.tail = (prev.tail or "") + tail
        else:
            root.text = (root.text or "") + tail
        forms.append(c14n(root))
    return forms


class Verifier:
    """Decides whether a request frame is a genuine, fresh, unreplayed command.

    `keys` may be replaced at any time (a reload of authorized_keys); the swap is a
    single attribute assignment.
    """

    def __init__(self, keys: Mapping[str, Ed25519PublicKey], *,
                 clock_skew_s: float = DEFAULT_SKEW_S, max_frame_bytes: int = MAX_FRAME_BYTES,
                 max_nonces: int = DEFAULT_MAX_NONCES) -> None:
        self.keys: Mapping[str, Ed25519PublicKey] = keys
        self.clock_skew_s = clock_skew_s
        self.max_frame_bytes = max_frame_bytes
        self.nonces = NonceCache(2 * clock_skew_s, max_nonces)
        self._schema = schema(NS_PRIV)

    def verify(self, frame: bytes, now: float) -> SignedCommand:
        if not frame:
            raise Refusal(ErrorCode.INVALID, "empty frame")
        try:
            root = parse_untrusted(frame, max_bytes=self.max_frame_bytes)
        except Rejection as rej:
            raise Refusal(ErrorCode.INVALID, "the request is not well-formed XML",
                          detail=rej.detail, close=True) from None
        if root.tag != PRIVILEGED:
            raise Refusal(ErrorCode.INVALID,
                          f"expected a <privileged> element in namespace {NS_PRIV}")
        if not self._schema.validate(root):
            err = self._schema.error_log.last_error
            where = f"line {err.line}: " if err is not None else ""
            msg = err.message if err is not None else "schema validation failed"
            raise Refusal(ErrorCode.INVALID, f"the request does not match privileged.xsd: "
                          f"{where}{msg}")
        # The schema fixes the order and presence of the children.
        key_el, nonce_el, time_el, cmd_el, sig_el = root
        key_id = key_el.text or ""
        nonce = nonce_el.text or ""
        name = cmd_el.get("name", "")
        fields = {"key_id": key_id, "command": name, "nonce": nonce}
        args: dict[str, str] = {}
        for arg in cmd_el:
            arg_name = arg.get("name", "")
            if arg_name in args:
                raise Refusal(ErrorCode.INVALID, f"argument {arg_name!r} given twice",
                              fields=fields)
            args[arg_name] = arg.text or ""
        key = self.keys.get(key_id)
        if key is None:
            raise Refusal(ErrorCode.UNKNOWN_KEY, f"key-id {key_id!r} is not authorized",
                          fields=fields)
        sig_text = sig_el.text or ""
        try:
            signature = base64.b64decode(sig_text, validate=True)
        except binascii.Error:
            signature = b""
        if len(signature) != 64 or base64.b64encode(signature).decode() != sig_text:
            raise Refusal(ErrorCode.BAD_SIGNATURE, "the signature does not verify",
                          detail="signature is not canonical base64 of 64 bytes",
                          fields=fields)
        for form in signed_forms(root):
            try:
                key.verify(signature, form)
                break
            except InvalidSignature:
                continue
        else:
            raise Refusal(ErrorCode.BAD_SIGNATURE, "the signature does not verify",
                          fields=fields)
        issued_text = time_el.text or ""
        try:
            issued = datetime.fromisoformat(issued_text.strip())
            if issued.tzinfo is None:
                raise ValueError("no timezone")
            issued_ts = issued.timestamp()
        except (ValueError, OverflowError) as exc:
            raise Refusal(ErrorCode.INVALID, f"issued-at {issued_text!r} is not a UTC or "
                          f"offset date-time ({exc})", fields=fields) from None
        delta = issued_ts - now
        if abs(delta) > self.clock_skew_s:
            where = "in the future" if delta > 0 else "old"
            raise Refusal(ErrorCode.STALE,
                          f"issued-at is {abs(delta):.0f} s {where} by the daemon's clock "
                          f"(allowed: ±{self.clock_skew_s:g} s)", fields=fields)
        try:
            fresh = self.nonces.add(nonce, now)
        except NonceCacheFull as full:
            full.fields.update(fields)
            raise
        if not fresh:
            raise Refusal(ErrorCode.REPLAY, "this nonce was already used", fields=fields)
        return SignedCommand(key_id, nonce, issued, name, args)


# --- responses ---------------------------------------------------------------------


def build_response(result: etree._Element | str | None = None, *,
                   error: tuple[str, str] | None = None) -> bytes:
    """`<privileged-response ok=…>` with `result` (an element appended inside
    `<result>`, or its text) or `error` = (code, message). Raises ValueError when the
    result cannot be carried by XML (e.g. a control character in the text)."""
    root = etree.Element(RESPONSE, nsmap={None: NS_PRIV})
    if error is not None:
        code, message = error
        root.set("ok", "false")
        etree.SubElement(root, _Q + "error", code=code).text = message
    else:
        root.set("ok", "true")
        res = etree.SubElement(root, _Q + "result")
        if isinstance(result, str):
            res.text = result
        elif result is not None:
            # A copy: appending would move the element out of the caller's tree.
            res.append(copy.deepcopy(result))
            res[-1].tail = None
    return etree.tostring(root, encoding="utf-8")


def error_response(code: ErrorCode | str, message: str) -> bytes:
    return build_response(error=(code.value if isinstance(code, ErrorCode) else code, message))


@dataclass(frozen=True)
class Response:
    ok: bool
    result: etree._Element | None = None  # the <result> element
    error_code: str = ""
    error_message: str = ""


class BadResponse(AgentdError):
    """The daemon's answer is not a valid privileged-response."""


def parse_response(data: bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> Response:
    try:
        root = parse_untrusted(data, max_bytes=max_bytes)
    except Rejection as rej:
        raise BadResponse(f"the daemon's answer is not well-formed XML: {rej.detail}") from None
    if root.tag != RESPONSE:
        raise BadResponse(f"the daemon's answer is {root.tag}, not a privileged-response")
    sch = schema(NS_PRIV)
    if not sch.validate(root):
        raise BadResponse(f"the daemon's answer does not match privileged.xsd: "
                          f"{sch.error_log.last_error}")
    child = root[0]
    ok = root.get("ok") in ("true", "1")
    if ok != (child.tag == _Q + "result"):
        raise BadResponse(f"the daemon's answer has ok={root.get('ok')} with <{child.tag}>")
    if ok:
        return Response(True, result=child)
    return Response(False, error_code=child.get("code", ""), error_message=child.text or "")
