"""Admission: may this envelope enter, where does it go, and under which schema.

Pure decisions over values: an envelope already parsed by the hardened parser, the
frame it names (or None), the profile in force. Each function returns the admitted
`Message` or raises `Rejection` carrying the `huh` code; a refusal that is also a
security event raises `Violation`, whose `event` the pump reports. Nothing here
touches the registry, the kernel, the clock or a queue: the pump applies the result.

Invariants:
- Client input and handler output pass the same checks (`route_request`,
  `to_holder`): nothing a handler returns is trusted for identity, thread or route.
- The route is resolved against the pinned table of the message's thread; a
  missing route and an out-of-profile route are indistinguishable.
- A new conversation's frame exists only in the returned message until the pump
  registers it, so a refused first envelope leaves nothing behind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lxml import etree

from agentd import _meta as meta
from agentd._envelope import Envelope, build_envelope, parse_envelope
from agentd._errors import GENERIC_MESSAGES, HuhCode, Rejection
from agentd._routing import Listener, Profile
from agentd._schemas import NS_CORE, schema
from agentd._threads import Frame, ThreadState
from agentd._xmlify import XmlSpec
from agentd.config import MetaConfig
from agentd.durable import DECISIONS, Decision, decision_from
from agentd.pump.message import CORE, Message, MsgKind

_CORE_SCHEMA = schema(NS_CORE)
_ANSWER = "{" + NS_CORE + "}answer"
INTENT = "{" + NS_CORE + "}intent"


class Violation(Rejection):
    """A refusal that is also a security event (`event`, with log `fields`)."""

    def __init__(self, code: HuhCode, detail: str, event: str, fields: Mapping[str, str]) -> None:
        super().__init__(code, detail)
        self.event = event
        self.fields = fields


def admit_client(
    client: str,
    env: Envelope,
    data: bytes,
    frame: Frame | None,
    profiles: Mapping[str, Profile],
    clients: Mapping[str, str],
    meta_flags: MetaConfig,
    max_bytes: int,
) -> Message | Decision:
    """A client's envelope on the thread `frame` (None: a new conversation, under
    the profile `clients` names for the client). The message's frame is new iff
    `frame` is None. A core `approve`/`deny` is returned as a `Decision`."""
    if env.sender != client:
        raise Violation(HuhCode.INVALID_ENVELOPE, "from does not match the client",
                        "forged-from", {"client": client, "claimed": env.sender})
    if frame is None:
        profile_name = clients.get(client)
        profile = profiles.get(profile_name) if profile_name is not None else None
        if profile is None:
            raise Rejection(HuhCode.UNROUTABLE, f"client {client} has no profile")
        frame = Frame(env.thread, (client,), None, client, profile)
    elif frame.owner != client or not frame.is_root:
        raise Rejection(HuhCode.UNROUTABLE, "thread not owned by this client")
    elif frame.state is not ThreadState.ACTIVE:
        raise Rejection(HuhCode.UNROUTABLE, "conversation has ended")
    key = env.key
    if key in meta.QUESTIONS:
        return meta_answer(env, client, frame, meta_flags, max_bytes)
    if key in DECISIONS:
        # A decision on a parked message: judged by the pump against what it parked.
        validate_core(env)
        return decision_from(env.payload, client, frame.uuid)
    return route_request(env, key, data, client, None, frame)


def route_request(
    env: Envelope, key: str, data: bytes, sender: str, sender_listener: Listener | None,
    frame: Frame,
) -> Message:
    """Route `env` (whose routing key is `key`) against `frame`'s table (and a
    listener sender's peers) and validate the payload against the routed schema."""
    table = frame.profile.table
    targets = table.resolve(key, env.to)
    if sender_listener is not None:
        allowed = tuple(t for t in targets if sender_listener.may_send_to(t.name))
        if len(allowed) != len(targets) and (env.to is not None or not allowed):
            raise Violation(HuhCode.UNROUTABLE, "destination is not a declared peer",
                            "peer-violation", {"listener": sender_listener.name})
        targets = allowed
    if len(targets) != 1 or targets[0].retired:
        targets = tuple(t for t in targets if not t.retired)
    if not targets:
        if key == INTENT:  # checked only here: no cost for routable messages
            return intent_message(env, data, sender, sender_listener, frame)
        raise Rejection(HuhCode.UNROUTABLE, f"no route for {key}")
    spec = table.specs[key]
    validate(spec, env)
    return Message(MsgKind.REQUEST, sender, frame, env.payload, targets, spec, data)


