"""What a handler's return value turns into: a `ResponsePlan`, decided without I/O.

`plan_response` and `plan_failure` take the handled message, the frame the handler
ran in and its outcome, and return what the pump must do: envelopes to re-enter
(each then passes admission like client input), one core notice (`ack` or `huh`)
for a frame's holder, and the event that ends the handler's frame. The pump
applies a plan in that order; the frame ends only if every envelope was taken (a
refused answer leaves the call open so an LLM agent can correct itself).

Invariants: handlers never emit core payloads (an agent's `answer` aside); a
handler's `from` is its own name and its thread the one the pump chose; an ended
frame is never ended again (the plan carries no event for it).
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

from lxml import etree

from agentd._core import Ack, Answer, CorePayload, Huh
from agentd._envelope import build_envelope
from agentd._errors import HuhCode, Rejection
from agentd._handler import HandlerResponse, ResponseKind
from agentd._routing import Listener
from agentd._threads import Frame, ThreadEvent, ThreadState
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import is_xmlified, spec_of
from agentd.pump.message import Message, MsgKind

log = logging.getLogger("agentd.pump")

_XML_DECL = re.compile(rb"^\s*<\?xml[^>]*\?>")
_ACTIVE = ThreadState.ACTIVE


# The payload element each of a plan's envelopes was built from, and its `to`.
Adopted = list[tuple[etree._Element, str | None]]


class ResponsePlan(NamedTuple):
    """`envelopes` re-enter on `thread` (as answers to its holder if `respond`);
    `notice` (core payload bytes) goes to the holder of `notice_to`, counted as a
    rejection with `rejected` when set; `end` ends the handler's frame. The
    envelopes' payloads are always a serializer's (agentd's for objects, C14N for
    elements parsed out of raw output), so they re-enter through
    `parse_built_envelope`; or, when `adopted` holds the element and `to` each was
    built from (raw output that parsed without repair), `adopt_envelope`. `refs`:
    the handler's reference of the call each envelope starts (`addressed`), or ()."""

    envelopes: list[bytes] | tuple[()]
    thread: Frame | None
    respond: bool
    notice_to: Frame | None
    notice: bytes
    rejected: HuhCode | None
    end: ThreadEvent | None
    adopted: Adopted | None = None
    refs: tuple[str, ...] = ()


class Bodies(NamedTuple):
    """A handler's payloads as C14N bytes; `elements`, when not None, the strictly
    parsed element each of them is the C14N of (raw output only)."""

    bodies: list[bytes]
    elements: list[etree._Element] | None


def _notice(to: Frame | None, payload: bytes, rejected: HuhCode | None,
            end: ThreadEvent | None) -> ResponsePlan:
    return ResponsePlan((), None, False, to, payload, rejected, end)


def _huh(to: Frame, code: HuhCode, end: ThreadEvent | None = None) -> ResponsePlan:
    return ResponsePlan((), None, False, to, Huh.of(code).to_bytes(), code, end)


def plan_failure(msg: Message, frame: Frame, code: HuhCode) -> ResponsePlan:
    """The handler raised, timed out or returned garbage while running in `frame`."""
    end = ThreadEvent.FAILED if frame.state is _ACTIVE else None
    if msg.kind is MsgKind.REQUEST:
        return _huh(msg.frame, code, end)
    if frame.parent is not None:
        # The holder failed while taking a response (a core one too: a huh for its
        # refused call, an ack, a sub-agent's answer): its caller learns of it, and
        # the frame ends. Otherwise the caller waited until idle collection.
        return _huh(frame.parent, code, end)
    return _notice(None, b"", None, None)


def plan_stopped(frame: Frame) -> ResponsePlan:
    """The chain was stopped (its client told): the handler's frame ends, and nobody
    else is answered."""
    return _notice(None, b"", None, ThreadEvent.FAILED if frame.state is _ACTIVE else None)


