"""Evaluating routing offline: a labelled file of intents, the organism's own
profiles and embeddings, and per profile the figures thresholds are chosen from.

The labelled file is YAML, a list of `{profile: NAME, text: TEXT, expect: NAME}`
(`expect: null` when the right outcome is to abstain). For each profile:

- `top1_accuracy`: of the items that expect a listener, the share where the router
  selects it (above the threshold);
- `top3_accuracy`: the share where it is among the first three of the permitted
  ranking, whatever the threshold;
- `abstain_rate`: the share of all items for which nothing is selected;
- `abstain_correct`: of the items that expect nothing, the share where nothing is
  selected.

Nothing is filled and no daemon is needed; with `openai` embeddings the endpoint
is called.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from agentd._errors import ConfigError
from agentd._routing import Routing
from agentd.config import OrganismConfig
from agentd.semantic._router import SemanticRouter


@dataclass(frozen=True)
class Labelled:
    profile: str
    text: str
    expect: str | None


@dataclass
class ProfileScore:
    items: int = 0
    expecting: int = 0
    top1: int = 0
    top3: int = 0
    abstained: int = 0
    abstain_expected: int = 0
    abstain_correct: int = 0
    misses: list[tuple[str, str | None, str | None]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        def share(n: int, of: int) -> float | None:
            return round(n / of, 4) if of else None

        return {
            "items": self.items,
            "top1_accuracy": share(self.top1, self.expecting),
            "top3_accuracy": share(self.top3, self.expecting),
            "abstain_rate": share(self.abstained, self.items),
            "abstain_correct": share(self.abstain_correct, self.abstain_expected),
        }


def read_labelled(text: str, source: str = "<labelled>") -> list[Labelled]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: not YAML: {exc}"]) from None
    if not isinstance(data, list):
        raise ConfigError([f"{source}: expected a list of {{profile, text, expect}}"])
    items, problems = [], []
    for i, entry in enumerate(data):
        ok = (
            isinstance(entry, dict) and set(entry) <= {"profile", "text", "expect"}
            and isinstance(entry.get("profile"), str) and isinstance(entry.get("text"), str)
            and (entry.get("expect") is None or isinstance(entry.get("expect"), str))
        )
        if not ok:
            problems.append(f"{source}: item {i}: expected {{profile, text, expect}}")
            continue
        items.append(Labelled(entry["profile"], entry["text"], entry.get("expect")))
    if problems:
        raise ConfigError(problems)
    return items


def routing_for_evaluation(config: OrganismConfig) -> Routing:
    """The organism's profiles; agents get a stand-in handler (nothing runs)."""

    def not_run(*_: object) -> None:  # pragma: no cover - never called
        raise RuntimeError("evaluation does not run handlers")

    agents = {lst.name: not_run for lst in config.listeners if lst.agent is not None}
    return Routing.build(config, agent_handlers=agents)


async def evaluate(
    router: SemanticRouter, routing: Routing, items: Sequence[Labelled]
) -> dict[str, ProfileScore]:
    unknown = sorted({i.profile for i in items} - set(routing.profiles))
    if unknown:
        raise ConfigError([f"no profile named {name!r}" for name in unknown])
    scores: dict[str, ProfileScore] = {}
    for item in items:
        score = scores.setdefault(item.profile, ProfileScore())
        ranking = await router.rank(item.text, routing.profiles[item.profile])
        names = [name for name, _ in ranking.entries]
        score.items += 1
        if ranking.selected is None:
            score.abstained += 1
        if item.expect is None:
            score.abstain_expected += 1
            score.abstain_correct += ranking.selected is None
        else:
            score.expecting += 1
            score.top1 += ranking.selected == item.expect
            score.top3 += item.expect in names[:3]
        if ranking.selected != item.expect:
            score.misses.append((item.text, item.expect, ranking.selected))
    return scores
