"""The byte protocol between the daemon and a handler worker: pure encode/decode.

A frame is a 4-byte big-endian length N (N <= `MAX_FRAME`), then N bytes: one
kind byte, a 4-byte big-endian header length H, H bytes of a JSON object, and the
rest is opaque bytes (a payload's XML).

    daemon -> worker   INIT    {"sys_path", "listener", "handler", "payload_classes",
                                "agent"?, "state_max"}
                       CALL    {"thread_id", "from_id", "own_name", "redelivered", "key",
                                "state"?, "meta_state"?} + payload XML
                       REPLY   {"error"?, ...} + bytes   (to an ASK)
    worker -> daemon   READY   {"pid"}
                       ANSWER  {"kind", "to", "targets", "code", "message", "retry",
                                "state"?, "calls"?, "meta_state"?} + payload XML
                       FAILED  {"error"}  (the handler raised; the error's class name only)
                       ASK     {"op", ...} + bytes  (an agent's request to the platform,
                               for the call it is running; see `_agent.py`)

Invariants: only JSON objects of strings, numbers, booleans, null and lists cross,
never pickle; everything the worker sends is decoded by `decode_answer` or the
agent bridge, which check every field's type and bound and raise `ProtocolError`
otherwise.
The payload bytes it returns are handed to the pump as raw handler output, which
parses and validates them like any handler's output.

Handler state (`meta.state`): a CALL carries the listener's slice of the conversation
(`meta_state`, only when it has one), the ANSWER the handler's writes (`meta_state`:
key -> value, or null for a delete). The daemon applies the writes as it does an
in-process handler's, checked against `pump.max_state_bytes_per_thread` in the
transaction of the handler's output. (`state` is an isolated agent's task state,
`calls` the ids of the native calls its answer sends, with no payload.)
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from agentd._errors import HuhCode
from agentd._handler import HandlerMetadata, HandlerResponse, ResponseKind

MAX_FRAME = 16 * 1024 * 1024
MAX_HEADER = 1024 * 1024  # a handler's state slice crosses in it (64 KiB by default)
MAX_TARGETS = 256
MAX_NAME = 256
MAX_MESSAGE = 1024

INIT, CALL, READY, ANSWER, FAILED = b"I", b"C", b"R", b"A", b"F"
ASK, REPLY = b"Q", b"P"
KINDS = frozenset({INIT, CALL, READY, ANSWER, FAILED, ASK, REPLY})

_LEN = struct.Struct(">I")
_KINDS_BY_NAME = {k.value: k for k in ResponseKind}
_CODES = {c.value: c for c in HuhCode}


class ProtocolError(Exception):
    """A frame that breaks the protocol: the worker that sent it is not trusted again."""


def encode(kind: bytes, header: dict[str, Any], body: bytes = b"") -> bytes:
    """Raises `orjson.JSONEncodeError` (a TypeError) for a header that is not plain
    JSON: a string with a lone surrogate, an integer over 64 bits (a float NaN or
    infinity is written as null)."""
    head = orjson.dumps(header)
    if len(head) > MAX_HEADER:
        raise ProtocolError(f"header of {len(head)} bytes > {MAX_HEADER}")
    size = 1 + 4 + len(head) + len(body)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes > {MAX_FRAME}")
    return b"".join((_LEN.pack(size), kind, _LEN.pack(len(head)), head, body))


def frame_length(prefix: bytes) -> int:
    """The length announced by a frame's 4-byte prefix, checked against the bound."""
    (size,) = _LEN.unpack(prefix)
    if not 5 <= size <= MAX_FRAME:
        raise ProtocolError(f"frame length {size} out of bounds")
    return size


def decode(frame: bytes) -> tuple[bytes, dict[str, Any], bytes]:
    """A frame's content (without its length prefix) -> (kind, header, body)."""
    if len(frame) < 5:
        raise ProtocolError("short frame")
    kind = frame[:1]
    if kind not in KINDS:
        raise ProtocolError("unknown frame kind")
    (hlen,) = _LEN.unpack_from(frame, 1)
    if hlen > MAX_HEADER or 5 + hlen > len(frame):
        raise ProtocolError("bad header length")
    try:
        header = orjson.loads(frame[5 : 5 + hlen])
    except orjson.JSONDecodeError:  # also: not UTF-8, nested past 1024, NaN, Infinity
        raise ProtocolError("header is not JSON") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not an object")
    return kind, header, frame[5 + hlen :]