def plan_response(
    msg: Message, listener: Listener, frame: Frame, result: object, max_fanout: int
) -> ResponsePlan:
    """`listener` returned `result` for `msg`, running in `frame` (its own new frame
    for a request, else the frame the message was delivered on)."""
    active = frame.state is _ACTIVE
    if result is None:
        if msg.kind is MsgKind.REQUEST:
            # Acknowledged; the call ends unless it has calls of its own open.
            end = ThreadEvent.ANSWERED if active and not frame.children else None
            return _notice(msg.frame, Ack(msg.frame.uuid).to_bytes(), None, end)
        return _notice(None, b"", None, None)
    if not isinstance(result, HandlerResponse):
        log.error("handler returned %s, not HandlerResponse listener=%s",
                  type(result).__name__, listener.name)
        return plan_failure(msg, frame, HuhCode.INTERNAL)
    kind = result.kind
    if kind is ResponseKind.ERROR:
        code = result.error_code or HuhCode.INTERNAL
        text = (result.error_message or "")[:1024] or None
        parent = frame.parent
        huh = Huh.of(code, text, result.retry_allowed) if parent is not None else None
        return _notice(parent, huh.to_bytes() if huh is not None else b"",
                       None, ThreadEvent.FAILED if active else None)
    try:
        bodies, elements = serialise_all(result.payload, max_fanout,
                                         listener.answers_text and kind is ResponseKind.RESPOND)
    except Rejection as rej:
        log.warning("bad handler output listener=%s detail=%s", listener.name, rej.detail)
        return _huh(frame, rej.code)
    name = listener.name
    if kind is ResponseKind.RESPOND:
        caller = frame.parent
        assert caller is not None  # a listener never holds a root frame
        uuid, holder = caller.uuid, caller.holder
        for i, body in enumerate(bodies):
            bodies[i] = build_envelope(name, uuid, body, to=holder)
        adopted: Adopted | None = (
            None if elements is None else [(el, holder) for el in elements])
        return ResponsePlan(bodies, caller, True, None, b"",
                            None, ThreadEvent.ANSWERED if active else None, adopted)
    uuid = frame.uuid
    if kind is not ResponseKind.BROADCAST:
        refs = result.refs
        if result.targets:  # `addressed`: one `to` per payload
            if len(result.targets) != len(bodies) or (refs and (
                    len(refs) != len(bodies) or not all(_ref_ok(r) for r in refs))):
                log.warning("bad handler output listener=%s detail=%d payloads for %d "
                            "addressees and %d refs", listener.name, len(bodies),
                            len(result.targets), len(refs))
                return _huh(frame, HuhCode.INVALID_PAYLOAD)
            tos: list[str | None] = [t or None for t in result.targets]
        else:
            tos = [result.to] * len(bodies)
        envelopes = [build_envelope(name, uuid, body, to=to) for body, to in zip(
            bodies, tos, strict=True)]
        adopted = None if elements is None else list(zip(elements, tos, strict=True))
        return ResponsePlan(envelopes, frame, False, None, b"", None, None, adopted,
                            refs if result.targets else ())
    # A broadcast sends each payload to several listeners: each message gets a tree
    # of its own, parsed from its bytes (messages never share an element).
    targets = list(dict.fromkeys(result.targets))  # a target named twice gets one copy
    if len(targets) * len(bodies) > max_fanout:  # max_fanout bounds messages, not payloads
        log.warning("bad handler output listener=%s detail=%d targets x %d payloads > "
                    "max_fanout %d", listener.name, len(targets), len(bodies), max_fanout)
        return _huh(frame, HuhCode.TOO_LARGE)
    envelopes = [build_envelope(name, uuid, body, to=to) for to in targets for body in bodies]
    return ResponsePlan(envelopes, frame, False, None, b"", None, None)


# A call's ref ("": none): it is journaled in the kind of each message about the call.
_REF = re.compile(r"[A-Za-z0-9._:-]{0,64}")


def _ref_ok(ref: object) -> bool:
    return isinstance(ref, str) and _REF.fullmatch(ref) is not None


def serialise_all(payload: object, max_fanout: int, allow_answer: bool = False) -> Bodies:
    """Handler payload(s) -> C14N payload bytes. Raw bytes are untrusted XML holding
    one or more payload elements: they are parsed (with repair if they are not
    well-formed: handler and LLM output only) and split, one envelope each; the
    elements of a strict parse come back with their bytes."""
    elements: list[etree._Element] | None = None
    if isinstance(payload, bytes | bytearray | str):
        raw = payload.encode() if isinstance(payload, str) else bytes(payload)
        wrapped = b"<agentd-output>" + _XML_DECL.sub(b"", raw, count=1) + b"</agentd-output>"
        try:
            wrapper = parse_untrusted(wrapped)
            strict = True
        except Rejection:
            wrapper = parse_untrusted(wrapped, repair=True)
            strict = False
        found = [el for el in wrapper if isinstance(el.tag, str)]
        bodies = [c14n(el) for el in found]
        if strict:
            elements = found
    elif isinstance(payload, list | tuple):
        bodies = [_one(p, allow_answer) for p in payload]
    else:
        bodies = [_one(payload, allow_answer)]
    if not bodies:
        raise Rejection(HuhCode.INVALID_PAYLOAD, "no payload element in handler output")
    if len(bodies) > max_fanout:
        raise Rejection(HuhCode.TOO_LARGE, f"{len(bodies)} payloads > max_fanout {max_fanout}")
    return Bodies(bodies, elements)


def _one(obj: object, allow_answer: bool) -> bytes:
    if allow_answer and isinstance(obj, Answer):
        return obj.to_bytes()
    if isinstance(obj, CorePayload):
        raise Rejection(HuhCode.INVALID_PAYLOAD, "handlers may not emit core payloads")
    if not is_xmlified(obj):
        raise Rejection(HuhCode.INVALID_PAYLOAD, f"{type(obj).__name__} is not an @xmlify class")
    try:
        return spec_of(obj).to_bytes(obj)
    except (ValueError, TypeError) as exc:
        raise Rejection(HuhCode.INVALID_PAYLOAD, f"cannot serialise: {exc}") from None
