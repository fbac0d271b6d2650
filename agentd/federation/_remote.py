"""Calling a peer's listeners: offers, pins, remote listeners and their calls.

A gateway's `import:` names listeners of the peer. Each becomes a local listener
`GATEWAY:LISTENER` whose handler is a `RemoteCall`: the message to it is committed
in this organism's journal like any other (so it survives `kill -9` and is
redelivered), and the handler carries it across the link and waits for the answer.

- **Offers and pins.** At every link-up the caller asks for the schemas of what it
  imports; the callee answers with an `Offer` per exported listener (its payload
  and response XSDs and its description). The first offer of a listener is pinned
  (`federation-pins.json` in the state directory, by SHA-256) and the routing is
  reloaded to use it; an offer that differs from its pin blocks calls to that
  listener until an operator's reload accepts it.
- **Local classes.** A remote listener's payload and response classes are made from
  the pinned XSDs (the shapes `@xmlify` emits), or are the local class with the same
  root when its XSD is the same text. The pinned XSDs themselves check what
  crosses: the payload before it leaves, the reply when it arrives.
- **Exactly one run, at least one delivery.** The call id is the caller's
  conversation and the message's journal seq, so a redelivered message sends the
  same id and the callee recognises it. A reply is acknowledged only once the
  handler's output (the reply, now a local message) is committed here; a reply
  nobody waits for is held for `HOLD_S` (a redelivered call may still come for it),
  then acknowledged and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lxml import etree

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._handler import ChainStopped, HandlerMetadata, HandlerResponse
from agentd._schemas import NS_CORE
from agentd._xml import c14n
from agentd._xmlify import spec_of, xsd_of
from agentd.federation._calls import call_thread
from agentd.federation._frames import FrameTooLarge
from agentd.telemetry import tracer

if TYPE_CHECKING:
    from agentd.config import ListenerConfig, OrganismConfig
    from agentd.config.sections import GatewayConfig

log = logging.getLogger("agentd.federation")

PINS_FILE = "federation-pins.json"
HOLD_S = 120.0  # how long a reply nobody waits for is kept before it is acknowledged
MAX_HELD = 1024  # replies held per gateway; beyond, the oldest is acknowledged
MAX_XSD_CHARS = 65536
MAX_OFFERS = 256
_OWN_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)
_HUH = "{" + NS_CORE + "}huh"
_REFERRING = frozenset("{http://www.w3.org/2001/XMLSchema}" + name
                       for name in ("include", "import", "redefine", "override"))
_ANSWER = "{" + NS_CORE + "}answer"


def core_schema() -> etree.XMLSchema:
    from agentd._schemas import schema

    return schema(NS_CORE)


class OfferError(ValueError):
    """An offer frame or a pin file entry that is not a valid offer."""


@dataclass(frozen=True)
class Offer:
    """One exported listener as its organism describes it to a peer."""

    name: str
    description: str
    payloads: tuple[str, ...]  # XSD texts
    responses: tuple[str, ...]
    answers: bool = False  # an agent: its final answer is core `answer` text

    @property
    def digest(self) -> str:
        text = json.dumps([self.name, self.description, self.payloads, self.responses,
                           self.answers], separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "payloads": list(self.payloads), "responses": list(self.responses),
                "answers": self.answers}

    @classmethod
    def from_json(cls, data: Any) -> Offer:
        if not isinstance(data, dict):
            raise OfferError("an offer is not an object")
        name, description = data.get("name"), data.get("description")
        payloads, responses = data.get("payloads"), data.get("responses")
        answers = data.get("answers", False)
        if not isinstance(name, str) or not isinstance(description, str):
            raise OfferError("an offer needs a name and a description")
        if not isinstance(answers, bool):
            raise OfferError(f"offer {name[:64]!r}: `answers` is not a boolean")
        for xsds, least in ((payloads, 1), (responses, 0 if answers else 1)):
            if (not isinstance(xsds, list) or not least <= len(xsds) <= 8
                    or not all(isinstance(x, str) and len(x) <= MAX_XSD_CHARS for x in xsds)):
                raise OfferError(f"offer {name[:64]!r}: payloads and responses must be "
                                 "up to 8 XSD texts (a payload, and a response or `answers`)")
        return cls(name, description[:4096], tuple(payloads), tuple(responses), answers)  # type: ignore[arg-type]


def offer_of(cfg: ListenerConfig) -> Offer:
    return Offer(cfg.name, cfg.description, tuple(xsd_of(c) for c in cfg.payload_classes),
                 tuple(xsd_of(c) for c in cfg.response_classes), cfg.agent is not None)


# ---- pins ----------------------------------------------------------------------------


def load_pins(state_dir: Path) -> dict[str, dict[str, Offer]]:
    """The pinned offers by gateway and listener; empty if none were pinned yet."""
    path = state_dir / PINS_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise OfferError(f"{path}: unreadable ({exc})") from None
    if not isinstance(doc, dict):
        raise OfferError(f"{path}: not an object")
    return {gw: {name: Offer.from_json(offer) for name, offer in listeners.items()}
            for gw, listeners in doc.items() if isinstance(listeners, dict)}


def save_pins(state_dir: Path, pins: Mapping[str, Mapping[str, Offer]]) -> None:
    """Written whole, to a new file renamed over the old one (never half a file)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / PINS_FILE
    tmp = path.with_suffix(".tmp")
    doc = {gw: {n: o.to_json() for n, o in sorted(ls.items())} for gw, ls in sorted(pins.items())}
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Weighed:
    """What one offer frame means for one gateway's imports (see `weigh_offers`)."""

    states: dict[str, str]  # import name -> pinned | not-offered | changed | mismatch
    new: dict[str, Offer]  # first offers, or the declared one: to pin now
    changed: dict[str, Offer]  # offers that differ from their pin: for a reload
    bad: list[str]  # why an offered item was refused
    mismatched: dict[str, Offer] = field(default_factory=dict)  # not the declared digest


