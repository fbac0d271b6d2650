"""What goes into a task's next request: the six layers assembled and checked.

`Assembly` holds layer 3 (the shared facts, per agent, minus any that would
redefine layers 1-2), recalls layer 6 (long-term memories), assembles the layers
with the task's working memory at its segments' tiers, validates the result
against the registry (`validate_no_override`) and measures it against the agent's
context budget; `arrange` runs the librarian's pass (`agentd.context.replan`)
first. The platform owns the tasks, their history and the metered calls, and
hands this what it needs as callbacks (`report`, `audit`, `summarise`).

Invariants:
- an assembly that fails `validate_no_override` is never returned: each finding is
  a security event, and the call stops with `OverrideViolation`;
- a request the librarian cannot fit under `budget_tokens` raises
  `ContextOverflow` (audited as `budget-exceeded`), never goes out larger.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentd.config import AgentConfig
from agentd.context import (
    LibrarianRules,
    LongTermMemory,
    Segment,
    SegmentLog,
    TokenCalibration,
    replan,
)
from agentd.platform._budget import BudgetExceeded
from agentd.platform._context import (
    AssembledContext,
    Fragment,
    Layer,
    SecurityEvent,
    assemble,
    prepare,
    prepare_keyed,
    validate_no_override,
)
from agentd.platform._metered import request_bytes
from agentd.platform._prompts import AgentPrompt, PromptRegistry, fact_key
from agentd.platform._tasks import Task

# (agent, thread, event, marks already reported for the task): a security event.
ReportFn = Callable[[str, str, SecurityEvent, set[tuple[str, str, str]]], None]
# (agent, thread, segment): a folded segment's summary (a metered call).
SummariseFn = Callable[[str, str, Segment], Awaitable[str]]


class ContextOverflow(BudgetExceeded):
    """Even with every segment evicted, the request would exceed budget_tokens."""


class OverrideViolation(Exception):
    """`validate_no_override` found a way for a lower layer to pose as a higher one."""


class Assembly:
    """The layers of the agents' requests, for one platform."""

    def __init__(
        self,
        agents: Mapping[str, AgentConfig],
        registry: PromptRegistry,
        memory: LongTermMemory,
        tokens: TokenCalibration,
        segments: SegmentLog,
        facts: Mapping[str, str],
        report: ReportFn,
        audit: Callable[[str, str, Mapping[str, Any]], None],
        summarise: SummariseFn,
    ) -> None:
        self._agents = agents
        self._registry = registry
        self._memory = memory
        self._tokens = tokens
        self._segments = segments
        self._report = report
        self._audit = audit
        self.summarise = summarise
        # Layer 3 per agent: shared facts minus those that would redefine layers 1-2.
        self._shared: dict[str, tuple[tuple[Fragment, ...], dict[str, str]]] = {}
        for agent in agents:
            prompt = registry.get(agent)
            kept, events = prepare_keyed(
                facts.items(), layer=Layer.SHARED, source="shared", protected=prompt.facts
            )
            for event in events:
                report(agent, "", event, set())
            text = "\n".join(f"{k}: {v}" for k, v in kept if k is not None)
            fragments = (Fragment(Layer.SHARED, text, "shared"),) if text else ()
            self._shared[agent] = (fragments, {fact_key(k): v for k, v in kept if k})

    def shared_facts(self, agent: str) -> dict[str, str]:
        """Layer 3's facts for `agent`, by key (they bind the layers below)."""
        return self._shared[agent][1]

    async def recall(self, agent: str, thread: str, task: Task) -> list[Fragment]:
        """Layer 6: the memories most similar to the task, minus any keyed one that
        would redefine a fact of a higher layer (dropped and reported)."""
        await self._memory.ready()
        k = self._agents[agent].context.recall_k
        memories = await self._memory.recall(agent, task.query, k)
        kept, events = prepare_keyed(
            ((m.key, m.text) for m in memories),
            layer=Layer.LONG_TERM, source="memory", protected=task.protected,
        )
        for event in events:
            self._report(agent, thread, event, task.reported)
        return [Fragment(Layer.LONG_TERM, text, "memory") for _, text in kept]

    def assemble(self, agent: str, thread: str, task: Task, memories: list[Fragment]
                 ) -> tuple[AssembledContext, AgentPrompt]:
        prompt = self._registry.get(agent)

        def summary(text: str, source: str) -> str:
            prepared = prepare(text, layer=Layer.WORKING, source=source,
                               protected=task.protected)
            for event in prepared.events:
                self._report(agent, thread, event, task.reported)
            return prepared.content

        ctx = assemble(
            prompt,
            nonce=secrets.token_hex(8),
            task=task.task,
            shared=self._shared[agent][0],
            working=task.context.shown(summary),
            memories=memories,
        )
        problems = validate_no_override(ctx, self._registry, task.protected)
        if problems:
            for problem in problems:
                self._report(agent, thread, SecurityEvent(
                    "override-violation", Layer.CORE, "assembly", problem), set())
            raise OverrideViolation("; ".join(problems))
        return ctx, prompt

    async def arrange(self, agent: str, thread: str, task: Task
                      ) -> tuple[AssembledContext, AgentPrompt]:
        """Run the librarian for the thread's next call (relevance, fold, evict,
        unfold; summaries for newly folded segments), then assemble. The assembled
        request is measured; when the estimate of a summary was short, the plan is
        made again with less room, so the request never exceeds `budget_tokens`."""
        cfg = self._agents[agent]
        memories = await self.recall(agent, thread, task)
        context = task.context
        if not context.segments:
            ctx, prompt = self.assemble(agent, thread, task, memories)
            self._check_budget(agent, thread, ctx)
            return ctx, prompt
        factor = self._tokens.factor(cfg.model)

        def tokens(nbytes: Any) -> Any:
            return np.ceil(nbytes / 4 * factor).astype(np.int64)

        empty = assemble(self._registry.get(agent), nonce="0" * 16, task=task.task,
                         shared=self._shared[agent][0], working=(), memories=memories)
        fixed = self.request_tokens(empty, cfg.model)
        query = f"{task.query}\n{context.segments[-1].text}"
        rules = LibrarianRules(cfg.context.budget_tokens, cfg.context.fold_below,
                               cfg.context.keep_recent)
        caller = _Arranged(self, agent, thread, task, memories)
        (ctx, prompt), used = await replan(context, query, rules, tokens, fixed, caller)
        if used > cfg.context.budget_tokens:
            self._check_budget(agent, thread, ctx)
        return ctx, prompt

    def request_tokens(self, ctx: AssembledContext, backend: str) -> int:
        tools = self._registry.get(ctx.agent).provider_tools
        return self._tokens.estimate(request_bytes(ctx.system, ctx.messages, tools), backend)

    def _check_budget(self, agent: str, thread: str, ctx: AssembledContext) -> None:
        cfg = self._agents[agent]
        used = self.request_tokens(ctx, cfg.model)
        if used > cfg.context.budget_tokens:
            self._audit("budget-exceeded", thread, {
                "agent": agent, "scope": "context", "limit": cfg.context.budget_tokens,
                "spent": used,
            })
            raise ContextOverflow("context", cfg.context.budget_tokens, used, 0)


@dataclass(frozen=True, slots=True)
class _Arranged:
    """The assembly's side of the librarian's pass (`agentd.context.replan`) for one
    task's next call."""

    assembly: Assembly
    agent: str
    thread: str
    task: Task
    memories: list[Fragment]

    async def summary(self, seg: Segment) -> str:
        return await self.assembly.summarise(self.agent, self.thread, seg)

    def moved(self, seg: Segment) -> None:
        self.assembly._segments.move(self.thread, seg)

    def assemble(self) -> tuple[tuple[AssembledContext, AgentPrompt], int]:
        a = self.assembly
        ctx, prompt = a.assemble(self.agent, self.thread, self.task, self.memories)
        return (ctx, prompt), a.request_tokens(ctx, a._agents[self.agent].model)
