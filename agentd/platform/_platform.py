"""The platform: the trusted owner of prompts, history and every LLM call.

Agents hold an `AgentSession` bound to their own name. Through it they start a task
on the frame they run in, record what comes back, and ask for a completion; the
platform then assembles the six layers (system prompt from the registry, shared
facts, the task, the thread's turns, recalled memories), validates the assembly
(`validate_no_override`), enforces budgets, calls the router, settles the budgets
with the provider's figures, updates `agentd_llm_tokens_total`, writes an
`llm-call` audit record carrying the prompt's SHA-256, and appends the reply to
the thread's history. Handlers never see a prompt, a router or another thread.

Invariants:
- a thread (frame UUID) belongs to the one agent that began a task on it; any
  other agent asking about it gets `IsolationError`;
- a call goes out only after `validate_no_override` found nothing; a finding is an
  internal error and a security event, never a degraded call;
- every security event (neutralised markers or role tags, dropped fact
  redefinitions, suspected injections) goes to `audit` once per thread;
- a task lives no longer than its frame: bound to the pump's registry, the
  platform drops a task (and its history) when the frame ends, however it ends,
  and tells the agent's handler (`AgentSession.on_task_end`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from agentd import _metrics as metrics
from agentd._threads import log_ids
from agentd.config import AgentConfig, OrganismConfig
from agentd.context import (
    HashedTerms,
    LongTermMemory,
    MemoryRecord,
    NoSegmentLog,
    Part,
    Segment,
    SegmentLog,
    TextVectors,
    TokenCalibration,
    text_vectors,
)
from agentd.llm import (
    LlmRequest,
    LlmRouter,
    Role,
    ToolSpec,
)
from agentd.llm.tools import AUTO
from agentd.platform._assembly import Assembly
from agentd.platform._budget import BudgetExceeded, BudgetLedger, Scope
from agentd.platform._context import (
    AssembledContext,
    Fragment,
    Layer,
    SecurityEvent,
    prepare,
)
from agentd.platform._history import (
    ASSISTANT,
    NOTICE,
    RESULT,
    TASK,
    HistoryStore,
    InMemoryHistoryStore,
    Turn,
    part_text,
)
from agentd.platform._metered import AuditFn, Completion, Meter, MeteredCalls, request_bytes
from agentd.platform._own_calls import fill_form, summarise
from agentd.platform._previews import PreviewOpener, Previews, PreviewWriter
from agentd.platform._prompts import AgentPrompt, PromptRegistry, ToolCatalogue
from agentd.platform._scope import ThreadResolver, registry_resolver
from agentd.platform._tasks import Task, TaskEndHook, TaskTable
from agentd.platform._working import TaskContext

if TYPE_CHECKING:
    from agentd._threads import ThreadRegistry

log = logging.getLogger("agentd.platform")

SECURITY = "security"  # the audit kind of security events


def _null_audit(kind: str, thread: str, fields: Mapping[str, Any]) -> None:
    return None


class Platform:
    def __init__(
        self,
        config: OrganismConfig,
        registry: PromptRegistry,
        router: LlmRouter,
        *,
        history: HistoryStore | None = None,
        memory: LongTermMemory | None = None,
        audit: AuditFn | None = None,
        shared_facts: Mapping[str, str] | None = None,
        resolve_thread: ThreadResolver | None = None,
        segments: SegmentLog | None = None,
        vectors: TextVectors | None = None,
    ) -> None:
        self.config = config
        self._registry = registry
        self._router = router
        self.history: HistoryStore = history if history is not None else InMemoryHistoryStore()
        self.vectors: TextVectors = vectors or (memory.embedder if memory else HashedTerms())
        self.memory = memory or LongTermMemory(self.vectors)
        self.segments: SegmentLog = segments or NoSegmentLog()
        self.tokens = TokenCalibration()
        self._audit_sink: AuditFn = audit or _null_audit
        self._resolve = resolve_thread
        self._previews = Previews(config)
        self.budgets = BudgetLedger()
        self._metered = MeteredCalls(router, self.budgets, self._audit)
        self._agents: Mapping[str, AgentConfig] = MappingProxyType(
            {lst.name: lst.agent for lst in config.listeners if lst.agent is not None}
        )
        self._tasks = TaskTable()
        facts = dict(shared_facts) if shared_facts is not None else {"organism": config.name}
        # The layers of each request: shared facts, memories, assembly, the librarian.
        self._assembly = Assembly(self._agents, registry, self.memory, self.tokens,
                                  self.segments, facts, self._report, self._audit,
                                  self._summarise)

    @classmethod
    def from_config(
        cls,
        config: OrganismConfig,
        *,
        manifesto: str | None = None,
        router: LlmRouter | None = None,
        **kwargs: Any,
    ) -> Platform:
        """Registry and router from `config` (raises `ConfigError`). Keyword arguments
        not taken by `Platform` (env, clock, backoff_base_s, ...) go to the
        router."""
        if config.llm is None and any(lst.agent for lst in config.listeners):
            from agentd._errors import ConfigError

            raise ConfigError([f"{config.source or '<config>'}: llm: agents need an llm section"])
        registry = PromptRegistry.build(config, manifesto=manifesto)
        own = {k: kwargs.pop(k) for k in (
            "history", "memory", "audit", "shared_facts", "resolve_thread", "segments",
            "vectors",
        ) if k in kwargs}
        if "vectors" not in own and "memory" not in own:
            own["vectors"] = text_vectors(config.embeddings, config.llm, **{
                k: kwargs[k] for k in ("env",) if k in kwargs})
        if router is None:
            from agentd.config import LlmConfig

            router = LlmRouter(config.llm or LlmConfig(), **kwargs)
        return cls(config, registry, router, **own)

    # ---- wiring -----------------------------------------------------------------------

    def bind_threads(self, resolver: ThreadResolver | ThreadRegistry) -> None:
        """Give the platform the conversation of each thread (for budgets); bound to
        the registry itself, tasks also end with their frames (`frame_ended`)."""
        if callable(resolver):
            self._resolve = resolver
            return
        self._resolve = registry_resolver(resolver)
        resolver.on_end(self.frame_ended)

    def bind_previews(self, opener: PreviewOpener | None) -> None:
        """Stream agents' model calls to the owning client when it asked (`opener`
        says whether, and gives the writer)."""
        self._previews.bind(opener)

    def _preview(self, agent: str, thread: str) -> PreviewWriter | None:
        return self._previews.open(agent, thread, self._resolve)

    def frame_ended(self, thread: str) -> None:
        """The frame `thread` ended (answered, failed, collected): a task still open
        on it can never get another message, so it leaves with its history."""
        agent = self._tasks.remove(thread)
        if agent is None:
            return  # not a task, or the agent already ended it
        self.history.drop(thread)
        self._tasks.ended(agent, thread)

    @property
    def open_tasks(self) -> int:
        """Tasks begun and not yet ended, over all agents."""
        return len(self._tasks)

    def session(self, agent: str) -> AgentSession:
        if agent not in self._agents:
            raise KeyError(f"{agent} is not an LLM agent")
        return AgentSession(self, agent)

    async def remember(self, agent: str, text: str, key: str | None = None) -> MemoryRecord:
        """Store a long-term memory for `agent` (the trusted API: operators and the
        platform's owner, never an agent); returns once the kernel committed it."""
        await self.memory.ready()
        return await self.memory.add(self._agent_name(agent), text, key)

    async def forget(self, agent: str, memory_id: str) -> bool:
        await self.memory.ready()
        return await self.memory.forget(self._agent_name(agent), memory_id)

    async def memories(self, agent: str) -> list[MemoryRecord]:
        await self.memory.ready()
        return self.memory.list(self._agent_name(agent))

    def _agent_name(self, agent: str) -> str:
        if agent not in self._agents:
            raise KeyError(f"{agent} is not an LLM agent")
        return agent

    def task_segments(self, thread: str) -> list[Segment] | None:
        """The live segments of the task on frame `thread` (operators only)."""
        task = self._tasks.get(thread)
        if task is None:
            return None
        task.context.current_relevance()
        return list(task.context.segments)

    def tasks_of(self, conversation: str) -> list[str]:
        """Frames of live tasks serving the client's thread `conversation`."""
        return [t for t in self._tasks if t == conversation or self.conversation(t) == conversation]

    def prompt(self, agent: str) -> AgentPrompt:
        """`agent`'s assembled system prompt, its hash, facts and tool catalogue
        (KeyError if it is not an agent here). Operators may see it; agents see only
        their own, through their requests."""
        return self._registry.get(agent)

    async def aclose(self) -> None:
        await self._router.aclose()

    # ---- what sessions call -----------------------------------------------------------

    def _start(self, agent: str, thread: str, task_xml: str) -> Task:
        self._tasks.claim(agent, thread)
        prompt = self._registry.get(agent)
        shared_facts = self._assembly.shared_facts(agent)
        protected = {**shared_facts, **prompt.facts}
        prepared = prepare(
            task_xml, layer=Layer.DELEGATED, source="task", protected=protected, xml=True
        )
        protected.update(prepared.facts)  # facts the task declares bind the layers below
        task = Task(agent, protected,
                     Fragment(Layer.DELEGATED, prepared.content, "task", xml=True),
                     query=task_xml, context=TaskContext(self.vectors))
        self._tasks.add(thread, task)
        for event in prepared.events:
            self._report(agent, thread, event, task.reported)
        return task

    def begin(self, agent: str, thread: str, task_xml: str, *, again: bool = False) -> None:
        """Start a task on `thread`. `again`: the task was redelivered after a crash;
        whatever history it had is dropped (a task starts from an empty history)."""
        self._start(agent, thread, task_xml)
        if again:
            self.history.drop(thread)
        self.history.append(thread, Turn(TASK, task_xml, "", xml=True))

    def _working(self, task: Task, thread: str, turn: Turn, persist: bool = True) -> None:
        role: Role = "assistant" if turn.kind == ASSISTANT else "user"
        source = "assistant" if turn.kind == ASSISTANT else f"result:{turn.source}"
        prepared = prepare(
            turn.content, layer=Layer.WORKING, source=source, protected=task.protected,
            xml=turn.xml,
        )
        for event in prepared.events:
            self._report(task.agent, thread, event, task.reported)
        seg = task.context.add(Part(turn.kind, part_text(turn), turn.source, turn.xml),
                               Fragment(Layer.WORKING, prepared.content, source, role,
                                        xml=turn.xml, calls=turn.calls,
                                        call_id=turn.call_id, is_error=turn.is_error))
        if not persist:
            return
        if turn.kind == ASSISTANT:
            self.segments.put(thread, self.conversation(thread), task.agent, seg)
        else:
            # Results join their reply's segment one by one: its row is written once,
            # before the next call (see `arrange`), not rewritten whole per result.
            # The history holds each result; a restart rebuilds segments from it.
            task.unsaved[seg.id] = seg

    def _save(self, task: Task, thread: str) -> None:
        for seg in task.unsaved.values():
            self.segments.put(thread, self.conversation(thread), task.agent, seg)
        task.unsaved.clear()

    def record(
        self, agent: str, thread: str, content: str, source: str, xml: bool, notice: bool = False,
        seq: int = 0, call_id: str = "", is_error: bool = False,
    ) -> bool:
        """Add a result (or a notice) to the task's history; False when the result of
        message `seq` is already there (its message redelivered after a crash: the
        model sees each result once). `call_id`: the provider tool call it answers."""
        task = self._tasks.own(agent, thread)
        if seq and seq in task.restored:
            return False
        turn = Turn(NOTICE if notice else RESULT, content, source, xml, seq,
                    call_id=call_id, is_error=is_error)
        self.history.append(thread, turn)
        self._working(task, thread, turn)
        return True

    async def restore(self, agent: str, thread: str) -> tuple[Turn, ...] | None:
        """Rebuild a task from its stored history (after a restart, with a durable
        history store); None if the thread has no task history."""
        self._tasks.claim(agent, thread)
        turns = tuple(await self.history.read(thread))
        if not turns or turns[0].kind != TASK:
            return None
        task = self._start(agent, thread, turns[0].content)
        for turn in turns[1:]:
            self._working(task, thread, turn, persist=False)
        task.restored = frozenset(t.seq for t in turns if t.kind == RESULT and t.seq)
        task.context.adopt(await self.segments.load(thread))
        for seg in task.context.segments:
            self.segments.put(thread, self.conversation(thread), agent, seg)
        return turns

    async def read_history(self, agent: str, thread: str) -> tuple[Turn, ...]:
        self._tasks.own(agent, thread)
        return tuple(await self.history.read(thread))

    def end(self, agent: str, thread: str) -> None:
        self._tasks.own(agent, thread)
        self._tasks.remove(thread)
        self.history.drop(thread)

    def conversation(self, thread: str) -> str:
        """The client's thread UUID (the root frame's) that the task on `thread` serves:
        the UUID logs and audit records name, the one the client and the operator
        know. `thread` itself when no registry is bound or the frame is gone."""
        scope = self._resolve(thread) if self._resolve is not None else None
        return scope.conversation if scope is not None else thread

    def _audit(self, kind: str, thread: str, fields: Mapping[str, Any]) -> None:
        # Recorded under the client's thread; the task's own frame rides along.
        conversation = self.conversation(thread)
        if conversation != thread:
            fields = {**fields, "frame": thread}
        self._audit_sink(kind, conversation, fields)

    def _scopes(self, agent: str, thread: str) -> list[Scope]:
        conversation = self._conversation_scope(thread)
        name = conversation.name.removeprefix("conversation:")
        return [Scope(f"agent:{agent}:{name}", self._agents[agent].token_budget), conversation]

    def _conversation_scope(self, thread: str) -> Scope:
        """The budget of the client conversation `thread` serves (its profile's)."""
        scope = self._resolve(thread) if self._resolve is not None else None
        if scope is None:
            return Scope(f"conversation:{thread}", None)
        return Scope(f"conversation:{scope.conversation}", scope.token_budget)

    async def assemble(self, agent: str, thread: str) -> tuple[AssembledContext, AgentPrompt]:
        """The six layers for the thread's next call with the segments at their
        current tiers, validated (`complete` runs the librarian first: `arrange`)."""
        task = self._tasks.own(agent, thread)
        assembly = self._assembly
        return assembly.assemble(agent, thread, task, await assembly.recall(agent, thread, task))

    # ---- the librarian's pass -----------------------------------------------------------

    async def arrange(self, agent: str, thread: str) -> tuple[AssembledContext, AgentPrompt]:
        """The thread's next request, after the librarian's pass (`Assembly.arrange`);
        the segments results grew since the last call are written first."""
        task = self._tasks.own(agent, thread)
        self._save(task, thread)
        return await self._assembly.arrange(agent, thread, task)

    def offered_tools(self, agent: str) -> tuple[ToolSpec, ...]:
        """The provider tools sent with `agent`'s requests (native tool calling; none
        with `tool_calling: xml`)."""
        return self._registry.get(agent).provider_tools

    async def _summarise(self, agent: str, thread: str, seg: Segment) -> str:
        meter = Meter(agent, thread, self._scopes(agent, thread), audit="summary",
                      fields={"segment": seg.id}, failed="fallback")
        return await summarise(self._metered, meter, self._agents[agent].context.summarizer,
                               self.config.name, seg)

    async def unfold(self, agent: str, thread: str, segment_ids: Sequence[int]) -> list[str]:
        """The agent asked for segments back: each is expanded for its next call.
        Returns notices for ids that name no segment of this task."""
        task = self._tasks.own(agent, thread)
        notices: list[str] = []
        for sid in segment_ids:
            seg = task.context.memory.get(sid)
            if seg is None:
                notices.append(f"huh invalid-payload: there is no segment {sid} in this task.")
                continue
            task.context.pin(sid)
        return notices

    async def complete(self, agent: str, thread: str) -> Completion:
        """One model turn for the thread: arrange, validate, budget, call, account."""
        ctx, prompt = await self.arrange(agent, thread)
        cfg = self._agents[agent]
        request = LlmRequest(
            system=ctx.system,
            messages=ctx.messages,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
            nonce=ctx.nonce,
            agent=agent, organism=self.config.name,
            tools=prompt.provider_tools, tools_optional=cfg.tool_calling == AUTO,
        )
        meter = Meter(agent, thread, self._scopes(agent, thread),
                      fields={"prompt_sha256": prompt.sha256})
        preview = self._preview(agent, thread)
        try:
            request, response = await self._metered(request, meter, prefer=cfg.model,
                                                    sink=preview)
        except BudgetExceeded as exc:
            self._audit("budget-exceeded", thread, {
                "agent": agent, "scope": exc.scope, "limit": exc.limit, "spent": exc.spent,
            })
            raise
        except BaseException:
            if preview is not None:
                preview.close(interrupted=True)
            raise
        if preview is not None:  # `final` before the answer is even validated
            preview.close()
        if thread in self._tasks:  # what was unfolded has been shown
            self._tasks[thread].context.unpin()
        if not response.cached:
            self.tokens.observe(response.backend, -(-request_bytes(
                request.system, request.messages, request.tools) // 4), response.input_tokens)
        # The reply's calls are durable with it: after a crash they are sent under the
        # same ids or not at all, never asked for again.
        calls = () if response.without_tools else response.calls
        turn = Turn(ASSISTANT, response.text, calls=calls)
        self.history.append(thread, turn)
        self._working(self._tasks[thread], thread, turn)
        return Completion(
            response.text, response.input_tokens, response.output_tokens, response.backend,
            response.cached, request.key, response.transport_s, calls,
        )

    async def fill(
        self, thread: str, system: str, data: str, backend: str, max_tokens: int = 1024
    ) -> Completion:
        """One call for semantic routing's form filler (not an agent: no task, no
        history; `fill_form`), counted and audited like an agent's call."""
        return await fill_form(self._metered, self._conversation_scope(thread), thread,
                               self.config.name, system, data, backend, max_tokens)

    def _report(self, agent: str, thread: str, event: SecurityEvent,
                seen: set[tuple[str, str, str]]) -> None:
        mark = (event.kind, event.source, event.detail)
        if mark in seen:
            return
        seen.add(mark)
        metrics.security_events.labels(f"llm-{event.kind}").inc()
        log.warning("security event kind=%s agent=%s %s layer=%d source=%s detail=%s",
                    event.kind, agent, log_ids(self.conversation(thread), thread),
                    event.layer, event.source, event.detail)
        self._audit(SECURITY, thread, {
            "event": event.kind, "agent": agent, "layer": int(event.layer),
            "source": event.source, "detail": event.detail,
        })


class AgentSession:
    """An agent's handle on the platform: its own name bound in; no prompt, no router,
    no other agent's threads."""

    __slots__ = ("_platform", "agent")

    def __init__(self, platform: Platform, agent: str) -> None:
        self._platform = platform
        self.agent = agent

    @property
    def config(self) -> AgentConfig:
        return self._platform._agents[self.agent]

    @property
    def catalogue(self) -> ToolCatalogue:
        """The payloads this agent may emit (public: they are its peers' schemas)."""
        return self._platform.prompt(self.agent).catalogue

    def begin(self, thread: str, task_xml: str, *, again: bool = False) -> None:
        self._platform.begin(self.agent, thread, task_xml, again=again)

    def record(
        self, thread: str, content: str, *, source: str, xml: bool = False, notice: bool = False,
        seq: int = 0, call_id: str = "", is_error: bool = False,
    ) -> bool:
        return self._platform.record(self.agent, thread, content, source, xml, notice, seq,
                                     call_id, is_error)

    async def restore(self, thread: str) -> tuple[Turn, ...] | None:
        return await self._platform.restore(self.agent, thread)

    async def complete(self, thread: str) -> Completion:
        return await self._platform.complete(self.agent, thread)

    async def unfold(self, thread: str, segment_ids: Sequence[int]) -> list[str]:
        return await self._platform.unfold(self.agent, thread, segment_ids)

    async def history(self, thread: str) -> Sequence[Turn]:
        return await self._platform.read_history(self.agent, thread)

    def end(self, thread: str) -> None:
        self._platform.end(self.agent, thread)

    def on_task_end(self, hook: TaskEndHook) -> None:
        """Call `hook(thread)` when one of this agent's tasks is ended by the
        platform because its frame ended (not when the agent ends it itself)."""
        self._platform._tasks.on_end(self.agent, hook)

    def conversation(self, thread: str) -> str:
        return self._platform.conversation(thread)