def weigh_offers(imports: Iterable[str], items: list[Any], pins: Mapping[str, Offer],
                 local: Mapping[tuple[str, str], type],
                 declared: Mapping[str, str] | None = None) -> Weighed:
    """The peer's answer to our schema request, against our pins. An offer we cannot
    use (malformed, or shadowing one of our own payload roots with another XSD) is
    refused before it could be pinned. An import with a digest declared in the
    configuration (`schema_pins`) takes exactly that offer, at once, and never
    another: no trust on first use, no reload to accept. Pure: the caller pins,
    audits and saves."""
    declared = declared or {}
    offers: dict[str, Offer] = {}
    wanted = set(imports)
    out = Weighed({}, {}, {}, [])
    for item in items[:MAX_OFFERS]:
        try:
            one = Offer.from_json(item)
            if one.name in wanted:
                for xsd in (*one.payloads, *one.responses):
                    class_of_xsd(xsd, local)
                offers[one.name] = one
        except OfferError as exc:
            out.bad.append(str(exc)[:300])
    for name in imports:
        offer, pinned = offers.get(name), pins.get(name)
        if offer is None:
            out.states[name] = "not-offered"
        elif name in declared and offer.digest != declared[name]:
            out.states[name], out.mismatched[name] = "mismatch", offer
        elif name in declared:
            out.states[name] = "pinned"
            if pinned is None or pinned.digest != offer.digest:
                out.new[name] = offer
        elif pinned is not None and pinned.digest != offer.digest:
            out.states[name], out.changed[name] = "changed", offer
        else:
            out.states[name] = "pinned"
            if pinned is None:
                out.new[name] = offer
    return out


# ---- remote listeners, from the pins --------------------------------------------------


