"""Calls a peer makes into this organism, checked at the link before the pump sees
them: pure functions over values.

A peer's `call` frame carries a call id it chose and an envelope. What is checked
here, on top of everything the pump checks for any client (hardened parse,
envelope and payload schemas, routing against the gateway's profile):

- `from` is the peer's organism name (the gateway's name): anything else is a
  forged sender and a security event;
- nothing in the privileged namespace, ever (a security event);
- a core (meta) question only when `meta.allow_remote` is set;
- `to` is required and names a listener the gateway exports: a call cannot reach
  a listener by payload key alone.

The call's thread here is `call_thread(peer, call_id)`: this organism's own UUID,
derived from the call id so that a call sent twice (the peer did not see our
`accepted` before a crash) lands on the same thread and is recognised as a
duplicate. The peer learns it from `accepted` and replies carry it.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from agentd._envelope import (
    Envelope,
    PrivilegedOnBus,
    adopt_envelope,
    build_envelope,
    parse_envelope,
)
from agentd._errors import AgentdError, HuhCode, Rejection
from agentd._schemas import NS_CORE, NS_PRIV
from agentd._xml import ShapeLimits, c14n

CALL_ID = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_HOPS_CARRIED = 1_000_000  # a hop count a peer may send (its own max_hops is its business)
_THREADS = uuid.UUID("5d1b7c0e-7f39-4d5e-9a51-1f0b8e0c2a44")  # namespace of call threads
_THREADS_BYTES = _THREADS.bytes
_sha1 = hashlib.sha1


class CallRefused(AgentdError):
    """A call refused at the link: `code` goes back to the peer (its generic text
    only); `event`, when set, is a security event with `detail` for the log."""

    def __init__(self, code: HuhCode, detail: str, event: str | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.event = event


@dataclass(frozen=True)
class AdmittedCall:
    call_id: str
    thread: str  # this organism's thread for the call
    envelope: bytes  # what the pump gets, from the gateway's client id
    # `envelope` as parsed: the peer's payload element, checked by the same parse
    # (limits, shape, privileged namespace, envelope schema) the pump would repeat.
    parsed: Envelope
    hops: int = 0  # the caller's chain so far (absent: 0); the pump goes on from it
    # The W3C traceparent of the caller's agentd.federation.call span ("" if absent or
    # not one): telemetry continues the caller's trace. Only ever read from a peer.
    traceparent: str = ""


def call_thread(peer: str, call_id: str) -> str:
    """`uuid.uuid5(_THREADS, f"{peer}\\n{call_id}")` as a string, computed directly:
    this runs twice per remote call, and the UUID object costs four times the hash."""
    digest = bytearray(_sha1(_THREADS_BYTES + f"{peer}\n{call_id}".encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def call_id_of(frame: dict[str, object]) -> str:
    call_id = frame.get("id")
    if not isinstance(call_id, str) or not CALL_ID.match(call_id):
        raise CallRefused(HuhCode.MALFORMED, "call without a valid id")
    return call_id


def admit_call(
    frame: dict[str, object],
    peer: str,
    export: Collection[str],
    allow_meta: bool,
    max_bytes: int,
    shape: ShapeLimits | None = None,
) -> AdmittedCall:
    call_id = call_id_of(frame)
    hops = frame.get("hops", 0)
    if type(hops) is not int or not 0 <= hops <= MAX_HOPS_CARRIED:
        raise CallRefused(HuhCode.MALFORMED, "call with a bad hop count")
    text = frame.get("envelope")
    if not isinstance(text, str):
        raise CallRefused(HuhCode.MALFORMED, "call without an envelope")
    data = text.encode("utf-8")
    try:
        env = parse_envelope(data, max_bytes=max_bytes, shape=shape)
    except PrivilegedOnBus:
        raise CallRefused(HuhCode.UNROUTABLE, "privileged namespace from a peer",
                          "priv-from-peer") from None
    except Rejection as exc:
        raise CallRefused(exc.code, f"envelope refused: {exc}") from None
    if env.sender != peer:
        raise CallRefused(HuhCode.INVALID_ENVELOPE,
                          f"from {env.sender!r} on the link of {peer!r}", "forged-from")
    namespace = env.key[1:].partition("}")[0]
    if namespace == NS_PRIV:
        raise CallRefused(HuhCode.UNROUTABLE, "privileged payload from a peer", "priv-from-peer")
    if namespace == NS_CORE:
        if not allow_meta:
            raise CallRefused(HuhCode.UNROUTABLE, "meta request from a peer (meta.allow_remote)")
    elif env.to is None or env.to not in export:
        raise CallRefused(HuhCode.UNROUTABLE, f"listener {env.to!r} is not exported",
                          "not-exported")
    thread = call_thread(peer, call_id)
    rebuilt = build_envelope(peer, thread, c14n(env.payload), env.to)
    # The re-addressed bytes are held to the pump's limits (C14N may move namespace
    # declarations down to the elements that use them), keeping the parsed element.
    try:
        parsed = adopt_envelope(rebuilt, env.payload, peer, env.to, thread,
                                max_bytes=max_bytes, shape=shape)
    except Rejection as exc:
        raise CallRefused(exc.code, f"envelope refused: {exc}") from None
    traceparent = frame.get("traceparent", "")
    if not isinstance(traceparent, str) or not TRACEPARENT.fullmatch(traceparent):
        traceparent = ""  # telemetry only: a bad one is ignored, never refused
    return AdmittedCall(call_id, thread, rebuilt, parsed, hops, traceparent)