def intent_message(
    env: Envelope, data: bytes, sender: str, sender_listener: Listener | None, frame: Frame
) -> Message:
    """Core `intent`: accepted from an LLM agent, or from a client whose profile
    allows intents; the pump's intent resolver then picks and fills a payload. A
    sender that may not send intents is told what any unroutable key tells it."""
    allowed = (
        sender_listener.is_agent if sender_listener is not None else frame.profile.allow_intents
    )
    if not allowed or env.to is not None:
        raise Rejection(HuhCode.UNROUTABLE, f"no route for {env.key}")
    validate_core(env)
    return Message(MsgKind.INTENT, sender, frame, env.payload, (), None, data)


def to_holder(
    env: Envelope, data: bytes, sender: str, frame: Frame, spec: XmlSpec | None
) -> Message:
    """A message for the holder of `frame` (a response, ack or huh); `spec` None
    means a core payload. A client holder gets no targets (it is delivered, not run)."""
    if spec is None:
        validate_core(env)
    else:
        validate(spec, env)
    targets: tuple[Listener, ...] = ()
    if not frame.is_root:
        holder = frame.profile.table.listeners.get(frame.holder)
        if holder is None or holder.retired:
            raise Rejection(HuhCode.UNROUTABLE, "caller no longer routable")
        targets = (holder,)
    return Message(MsgKind.TO_HOLDER, sender, frame, env.payload, targets, spec, data)


def meta_answer(
    env: Envelope, client: str, frame: Frame, flags: MetaConfig, max_bytes: int
) -> Message:
    """A client's meta question, answered by the pump itself from the profile of
    its thread. The answer is built as bytes and re-parsed like any output."""
    validate_core(env)
    body = meta.answer(flags, frame.profile, env.payload)
    data = build_envelope(CORE, frame.uuid, body, to=client)
    reply = parse_envelope(data, max_bytes=max(len(data), max_bytes))
    return Message(MsgKind.TO_HOLDER, CORE, frame, reply.payload, (), None, data)


def response_spec(listener: Listener, env: Envelope) -> XmlSpec | None:
    """The schema `listener` may answer `env`'s payload with: one of its declared
    response classes, or None for core `answer`, which an LLM agent may always give
    (its final text), as may a peer organism's agent called here. Anything else is
    refused."""
    spec = listener.response_specs.get(env.key)
    if spec is None and not (listener.answers_text and env.key == _ANSWER):
        raise Rejection(HuhCode.INVALID_PAYLOAD, "not a declared response class")
    return spec


def validate(spec: XmlSpec, env: Envelope) -> None:
    _validate(spec.schema, env)


def validate_core(env: Envelope) -> None:
    _validate(_CORE_SCHEMA, env)


def _validate(schema: etree.XMLSchema, env: Envelope) -> None:
    # No payload schema declares an attribute, and libxml2 reports one error per
    # undeclared attribute (tens of milliseconds for a frame of them): refuse them
    # before the validator sees them, so a rejection costs one error at most.
    if env.payload_has_attributes():
        raise Rejection(HuhCode.INVALID_PAYLOAD, "attributes are not allowed in a payload",
                        f"{_SCHEMA_TEXT}: attributes are not allowed in a payload.")
    if not schema.validate(env.payload):
        error = schema.error_log.last_error
        raise Rejection(HuhCode.INVALID_PAYLOAD, str(error), public_schema_error(error.message))


_SCHEMA_TEXT = GENERIC_MESSAGES[HuhCode.INVALID_PAYLOAD].rstrip(".")
_CLARK = re.compile(r"'?\{[^}]*\}([^\s',)]+)'?")
_PUBLIC_MAX = 300


def public_schema_error(message: str) -> str:
    """What the sender is told of a schema error in its own payload: the element of
    its input that failed and why, as libxml2 says it, with names as local tags.
    What the schema expected instead (`Expected is ...`) is left out: the sender
    sees its own input, not the listener's contract (meta and agentctl give that)."""
    text = message.split(" Expected is ", 1)[0].removeprefix("Element ")
    text = _CLARK.sub(lambda m: f"<{m.group(1)}>", text).strip()
    if len(text) > _PUBLIC_MAX:
        text = text[: _PUBLIC_MAX - 3] + "..."
    return f"{_SCHEMA_TEXT}: {text}"