def class_of_xsd(xsd: str, local: Mapping[tuple[str, str], type]) -> type:
    """A payload class for a pinned XSD: the local class with the same root when its
    XSD is this very text, else one made from the XSD's shape."""
    from agentd.mcp.schema import Unmappable, class_name, object_class
    from agentd.mcp.serve import input_schema, shape_of_xsd

    try:
        doc = etree.fromstring(xsd.encode(), _OWN_PARSER)
    except (ValueError, etree.XMLSyntaxError) as exc:
        raise OfferError(f"schema not understood: {exc}") from None
    # Compiling a schema loads what it includes or imports, from this host's files:
    # a peer's schema stands alone.
    if doc.getroottree().docinfo.doctype or any(
            el.tag in _REFERRING for el in doc.iter(tuple(_REFERRING))):
        raise OfferError("schema refers to other documents")
    try:
        shape = shape_of_xsd(xsd)
    except (ValueError, KeyError, etree.XMLSyntaxError) as exc:
        raise OfferError(f"schema not understood: {exc}") from None
    same = local.get((shape.namespace, shape.tag))
    if same is not None:
        if xsd_of(same) != xsd:
            raise OfferError(f"root {{{shape.namespace}}}{shape.tag} is also a local payload "
                             "with a different schema")
        return same
    schema = input_schema(shape)
    if shape.description:
        schema["description"] = shape.description
    try:
        return object_class(schema, "", shape.namespace, shape.tag, class_name(shape.tag),
                             depth=0)
    except Unmappable as exc:
        raise OfferError(f"schema not usable here: {exc}") from None


def classes_by_root(listeners: Iterable[ListenerConfig]) -> dict[tuple[str, str], type]:
    """The payload and response classes of this organism's own listeners, by root
    (a peer's `GATEWAY:LISTENER` ones left out)."""
    classes: dict[tuple[str, str], type] = {}
    for cfg in listeners:
        if ":" not in cfg.name:
            for cls in (*cfg.payload_classes, *cfg.response_classes):
                classes.setdefault(spec_of(cls).key, cls)
    return classes


def remote_listeners(
    organism: str,
    gateways: Iterable[GatewayConfig],
    state_dir: Path,
    local: Iterable[ListenerConfig],
    max_envelope_bytes: int,
) -> tuple[tuple[ListenerConfig, ...], list[str]]:
    """The `GATEWAY:LISTENER` listeners of the pinned imports, and a message per
    import that cannot be built (an unpinned one is simply absent: it is pinned at
    the first link-up)."""
    from agentd.config import ListenerConfig
    from agentd.config.organism import spotlit

    imports = [g for g in gateways if g.import_]
    if not imports:
        return (), []
    try:
        pins = load_pins(state_dir)
    except OfferError as exc:
        return (), [str(exc)]
    classes = classes_by_root(local)
    built: list[ListenerConfig] = []
    issues: list[str] = []
    for gateway in imports:
        for name in gateway.import_:
            offer = pins.get(gateway.name, {}).get(name)
            declared = gateway.schema_pins.get(name)
            if offer is None or (declared is not None and offer.digest != declared):
                continue  # pinned (again) when the peer offers the declared schema
            full = f"{gateway.name}:{name}"
            try:
                payloads = tuple(class_of_xsd(x, classes) for x in offer.payloads)
                responses = tuple(class_of_xsd(x, classes) for x in offer.responses)
            except OfferError as exc:
                issues.append(f"gateways: {gateway.name}: import {name}: {exc}")
                continue
            for cls in (*payloads, *responses):
                classes.setdefault(spec_of(cls).key, cls)
            built.append(ListenerConfig(
                name=full,
                payload_classes=payloads,
                response_classes=responses,
                handler=RemoteCall(organism, gateway.name, name, offer, max_envelope_bytes),
                # The peer wrote the description: an agent reads it marked as such.
                description=spotlit(f"Listener {name} of the peer organism {gateway.name}.",
                                    " ".join(offer.description.split())),
                timeout_s=gateway.call_timeout_s,
                handler_ref=f"federation:{gateway.name}:{name}:{offer.digest}",
                answers_text=offer.answers,
            ))
    return tuple(built), issues


def with_remote_listeners(config: OrganismConfig) -> OrganismConfig:
    """`config` with the listeners its gateways import, as pinned in its state
    directory. Loading a configuration reads only the file; the daemon's wiring
    adds these (preflight, at start and at each reload). An import that cannot be
    built is the peer's doing: logged and left out, never a reason not to start."""
    if not config.gateways:
        return config
    remote, problems = remote_listeners(config.name, config.gateways, config.state_dir,
                                        config.listeners, config.bus.max_envelope_bytes)
    for problem in problems:
        log.warning("%s (the listener is left out)", problem)
    return dataclasses.replace(config, listeners=config.listeners + remote) if remote else config


