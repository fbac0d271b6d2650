"""The librarian: which tier each segment of a task takes for the next LLM call.

Pure decision code: segment costs and relevances in, tiers out. No kernel, no model.
The rules, in order:

1. the newest `keep_recent` segments, and segments the agent asked back with
   `unfold`, are protected: expanded;
2. any other segment is expanded when its relevance to the current task is at least
   `fold_below`, folded (its summary stands in) below that; a folded segment whose
   relevance rose again is therefore unfolded;
3. while the whole request (the fixed part: system prompt with the tool definitions,
   shared facts, the task, recalled memories; plus every segment at its tier) is over
   `budget_tokens`, the least relevant unprotected segment is evicted (ties: the
   oldest first);
4. still over: protected segments are evicted too, oldest first, so the prompt is
   never over budget;
5. still over (stubs alone are too many): the stubs are collapsed into one line
   naming the range of evicted ids; if even that does not fit, the plan says so and
   no call is made.

The decision is a function of its inputs only (no memory of earlier plans), so a
restart or a replay reaches the same tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentd.context._segments import Tier

TIERS = _TIERS = (Tier.EXPANDED, Tier.FOLDED, Tier.EVICTED)  # by code
EXPANDED, FOLDED, EVICTED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class LibrarianRules:
    budget_tokens: int
    fold_below: float
    keep_recent: int


@dataclass(frozen=True, slots=True)
class Costs:
    """Per segment, in segment order (oldest first): token cost at each tier, and
    relevance in [0, 1]."""

    expanded: np.ndarray  # int64
    folded: np.ndarray
    stub: np.ndarray
    relevance: np.ndarray  # float64
    pinned: np.ndarray  # bool

    @classmethod
    def of(cls, expanded: Sequence[int], folded: Sequence[int], stub: Sequence[int],
           relevance: Sequence[float], pinned: Sequence[bool] | None = None) -> Costs:
        n = len(expanded)
        return cls(
            np.asarray(expanded, dtype=np.int64), np.asarray(folded, dtype=np.int64),
            np.asarray(stub, dtype=np.int64), np.asarray(relevance, dtype=np.float64),
            np.asarray(pinned if pinned is not None else [False] * n, dtype=bool),
        )


@dataclass(frozen=True, slots=True)
class Plan:
    codes: np.ndarray  # per segment, in segment order: EXPANDED, FOLDED or EVICTED
    total_tokens: int  # the whole request as planned
    collapsed_stubs: bool  # every evicted segment is shown in one range line
    fits: bool  # total_tokens <= budget

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(_TIERS[t] for t in self.codes.tolist())


def plan_tiers(costs: Costs, rules: LibrarianRules, fixed_tokens: int,
               collapsed_stub_tokens: int = 24) -> Plan:
    n = len(costs.expanded)
    if n == 0:
        total = fixed_tokens
        return Plan(np.zeros(0, dtype=np.int64), total, False, total <= rules.budget_tokens)
    protected = costs.pinned.copy()
    if rules.keep_recent > 0:
        protected[max(0, n - rules.keep_recent):] = True
    tier = np.where(protected | (costs.relevance >= rules.fold_below), EXPANDED, FOLDED)
    by_tier = np.stack([costs.expanded, costs.folded, costs.stub])
    cost = by_tier[tier, np.arange(n)]
    total = int(fixed_tokens + cost.sum())
    budget = rules.budget_tokens
    if total > budget:
        # Rule 3: the least relevant unprotected first (stable sort: oldest on ties).
        free = np.flatnonzero(~protected)
        order = free[np.argsort(costs.relevance[free], kind="stable")]
        total = _evict(order, tier, cost, costs.stub, total, budget)
    if total > budget:
        # Rule 4: protected ones too, oldest first.
        order = np.flatnonzero(protected & (tier != EVICTED))
        total = _evict(order, tier, cost, costs.stub, total, budget)
    collapsed = False
    if total > budget:
        # The stubs collapse into one line. Segments no larger than their own stub
        # were not worth evicting one by one, but inside the collapsed line they cost
        # nothing: if the prompt still does not fit, every segment goes into it.
        evicted = tier == EVICTED
        total = total - int(cost[evicted].sum()) + collapsed_stub_tokens
        collapsed = True
        if total > budget:
            tier[:] = EVICTED
            total = fixed_tokens + collapsed_stub_tokens
    return Plan(tier, total, collapsed, total <= budget)


def _evict(order: np.ndarray, tier: np.ndarray, cost: np.ndarray, stub: np.ndarray,
           total: int, budget: int) -> int:
    """Evict segments of `order` in turn until `total` fits; returns the new total."""
    savings = cost[order] - stub[order]
    useful = savings > 0  # evicting what is smaller than its stub gains nothing
    order, savings = order[useful], savings[useful]
    if len(order) == 0:
        return total
    cumulative = np.cumsum(savings)
    need = total - budget
    k = int(np.searchsorted(cumulative, need, side="left")) + 1
    k = min(k, len(order))
    chosen = order[:k]
    tier[chosen] = EVICTED
    saved = int(cumulative[k - 1])
    cost[chosen] = stub[chosen]
    return total - saved
