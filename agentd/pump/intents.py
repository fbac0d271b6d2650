"""Core `intent`, resolved: a bounded, timed call of the semantic resolver.

The resolver (embeddings and a model call) ranks what the sender may reach and
fills a payload; this desk only bounds it and turns every way it can fail into
"nothing fits": `BUSY` (answer `huh rate-limited` now), None (`huh unroutable`,
the one text that never says why) or the `IntentOutcome` to re-enter as the
sender's own output. `plan` turns that into the `IntentPlan` the pump's dispatch
applies in one batch.

Invariants: intents being resolved hold at most a quarter of the pump's slots, so
a slow embeddings endpoint cannot stall other traffic; none is held longer than
`pump.handler_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from agentd._core import Huh
from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import AgentdError, HuhCode, Rejection
from agentd._routing import Listener
from agentd._xml import ShapeLimits
from agentd.config import PumpConfig
from agentd.pump import admission
from agentd.pump.message import NO_CAPABILITY, IntentOutcome, IntentResolver, Message

log = logging.getLogger("agentd.pump")

_INTENT_TEXT = "{https://xml-pipeline.org/ns/core/v1}text"


class Busy:
    """Too many intents are being resolved: refused at once, `rate-limited`."""

    __slots__ = ()


BUSY = Busy()


@dataclass(frozen=True, slots=True)
class IntentPlan:
    """What an intent turns into, applied by the dispatch in one batch (one more
    hop): `journal` (the `intent-route` record's fields, once the resolver answered),
    then `notice`, a `huh` (counted as `rejected`) for the holder of the intent's
    frame; or the filled `envelope` re-entering as `listener`'s own output; or, for
    a client's intent, `filled`: its envelope routed, to gate as the client's own."""

    journal: dict[str, Any] | None = None
    rejected: HuhCode | None = None
    notice: bytes = b""
    listener: Listener | None = None
    envelope: bytes = b""
    filled: Message | None = None


class IntentDesk:
    """The intents of one pump being resolved. `resolver` None: semantic routing is
    not configured, and every intent is unroutable (said so in the log).
    `max_bytes` and `shape`: what a client's filled envelope is parsed with."""

    def __init__(self, resolver: IntentResolver | None, settings: PumpConfig,
                 max_bytes: int, shape: ShapeLimits) -> None:
        self.resolver = resolver
        self.max_bytes = max_bytes
        self.shape = shape
        self.running = 0
        self.limit = max(1, settings.max_concurrency // 4)
        self.timeout_s = settings.handler_timeout_s

    async def resolve(self, msg: Message, listener: Listener | None
                      ) -> IntentOutcome | Busy | None:
        """What `msg` (core `intent`, sent by `listener`, None for the client of a
        root frame) resolves to."""
        frame = msg.frame
        if self.resolver is None:
            log.warning("intent refused: semantic routing is not configured %s", frame.log_ids)
            return None
        if self.running >= self.limit:
            log.warning("intent refused: %d intents are being resolved %s",
                        self.running, frame.log_ids)
            return BUSY
        if not frame.is_root and listener is None:
            return None
        text = msg.payload.findtext(_INTENT_TEXT) or ""
        self.running += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self.resolver.resolve(text, msg.sender, listener, frame)
        except TimeoutError:
            log.warning("intent refused: not resolved within handler_timeout_s (%g s) %s",
                        self.timeout_s, frame.log_ids)
        except AgentdError as exc:  # an endpoint's outage (embeddings, model): one line
            log.warning("intent refused: %s %s", exc, frame.log_ids)
        except Exception:  # a resolver bug: refused, loudly, never half-done
            log.exception("intent resolver failed %s", frame.log_ids)
        finally:
            self.running -= 1
        return None

    async def plan(self, msg: Message) -> IntentPlan:
        """Resolve `msg` and plan its outcome (`IntentPlan`)."""
        frame, sender = msg.frame, msg.sender
        # A listener never holds a root frame: on one, the sender is the client.
        listener = None if frame.is_root else frame.profile.table.listeners.get(sender)
        outcome = await self.resolve(msg, listener)
        if isinstance(outcome, Busy):
            return IntentPlan(rejected=HuhCode.RATE_LIMITED,
                              notice=Huh.of(HuhCode.RATE_LIMITED).to_bytes())
        journal = None if outcome is None else {
            "thread": frame.uuid, "direction": "audit", "kind": "intent-route",
            "handler": outcome.listener or "", "sender": sender, "tag": msg.payload.tag,
            "payload": outcome.record, "profile": frame.profile.name,
        }
        if outcome is None or outcome.payload is None or outcome.listener is None:
            return IntentPlan(journal, HuhCode.UNROUTABLE,
                              Huh.of(HuhCode.UNROUTABLE, NO_CAPABILITY).to_bytes())
        data = build_envelope(sender, frame.uuid, outcome.payload, to=outcome.listener)
        if listener is not None:
            return IntentPlan(journal, listener=listener, envelope=data)
        try:  # a client's filled intent: routed like the client's own envelope
            env = parse_envelope(data, max_bytes=self.max_bytes, shape=self.shape)
            filled = admission.route_request(env, env.key, data, sender, None, frame)
        except Rejection as rej:
            log.info("filled intent rejected client=%s code=%s %s detail=%s",
                     sender, rej.code.value, frame.log_ids, rej.detail)
            return IntentPlan(journal, rej.code, Huh.of(rej.code).to_bytes())
        return IntentPlan(journal, filled=filled)
