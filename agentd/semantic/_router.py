"""The semantic router: core `intent` in, a filled payload of a permitted listener
out, or nothing (the pump then answers `huh unroutable`).

rank (permitted candidates only) -> select (threshold) -> fill (the model ladder:
`fill_models` in order, the next one when a reply is refused) -> the pump
dispatches the payload as the sender's own output, through every usual check. The
router is advisory: it never widens what the dispatch table allows, and what it
returns is checked again by the pump.

Log lines and the journal record name only permitted listeners; the filler sees
only the selected one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

from agentd._errors import ConfigError
from agentd._routing import Listener, Profile
from agentd._threads import Frame
from agentd.config import DEFAULT_SEMANTIC, OrganismConfig, SemanticRoutingConfig
from agentd.embeddings import Embedder, EmbeddingsError, build_embedder
from agentd.llm import LlmError
from agentd.platform import BudgetExceeded, Platform
from agentd.pump import IntentOutcome
from agentd.semantic._filler import fill_prompt, read_fill
from agentd.semantic._ranking import Ranker, Ranking

log = logging.getLogger("agentd.semantic")

PlatformSource = Callable[[], "Platform | None"]


def settings_of(profile: Profile) -> SemanticRoutingConfig:
    return profile.semantic if profile.semantic is not None else DEFAULT_SEMANTIC


class SemanticRouter:
    """Implements the pump's `IntentResolver`. `platform` gives the LLM platform of
    the moment (it changes on reload); `backends` is the ladder when a profile's
    `fill_models` is empty."""

    def __init__(
        self, embedder: Embedder, platform: PlatformSource, backends: Sequence[str] = ()
    ) -> None:
        self.ranker = Ranker(embedder)
        self._platform = platform
        self.backends = tuple(backends)

    @classmethod
    def from_config(cls, config: OrganismConfig, platform: PlatformSource) -> SemanticRouter:
        """With the configured embeddings (a model that cannot be loaded is a
        `ConfigError`, so a daemon with a broken model never starts) and, as the
        default ladder, every LLM backend in configuration order."""
        try:
            embedder = build_embedder(config.embeddings, config.llm)
        except EmbeddingsError as exc:
            raise ConfigError([f"{config.source or '<config>'}: embeddings: {exc}"]) from None
        backends = tuple(b.name for b in config.llm.backends) if config.llm is not None else ()
        return cls(embedder, platform, backends)

    async def aclose(self) -> None:
        close = getattr(self.ranker.embedder, "aclose", None)  # an HTTP provider's client
        if close is not None:
            await close()

    async def rank(self, text: str, profile: Profile, sender: Listener | None = None) -> Ranking:
        """The permitted ranking for `text` in `profile` (for `sender`'s peers)."""
        semantic = settings_of(profile)
        return await self.ranker.rank(text, profile, sender, semantic.threshold, semantic.top_k)

    async def resolve(
        self, text: str, sender: str, sender_listener: Listener | None, frame: Frame
    ) -> IntentOutcome:
        ranking = await self.rank(text, frame.profile, sender_listener)
        tried: list[dict[str, str]] = []
        payload: bytes | None = None
        selected = ranking.selected
        target = frame.profile.table.listeners.get(selected) if selected else None
        if target is not None:
            payload = await self._fill(text, target, frame, tried)
        record = {
            "intent": text, **ranking.as_json(), "threshold": ranking.threshold,
            "fill": tried, "outcome": "filled" if payload is not None else "unroutable",
        }
        log.info("intent %s sender=%s selected=%s outcome=%s", frame.log_ids, sender,
                 selected or "-", record["outcome"])
        return IntentOutcome(
            payload, selected if payload is not None else None,
            json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode(),
        )

    async def _fill(
        self, text: str, target: Listener, frame: Frame, tried: list[dict[str, str]]
    ) -> bytes | None:
        platform = self._platform()
        if platform is None:
            log.warning("intent %s: no LLM platform to fill a payload with", frame.log_ids)
            tried.append({"model": "", "outcome": "no-llm"})
            return None
        ladder = settings_of(frame.profile).fill_models or self.backends
        system = fill_prompt(target)
        for model in ladder:
            try:
                completion = await platform.fill(frame.uuid, system, text, model)
            except BudgetExceeded:
                tried.append({"model": model, "outcome": "budget-exceeded"})
                return None
            except LlmError as exc:
                log.warning("intent %s: filler %s failed: %s", frame.log_ids, model, exc)
                tried.append({"model": model, "outcome": "error"})
                continue
            filled = read_fill(completion.text, target)
            if filled.payload is not None:
                tried.append({"model": model, "outcome": "ok"})
                return filled.payload
            log.info("intent %s: filler %s refused for %s: %s", frame.log_ids, model,
                     target.name, filled.reason[:200])
            tried.append({"model": model, "outcome": "refused"})
        return None
