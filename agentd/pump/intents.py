"""Core `intent`, resolved: a bounded, timed call of the semantic resolver.

The resolver (embeddings and a model call) ranks what the sender may reach and
fills a payload; this desk only bounds it and turns every way it can fail into
"nothing fits", so the pump's dispatch has one outcome to apply: `BUSY` (answer
`huh rate-limited` now), None (`huh unroutable`, the one text that never says
why) or the `IntentOutcome` to re-enter as the sender's own output.

Invariants: intents being resolved hold at most a quarter of the pump's slots, so
a slow embeddings endpoint cannot stall other traffic; none is held longer than
`pump.handler_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging

from agentd._errors import AgentdError
from agentd._routing import Listener
from agentd.config import PumpConfig
from agentd.pump.message import IntentOutcome, IntentResolver, Message

log = logging.getLogger("agentd.pump")

_INTENT_TEXT = "{https://xml-pipeline.org/ns/core/v1}text"


class Busy:
    """Too many intents are being resolved: refused at once, `rate-limited`."""

    __slots__ = ()


BUSY = Busy()


class IntentDesk:
    """The intents of one pump being resolved. `resolver` None: semantic routing is
    not configured, and every intent is unroutable (said so in the log)."""

    def __init__(self, resolver: IntentResolver | None, settings: PumpConfig) -> None:
        self.resolver = resolver
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
