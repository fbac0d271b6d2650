"""The `routing` section (semantic routing of core `intent`) and its per-profile
override.

    routing: {semantic: {threshold: 0.3, top_k: 5, fill_models: [cheap, strong]}}
    profiles: {ops: {listeners: all, allow_intents: true,
                     routing: {semantic: {threshold: 0.5}}}}

`fill_models` is the model ladder: names of `llm.backends` entries, tried in order;
empty means every backend, in configuration order.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass

from agentd.config.values import Names, Positive, Problem

Score = Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)]
_SECTION = ConfigDict(extra="forbid")
DEFAULT_THRESHOLD = 0.2
DEFAULT_TOP_K = 5


@dataclass(frozen=True, config=_SECTION)
class SemanticRoutingConfig:
    threshold: Score = DEFAULT_THRESHOLD
    top_k: Positive = DEFAULT_TOP_K
    fill_models: Names = ()


DEFAULT_SEMANTIC = SemanticRoutingConfig()


@dataclass(frozen=True, config=_SECTION)
class RoutingConfig:
    semantic: SemanticRoutingConfig = Field(default_factory=SemanticRoutingConfig)


@dataclass(frozen=True, config=_SECTION)
class SemanticOverride:
    """A profile's own values; a key left out keeps the organism's."""

    threshold: Score | None = None
    top_k: Positive | None = None
    fill_models: Names | None = None

    def over(self, base: SemanticRoutingConfig) -> SemanticRoutingConfig:
        return SemanticRoutingConfig(
            threshold=base.threshold if self.threshold is None else self.threshold,
            top_k=base.top_k if self.top_k is None else self.top_k,
            fill_models=base.fill_models if self.fill_models is None else self.fill_models,
        )


@dataclass(frozen=True, config=_SECTION)
class ProfileRoutingConfig:
    semantic: SemanticOverride = Field(default_factory=SemanticOverride)


def routing_references(data: dict[str, Any]) -> list[Problem]:
    """Every `fill_models` entry names an `llm.backends` entry."""
    llm = data.get("llm")
    entries = llm.get("backends") if isinstance(llm, dict) else ()
    backends = {
        b.get("name") for b in (entries if isinstance(entries, tuple) else ())
        if isinstance(b, dict)
    }
    places: list[tuple[tuple[str, ...], Any]] = []
    routing = data.get("routing")
    if isinstance(routing, dict) and isinstance(routing.get("semantic"), dict):
        places.append((("routing", "semantic"), routing["semantic"]))
    profiles = data.get("profiles")
    for key, body in profiles.items() if isinstance(profiles, dict) else ():
        own = body.get("routing") if isinstance(body, dict) else None
        if isinstance(own, dict) and isinstance(own.get("semantic"), dict):
            places.append((("profiles", key, "routing", "semantic"), own["semantic"]))
    problems: list[Problem] = []
    for at, semantic in places:
        models = semantic.get("fill_models")
        for j, name in enumerate(models if isinstance(models, tuple) else ()):
            if isinstance(name, str) and name not in backends:
                problems.append(Problem(
                    (*at, "fill_models", j), f"no backend named {name!r} in llm.backends", name
                ))
    return problems