# ---- calls in flight, per gateway ----------------------------------------------------


class CallRefusedByPeer(Exception):
    """The call failed with `code`: refused by the peer, or (`too-large`) not sendable
    to it at all."""

    def __init__(self, code: HuhCode) -> None:
        super().__init__(code.value)
        self.code = code


@dataclass
class _Pending:
    call_id: str
    thread: str
    envelope: str
    answer: asyncio.Future[tuple[int, str]]
    again: bool = False  # may have been sent before: the peer checks its journal
    accepted: bool = False
    hops: int = 0  # the caller's chain so far: the peer goes on counting from it
    traceparent: str = ""  # telemetry: the call's span, the parent of the peer's spans


@dataclass
class RemoteCalls:
    """The calls this organism has in flight to one gateway's peer. `send` puts a
    frame on the up link and says whether there was one."""

    gateway: str
    send: Callable[[dict[str, object]], bool]
    audit: Callable[[str, Mapping[str, str]], None]
    clock: Callable[[], float] = time.monotonic
    imports: dict[str, str] = field(default_factory=dict)  # remote name -> state
    _by_thread: dict[str, _Pending] = field(default_factory=dict)
    _by_id: dict[str, _Pending] = field(default_factory=dict)
    _held: dict[str, tuple[int, str, float]] = field(default_factory=dict)

    def adopt(self, send: Callable[[dict[str, object]], bool],
              audit: Callable[[str, Mapping[str, str]], None]) -> None:
        """A running federation sends this gateway's frames from now on."""
        self.send, self.audit = send, audit

    def release(self) -> None:
        self.send, self.audit = _unsent, _unaudited

    def blocked(self, name: str) -> bool:
        return self.imports.get(name, "pinned") != "pinned"

    async def call(self, call_id: str, thread: str, envelope: str,
                   again: bool = False, hops: int = 0, traceparent: str = ""
                   ) -> tuple[int, str]:
        """The peer's reply (its outbox id and envelope) to one call; raises
        `CallRefusedByPeer`. Sent now if the link is up, else at the next link-up.
        `again`: the call may have been sent before (a redelivered message)."""
        answer: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        pending = _Pending(call_id, thread, envelope, answer, again, hops=hops,
                           traceparent=traceparent)
        self._by_thread[thread], self._by_id[call_id] = pending, pending
        try:
            held = self._held.pop(thread, None)
            if held is not None and again:  # an answer to this call sent before a restart
                answer.set_result(held[:2])
            else:
                if held is not None:  # a reply to a call never sent: not an answer
                    log.warning("federation: a reply arrived before its call was sent; "
                                "dropped thread=%s", thread)
                    self.ack(held[0])
                self._send_call(pending)
            return await answer
        finally:
            self._by_thread.pop(thread, None)
            self._by_id.pop(call_id, None)

    def _send_call(self, pending: _Pending) -> None:
        frame: dict[str, object] = {"t": "call", "id": pending.call_id,
                                    "envelope": pending.envelope}
        if pending.again:
            frame["again"] = True
        if pending.hops:
            frame["hops"] = pending.hops
        if pending.traceparent:
            frame["traceparent"] = pending.traceparent
        try:
            if self.send(frame):
                pending.again = True  # any later send of it is a resend
        except FrameTooLarge:  # the peer would close the link on it, again and again
            if not pending.answer.done():
                pending.answer.set_exception(CallRefusedByPeer(HuhCode.TOO_LARGE))

    def link_up(self) -> None:
        """Calls not yet accepted go (again) on the new link; accepted ones are the
        peer's to answer from its outbox."""
        for pending in list(self._by_id.values()):
            if not pending.accepted:
                self._send_call(pending)

    def accepted(self, call_id: str, thread: str) -> None:
        pending = self._by_id.get(call_id)
        if pending is not None and pending.thread == thread:
            pending.accepted = True

    def refused(self, call_id: str, code: str) -> None:
        pending = self._by_id.get(call_id)
        if pending is None or pending.answer.done():
            return
        try:
            huh = HuhCode(code)
        except ValueError:
            huh = HuhCode.INTERNAL
        pending.answer.set_exception(CallRefusedByPeer(huh))

    def reply(self, reply_id: int, thread: str, envelope: str) -> None:
        pending = self._by_thread.get(thread)
        if pending is not None and not pending.answer.done():
            pending.answer.set_result((reply_id, envelope))
            return
        if pending is not None:  # a second reply to one call: only the first is used
            self.ack(reply_id)
            return
        if len(self._held) >= MAX_HELD:
            oldest = min(self._held, key=lambda t: self._held[t][2])
            self.ack(self._held.pop(oldest)[0])
        self._held[thread] = (reply_id, envelope, self.clock())

    def ack(self, reply_id: int) -> None:
        self.send({"t": "ack", "id": reply_id})

    def sweep(self) -> int:
        """Acknowledge and drop replies held longer than `HOLD_S`."""
        cutoff = self.clock() - HOLD_S
        stale = [t for t, (_, _, at) in self._held.items() if at < cutoff]
        for thread in stale:
            reply_id, _, _ = self._held.pop(thread)
            log.warning("federation gateway=%s: reply %d for no call in flight; "
                        "acknowledged and dropped", self.gateway, reply_id)
            self.ack(reply_id)
        return len(stale)

    @property
    def in_flight(self) -> int:
        return len(self._by_id)


