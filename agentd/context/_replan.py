"""The librarian's pass for one call: plan the tiers, apply them, summarise what was
newly folded, measure the request the platform assembles, and plan again with less
room while the estimate was short.

The decision stays in `plan_tiers` (pure); this loop only runs it until the measured
request fits. What a segment looks like in a prompt, and what a summary costs, are
the caller's (`Arrangement`): the platform assembles, summarises through its one
metered call, and writes the moved segments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

import numpy as np

from agentd.context._librarian import LibrarianRules, Plan
from agentd.context._segments import Segment, Tier

T = TypeVar("T", covariant=True)
ROUNDS = 4  # plans per call at most: each one tightened by what the last was short

Tokens = Callable[[np.ndarray], np.ndarray]  # bytes -> estimated tokens, per segment


class Planned(Protocol):
    """What the loop needs of a task's working memory."""

    async def plan(self, query: str, rules: LibrarianRules, tokens: Tokens,
                   fixed_tokens: int) -> Plan: ...

    def apply(self, plan: Plan) -> list[Segment]: ...

    def summarised(self, seg: Segment) -> None: ...


class Arrangement(Protocol, Generic[T]):
    """The caller's side: a summary for a newly folded segment, a note that a
    segment moved, and the assembled request with its measured size."""

    async def summary(self, seg: Segment) -> str: ...

    def moved(self, seg: Segment) -> None: ...

    def assemble(self) -> tuple[T, int]: ...


async def replan(context: Planned, query: str, rules: LibrarianRules, tokens: Tokens,
                 fixed_tokens: int, caller: Arrangement[T]) -> tuple[T, int]:
    """The assembled request after at most ROUNDS plans, and its size in tokens (over
    `rules.budget_tokens` only when no plan could fit: the caller refuses it)."""
    budget = rules.budget_tokens
    result: tuple[T, int] | None = None
    for _ in range(ROUNDS):
        plan = await context.plan(query, replace(rules, budget_tokens=budget), tokens,
                                  fixed_tokens)
        moved = context.apply(plan)
        for seg in moved:  # a segment is summarised when it is first folded
            if seg.tier is Tier.FOLDED and not seg.summary:
                seg.summary = await caller.summary(seg)
                context.summarised(seg)
        for seg in moved:
            caller.moved(seg)
        result = caller.assemble()
        used = result[1]
        if used <= rules.budget_tokens:
            break
        budget -= used - rules.budget_tokens  # short by this much: plan tighter
    assert result is not None  # ROUNDS >= 1
    return result