def opt_bool(header: dict[str, Any], key: str) -> bool:
    value = header.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"{key}: not a boolean")
    return value


def opt_str(header: dict[str, Any], key: str, limit: int) -> str | None:
    value = header.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{key}: not a string of at most {limit} characters")
    return value


def encode_call(meta: HandlerMetadata, key: str | None, payload_xml: bytes,
                extra: dict[str, Any] | None = None) -> bytes:
    """`key`: the payload's `{namespace}tag` (None: a core payload)."""
    return encode(CALL, {"thread_id": meta.thread_id, "from_id": meta.from_id,
                         "own_name": meta.own_name, "redelivered": meta.redelivered,
                         "key": key, **(extra or {})}, payload_xml)


def decode_call(header: dict[str, Any], book: Any = None) -> HandlerMetadata:
    """The worker's side: the daemon is trusted, so this only restores the value.
    `book`: what `meta.state` reads (the slice the call carried), scoped to the call's
    thread as the daemon scoped it to the conversation."""
    thread = str(header["thread_id"])
    return HandlerMetadata(thread, str(header["from_id"]), str(header["own_name"]),
                           bool(header["redelivered"]), _book=book, _conversation=thread)


def encode_answer(result: HandlerResponse | None, payload_xml: bytes,
                  extra: dict[str, Any] | None = None) -> bytes:
    if result is None:
        return encode(ANSWER, {"kind": None, **(extra or {})})
    return encode(ANSWER, {
        "kind": result.kind.value, "to": result.to, "targets": list(result.targets),
        "code": result.error_code.value if result.error_code is not None else None,
        "message": result.error_message, "retry": result.retry_allowed, **(extra or {}),
    }, payload_xml)


def state_slice(meta: HandlerMetadata) -> dict[str, str] | None:
    """The listener's `meta.state` slice for a CALL (None: it has none)."""
    book = meta._book
    if book is None:
        return None
    entries = book.slice(meta.own_name, meta._conversation or meta.thread_id)
    return dict(entries) if entries else None


def decode_state_writes(header: dict[str, Any]) -> dict[str, str | None] | None:
    """A worker's `meta.state` writes (key -> value, None for a delete), checked for
    shape only: their size is checked where they are applied, with the slice."""
    writes = header.get("meta_state")
    if writes is None:
        return None
    if not isinstance(writes, dict) or not all(
            isinstance(v, str) or v is None for v in writes.values()):
        raise ProtocolError("meta_state: not an object of strings and nulls")
    return writes


def decode_answer(header: dict[str, Any], body: bytes) -> HandlerResponse | None:
    """A worker's ANSWER -> what the handler returned (payload as raw XML bytes)."""
    kind_name = header.get("kind")
    if kind_name is None:
        if body:
            raise ProtocolError("payload without a response")
        return None
    kind = _KINDS_BY_NAME.get(kind_name) if isinstance(kind_name, str) else None
    if kind is None:
        raise ProtocolError("unknown response kind")
    to = opt_str(header, "to", MAX_NAME)
    targets = header.get("targets", [])
    if (not isinstance(targets, list) or len(targets) > MAX_TARGETS
            or not all(isinstance(t, str) and len(t) <= MAX_NAME for t in targets)):
        raise ProtocolError("targets: not a list of names")
    retry = header.get("retry")
    if retry is not None and not isinstance(retry, bool):
        raise ProtocolError("retry: not a boolean")
    if kind is ResponseKind.ERROR:
        code_name = opt_str(header, "code", MAX_NAME)
        code = _CODES.get(code_name) if code_name is not None else HuhCode.INTERNAL
        if code is None:
            raise ProtocolError("unknown huh code")
        message = header.get("message") or ""
        if not isinstance(message, str):
            raise ProtocolError("message: not a string")
        return HandlerResponse.error(code, message[:MAX_MESSAGE], retry_allowed=retry)
    return HandlerResponse(body, to=to, kind=kind, targets=tuple(targets))