# The calls in flight, by gateway. Remote listeners' handlers are built at
# configuration load, and redelivered messages may run before the federation is
# up: a call made then waits, and goes once the federation adopts its gateway
# (`calls_for(...).adopt`) and the link is up.
OUTGOING: dict[str, RemoteCalls] = {}


def _unsent(frame: dict[str, object]) -> bool:
    del frame
    return False


def _unaudited(kind: str, fields: Mapping[str, str]) -> None:
    log.warning("security kind=%s %s (no federation running)", kind, dict(fields))


def calls_for(gateway: str) -> RemoteCalls:
    calls = OUTGOING.get(gateway)
    if calls is None:
        calls = OUTGOING[gateway] = RemoteCalls(gateway, _unsent, _unaudited)
    return calls


class RemoteCall:
    """The handler of `GATEWAY:LISTENER`: the payload, checked against the pinned
    XSD, crosses as a call; the reply, checked against the pinned response XSDs,
    comes back as this listener's answer. It takes the payload element the pump
    validated (`takes_element`): what crosses is that element's C14N."""

    takes_element = True

    def __init__(self, organism: str, gateway: str, remote: str, offer: Offer,
                 max_bytes: int) -> None:
        self.organism = organism
        self.gateway = gateway
        self.remote = remote
        self.offer = offer
        self.max_bytes = max_bytes

    @cached_property
    def schemas(self) -> dict[str, etree.XMLSchema]:
        """The pinned schemas by root (clark name), payloads and responses; each XSD
        compiled once."""
        out: dict[str, etree.XMLSchema] = {}
        for xsd in (*self.offer.payloads, *self.offer.responses):
            doc = etree.fromstring(xsd.encode(), _OWN_PARSER)
            schema = etree.XMLSchema(doc)
            out.update(dict.fromkeys(_roots(doc), schema))
        return out

    @cached_property
    def _responses(self) -> frozenset[str]:
        """The roots of the pinned response XSDs (clark names)."""
        return frozenset(root for xsd in self.offer.responses
                         for root in _roots(etree.fromstring(xsd.encode(), _OWN_PARSER)))

    async def __call__(self, payload: etree._Element, meta: HandlerMetadata
                       ) -> HandlerResponse | ChainStopped:
        calls = calls_for(self.gateway)
        if calls.blocked(self.remote):
            log.warning("federation call to %s:%s refused: import is %s", self.gateway,
                        self.remote, calls.imports.get(self.remote))
            return HandlerResponse.error(HuhCode.UNROUTABLE)
        schema = self.schemas.get(payload.tag)
        if schema is None or not schema.validate(payload):
            return HandlerResponse.error(HuhCode.INVALID_PAYLOAD)
        data = c14n(payload)
        # Stable across a redelivery of this message; unique without a journal too.
        # Opaque: the peer learns neither the client's conversation UUID nor the journal
        # seq (and so cannot work out the next calls' threads to answer them early).
        call_id = (hashlib.sha256(f"{self.organism}\x1f{meta._conversation or meta.thread_id}"
                                  f"\x1f{meta._seq}".encode()).hexdigest()[:32]
                   if meta._seq else uuid.uuid4().hex)
        thread = call_thread(self.organism, call_id)
        envelope = build_envelope(self.organism, thread, data, to=self.remote)
        tracing = tracer()
        span = tracing.federation_call(self.gateway, self.remote) if tracing.enabled else None
        outcome = "timeout"  # unless answered or refused: the handler's time ran out
        try:
            reply_id, text = await calls.call(
                call_id, thread, envelope.decode(), again=meta.redelivered,
                hops=meta._hops + 1, traceparent="" if span is None else tracing.traceparent(span))
            outcome = "ok"
        except CallRefusedByPeer as exc:
            outcome = exc.code.value
            if exc.code is HuhCode.BUDGET_EXCEEDED:  # the peer's hop limit (its only one)
                return ChainStopped(exc.code)
            return HandlerResponse.error(exc.code)
        finally:
            if span is not None:
                tracing.end_federation(span, outcome)
        object.__setattr__(meta, "_after_commit", lambda: calls.ack(reply_id))
        return self._answer(calls, text, thread)

    def _answer(self, calls: RemoteCalls, text: str, thread: str
                ) -> HandlerResponse | ChainStopped:
        """The peer's reply as this listener's output, or a `huh` if it is not one
        the pinned schemas allow (a security event: the peer sent it)."""
        try:
            env = parse_envelope(text.encode("utf-8"), max_bytes=self.max_bytes)
            payload = env.payload
            # The called listener answers; a `huh` comes from the peer's platform.
            senders = (self.remote, "core") if payload.tag == _HUH else (self.remote,)
            if env.thread != thread or env.sender not in senders:
                raise Rejection(HuhCode.INVALID_ENVELOPE, "reply for another thread or sender")
            if payload.tag == _HUH:
                code = payload.findtext("{" + NS_CORE + "}code") or ""
                try:
                    huh = HuhCode(code)
                except ValueError:
                    return HandlerResponse.error(HuhCode.INTERNAL)
                if huh is HuhCode.BUDGET_EXCEEDED and env.sender == "core":
                    return ChainStopped(huh)  # the peer's platform stopped the chain
                # What the callee said (and logged) about a retry, not this code's default.
                said = payload.findtext("{" + NS_CORE + "}retry-allowed")
                retry = {"true": True, "false": False}.get((said or "").strip())
                return HandlerResponse.error(huh, retry_allowed=retry)
            if payload.tag == _ANSWER and self.offer.answers:  # a peer's agent: its text
                schema = core_schema()
            elif payload.tag not in self._responses:
                raise Rejection(HuhCode.INVALID_PAYLOAD, f"reply root {payload.tag} not pinned")
            else:
                schema = self.schemas[payload.tag]
            if not schema.validate(payload):
                raise Rejection(HuhCode.INVALID_PAYLOAD,
                                f"reply fails the pinned schema: {schema.error_log.last_error}")
        except Rejection as exc:
            calls.audit("federation-reply-refused", {
                "peer": self.gateway, "listener": self.remote, "detail": str(exc)[:300]})
            return HandlerResponse.error(HuhCode.INVALID_PAYLOAD)
        return HandlerResponse.respond(c14n(payload))


def _roots(xsd: etree._Element) -> list[str]:
    """The top-level elements an XSD declares, as clark names."""
    ns = xsd.get("targetNamespace", "")
    return [f"{{{ns}}}{el.get('name')}"
            for el in xsd.findall("{http://www.w3.org/2001/XMLSchema}element")]


async def sweep_forever(stopping: asyncio.Event, every_s: float = 5.0) -> None:
    while not stopping.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), every_s)
        for calls in list(OUTGOING.values()):
            calls.sweep()
