"""LLM agents: the handler the pump calls for a listener with an `agent:` block.

One task = one frame. The task payload arrives as a request and starts the task on
the frame's UUID; every tool result, `huh` or `ack` for the agent's calls comes back
to the same handler on the same UUID. The loop, as an explicit state machine:

    THINKING --model replied with calls-------------> WAITING (pending = n)
    THINKING --model replied, only refused calls----> THINKING (notices fed back)
    THINKING --model replied with prose only--------> FINISHED (respond: answer)
    THINKING --iteration cap / budget / no backend--> FINISHED (answer or huh)
    WAITING  --a result arrives, pending > 1--------> WAITING
    WAITING  --the last result arrives--------------> THINKING

An iteration is one model call; `max_iterations` counts them per task. Tool calls are
returned to the pump as raw XML (one payload element each), each addressed to the
listener it is for (`HandlerResponse.addressed`: two peers taking one payload class
never both get it): the pump routes them among the agent's peers and re-validates
them like any handler output; what it refuses comes back as `huh` on this frame, for
the model to correct. Blind self-iteration is a call to the agent's own root tag: it
runs a sub-task in a fresh frame (its own counter), whose answer comes back here as
a result.

Native tool calls (the provider's `tools`): each call is decided (`_calls.decide`)
into the payload for the listener its tool name maps to, or its error result, which
is recorded at once under its call id. The calls that pass go out together, each
under a ref (`_calls.call_ref`: the reply's number and the call's place in it) that
the pump carries on the call's frame and gives back with whatever answers it (its
answer, an ack or huh, an approval's denial): results are matched to calls by that
ref, never by the listener or anything a tool's output says, so two calls to one
listener run at once and a tool cannot answer for another call. A reply's calls are
in the task's durable history with it: after a crash, a message redelivered because
its handling never committed sends what that handling would have sent (the same
call ids and refs), and the model is not asked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import TYPE_CHECKING, Any

from agentd._core import Ack, Answer, Huh
from agentd._errors import GENERIC_MESSAGES, HuhCode
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._threads import log_ids
from agentd._xmlify import is_xmlified, to_xml
from agentd.llm import LlmError, ToolCall, ToolResult
from agentd.platform._budget import BudgetExceeded
from agentd.platform._calls import (
    AddressedCall,
    PeerTool,
    call_ref,
    decide,
    open_calls,
    peer_tools,
)
from agentd.platform._history import ASSISTANT, RESULT, HistoryFull, Turn
from agentd.platform._reply import parse_reply
from agentd.platform._scope import IsolationError, bounded_answer

if TYPE_CHECKING:  # the daemon's side only: an isolated agent's worker runs the loop
    from agentd.config import ListenerConfig, OrganismConfig
    from agentd.kernel import Kernel
    from agentd.platform._platform import AgentSession, Platform

log = logging.getLogger("agentd.platform.agent")

Handler = Callable[[Any, HandlerMetadata], Any]


class Phase(Enum):
    THINKING = "thinking"
    WAITING = "waiting"
    FINISHED = "finished"


@dataclass
class TaskState:
    phase: Phase = Phase.THINKING
    iterations: int = 0
    pending: int = 0
    # Native calls of the last reply sent and not yet answered: ref -> call id, and
    # ref -> the listener it went to.
    in_flight: dict[str, str] = field(default_factory=dict)
    callee: dict[str, str] = field(default_factory=dict)
    # A restored task: its history, for a message redelivered after a crash.
    restored: tuple[Turn, ...] = ()

    # transitions (pure: no I/O)

    def sent(self, calls: Sequence[AddressedCall]) -> None:
        """`calls` are the native calls in flight now (each under its ref)."""
        self.in_flight = {c.ref: c.call_id for c in calls}
        self.callee = {c.ref: c.to for c in calls}

    def result_arrived(self, results: int = 1) -> None:
        if self.phase is Phase.WAITING:
            self.pending -= results
            if self.pending <= 0:
                self.phase, self.pending = Phase.THINKING, 0

    def answered(self, ref: str, refused: bool, sender: str = "") -> list[str] | None:
        """The native calls a message back answers: the call in flight its `ref`
        names; every call in flight for `refused` without a ref (the pump refused the
        reply's output whole: none of it went out); [] for a message without a ref
        while no native call is in flight (an XML call's result). Without a ref from
        `sender` (a call a version before refs sent): the one call in flight to that
        listener, if exactly one is. None when it answers none of them (a second
        answer to a call, one for a call of an earlier reply)."""
        if not ref and not self.in_flight:
            return []
        if not ref and refused:
            ids = list(self.in_flight.values())
            self.in_flight.clear()
            self.callee.clear()
            return ids
        if not ref:
            to_sender = [r for r, to in self.callee.items() if to == sender]
            if len(to_sender) != 1:
                return None
            ref = to_sender[0]
        call_id = self.in_flight.pop(ref, None)
        self.callee.pop(ref, None)
        return None if call_id is None else [call_id]

    def may_think(self, max_iterations: int) -> bool:
        return self.phase is Phase.THINKING and self.iterations < max_iterations

    def thought(self, calls: int, notices: int) -> None:
        self.iterations += 1
        if calls:
            self.phase, self.pending = Phase.WAITING, calls
        elif not notices:
            self.phase = Phase.FINISHED

    def finish(self) -> None:
        self.phase = Phase.FINISHED


def cap_message(n: int) -> str:
    return (
        f"Stopped: this task used all {n} model turns it is allowed (max_iterations) "
        "without reaching a final answer."
    )


def render_result(payload: Any, from_id: str) -> tuple[str, str, bool]:
    """(source, content, is_xml) of something that came back to the agent."""
    source = "platform" if from_id == "core" else from_id
    if isinstance(payload, Huh):
        retry = "may retry" if payload.retry_allowed else "do not retry"
        return source, f"huh {payload.code.value}: {payload.message} ({retry})", False
    if isinstance(payload, Ack):
        return source, "(the call finished without returning a result)", False
    if isinstance(payload, Answer):
        return source, payload.text, False
    if is_xmlified(payload):
        return source, to_xml(payload).decode(), True
    return source, f"(an unreadable result of type {type(payload).__name__})", False


class AgentLoop:
    """The handler of one agent listener (callable). Per-task state is keyed by the
    frame UUID; the pump runs one message per frame at a time, so no locking."""

    def __init__(self, name: str, session: AgentSession, *, max_iterations: int,
                 own_classes: tuple[type, ...], max_fanout: int = 64) -> None:
        self.name = name
        self.session = session
        self.max_iterations = max_iterations
        self.max_fanout = max_fanout
        self.own_classes = own_classes
        self.tasks: dict[str, TaskState] = {}
        session.on_task_end(self._forget)

    @classmethod
    def of(cls, listener: ListenerConfig, session: AgentSession, max_fanout: int = 64
           ) -> AgentLoop:
        assert listener.agent is not None
        return cls(listener.name, session, max_iterations=listener.agent.max_iterations,
                   own_classes=tuple(listener.payload_classes), max_fanout=max_fanout)

    async def __call__(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse | None:
        thread = meta.thread_id
        state = self.tasks.get(thread)
        if state is None and not isinstance(payload, self.own_classes):
            state = await self._restore(thread)
            if state is None:
                log.info("agent %s: %s for a task that has ended, ignored",
                         self.name, type(payload).__name__)
                return None
        if state is None:
            self.session.begin(thread, to_xml(payload).decode(), again=meta.redelivered)
            state = self.tasks[thread] = TaskState()
        else:
            source, content, xml = render_result(payload, meta.from_id)
            if state.restored and meta._seq and any(
                    t.seq == meta._seq for t in state.restored):
                # Redelivered after a crash: its result is in the history already, and
                # what handling it sent never committed: send that again.
                return await self._resume(thread, state, meta._seq)
            huh = isinstance(payload, Huh)
            ids = state.answered(meta._ref, huh and meta.from_id == "core", meta.from_id)
            if ids is None:
                log.warning("agent %s: a reply from %s (ref %r) answers no call in flight "
                            "%s, ignored", self.name, meta.from_id, meta._ref,
                            self._ids(thread))
                return None
            try:
                for call_id in ids or [""]:
                    recorded = self.session.record(
                        thread, content, source=source, xml=xml, seq=meta._seq,
                        call_id=call_id, is_error=call_id != "" and huh)
                    if recorded:  # else: in the restored history, counted by _restore
                        self._arrived(state)
            except HistoryFull:
                return self._fail(thread, HuhCode.BUDGET_EXCEEDED)
            if state.phase is Phase.WAITING:
                return None  # more results to come
        return await self._think(thread, state)

    async def _think(self, thread: str, state: TaskState) -> HandlerResponse:
        session = self.session
        while True:
            if not state.may_think(self.max_iterations):
                return self._answer(thread, cap_message(self.max_iterations))
            try:
                completion = await session.complete(thread)
            except (BudgetExceeded, HistoryFull) as exc:
                log.warning("agent %s stopped %s: %s", self.name, self._ids(thread), exc)
                return self._fail(thread, HuhCode.BUDGET_EXCEEDED)
            except LlmError as exc:
                # Precise here, generic to the caller; whether asking again can help
                # (a replay miss cannot) is the error's to say.
                log.error("agent %s: no completion %s retry_allowed=%s: %s", self.name,
                          self._ids(thread), str(exc.retry_allowed).lower(), exc)
                return self._fail(thread, HuhCode.INTERNAL, exc.retry_allowed)
            except asyncio.CancelledError:  # the pump's handler timeout, or a stop
                self._end(thread)
                raise
            except Exception:  # an override violation, a bug: the task ends, loudly
                log.exception("agent %s: task failed %s", self.name, self._ids(thread))
                return self._fail(thread, HuhCode.INTERNAL)
            if completion.calls:
                sent = self._native(thread, state, completion.calls)
                if isinstance(sent, HandlerResponse):
                    return sent
                if state.phase is Phase.FINISHED:  # the history could take no more
                    return self._fail(thread, HuhCode.BUDGET_EXCEEDED)
                continue  # every call failed: the model reads the errors
            reply = parse_reply(completion.text, session.catalogue)
            calls, notices = list(reply.calls), list(reply.notices)
            if reply.unfolds:  # answered here, in the next turn: nothing goes out
                notices.extend(await session.unfold(thread, reply.unfolds))
            if len(calls) > self.max_fanout:
                notices.append(
                    f"huh too-large: {len(calls)} calls in one reply; at most "
                    f"{self.max_fanout} are allowed. Nothing was sent."
                )
                calls = []
            try:
                for notice in notices:
                    session.record(thread, notice, source="platform", notice=True)
            except HistoryFull:
                return self._fail(thread, HuhCode.BUDGET_EXCEEDED)
            state.thought(len(calls), len(notices) + len(reply.unfolds))
            if calls:
                return HandlerResponse.addressed(b"".join(calls), reply.to)
            if state.phase is Phase.FINISHED:
                return self._answer(thread, reply.text)

    def _arrived(self, state: TaskState) -> None:
        """A result was recorded (in a worker: as many as the daemon recorded)."""
        state.result_arrived()

    @cached_property
    def tools(self) -> dict[str, PeerTool]:
        """Tool name -> peer, for the native calls of this agent's model."""
        return peer_tools((t.peer, t.spec) for t in self.session.catalogue.tools
                          if not t.is_self)

    def _native(self, thread: str, state: TaskState, calls: Sequence[ToolCall]
                ) -> HandlerResponse | None:
        """The model's native calls: each decided; the error results recorded at once
        under their call ids, the rest sent together, each under its ref. None when
        nothing went out (the model reads the errors next turn)."""
        reply = state.iterations + 1  # this reply's number in the task's history
        decided: list[AddressedCall | ToolResult] = [
            decide(c, self.tools, call_ref(reply, i)) for i, c in enumerate(calls)]
        if len(calls) > self.max_fanout:
            decided = [ToolResult(c.id, f"error: {len(calls)} calls in one reply; at most "
                       f"{self.max_fanout} are allowed. Nothing was sent.", True) for c in calls]
        errors = [d for d in decided if isinstance(d, ToolResult)]
        addressed = [d for d in decided if isinstance(d, AddressedCall)]
        try:
            for e in errors:
                self.session.record(thread, e.content, source="platform", call_id=e.call_id,
                                    is_error=True)
        except HistoryFull:
            state.finish()
            return None
        state.thought(len(addressed), len(errors))
        state.sent(addressed)
        return self._send(addressed) if addressed else None

    @staticmethod
    def _send(calls: Sequence[AddressedCall]) -> HandlerResponse:
        return HandlerResponse.addressed(b"".join(c.payload for c in calls),
                                         [c.to for c in calls], [c.ref for c in calls])

    async def _resume(self, thread: str, state: TaskState, seq: int) -> HandlerResponse | None:
        """The message of journal seq `seq` came again: its handling did not commit, so
        what it sent never went out. Send it again from the history: the calls of a
        reply made after it (under their recorded ids and refs)."""
        turns = state.restored
        at = next(i for i, t in enumerate(turns) if t.seq == seq)
        last = max((i for i, t in enumerate(turns) if t.kind == ASSISTANT), default=-1)
        if last > at:  # the reply was made while handling it
            if turns[last].calls:
                return self._send([c for c in open_calls(turns, last, self.tools)
                                   if c.ref in state.in_flight])
            reply = parse_reply(turns[last].content, self.session.catalogue)
            return HandlerResponse.addressed(b"".join(reply.calls), reply.to) \
                if reply.calls and state.phase is Phase.WAITING else None
        if state.phase is Phase.THINKING:  # it was the last result: the model's turn
            return await self._think(thread, state)
        return None

    async def _restore(self, thread: str) -> TaskState | None:
        """A result for a task this process does not know: after a restart, rebuild the
        task from its durable history (iterations = replies so far; pending = calls of
        the last reply minus the results recorded since)."""
        turns = await self.session.restore(thread)
        if turns is None:
            return None
        replies = [i for i, t in enumerate(turns) if t.kind == ASSISTANT]
        state = TaskState(iterations=len(replies), restored=turns)
        if replies:
            last = replies[-1]
            if turns[last].calls:  # native: the calls without a result are open
                still_open = open_calls(turns, last, self.tools)
                state.sent(still_open)
                if still_open:
                    state.phase, state.pending = Phase.WAITING, len(still_open)
            else:
                calls = len(parse_reply(turns[last].content, self.session.catalogue).calls)
                done = sum(1 for t in turns[last + 1:] if t.kind == RESULT)
                if calls > done:
                    state.phase, state.pending = Phase.WAITING, calls - done
        log.info("agent %s: task restored %s iterations=%d pending=%d",
                 self.name, self._ids(thread), state.iterations, state.pending)
        self.tasks[thread] = state
        return state

    def _forget(self, thread: str) -> None:
        state = self.tasks.pop(thread, None)
        if state is not None:
            state.finish()

    def _end(self, thread: str) -> None:
        self._forget(thread)
        with contextlib.suppress(IsolationError):  # already ended
            self.session.end(thread)

    def _answer(self, thread: str, text: str) -> HandlerResponse:
        self._end(thread)
        return HandlerResponse.respond(Answer(text=bounded_answer(text)))

    def _fail(self, thread: str, code: HuhCode, retry_allowed: bool | None = None
              ) -> HandlerResponse:
        self._end(thread)
        return HandlerResponse.error(code, GENERIC_MESSAGES[code], retry_allowed=retry_allowed)

    def _ids(self, thread: str) -> str:
        return log_ids(self.session.conversation(thread), thread)


class AgentHandlers(dict[str, Handler]):
    """Listener name -> agent handler, for `Routing.build(..., agent_handlers=)`;
    `.platform` is the platform they share (bind it to the pump's thread registry
    with `platform.bind_threads(pump.registry)`, close it with `await
    platform.aclose()`)."""

    def __init__(self, handlers: dict[str, Handler], platform: Platform) -> None:
        super().__init__(handlers)
        self.platform = platform


def make_agent_handlers(
    config: OrganismConfig,
    platform: Platform | None = None,
    *,
    kernel: Kernel | None = None,
    audit: Callable[[str, Mapping[str, str]], None] | None = None,
    **platform_options: Any,
) -> AgentHandlers:
    """One handler per LLM agent of `config`.

    Give a `platform`, or let one be built from `config`: with a `kernel`, history
    goes to its context buffers and audit records to its journal (security events
    with direction `security`); else `audit(kind, fields)` (the daemon's form) gets
    them, with `thread` among the fields. Other options go to `Platform.from_config`.
    """
    from agentd.context import KernelSegmentLog, LongTermMemory, text_vectors
    from agentd.platform._audit import kernel_audit
    from agentd.platform._history import KernelHistoryStore
    from agentd.platform._platform import Platform

    if platform is None:
        if kernel is not None:
            platform_options.setdefault("history", KernelHistoryStore(kernel))
            platform_options.setdefault("audit", kernel_audit(kernel))
            platform_options.setdefault("segments", KernelSegmentLog(kernel))
            if "memory" not in platform_options:
                vectors = platform_options.get("vectors") or text_vectors(
                    config.embeddings, config.llm, **{k: platform_options[k] for k in (
                        "env",) if k in platform_options})
                platform_options["vectors"] = vectors
                platform_options["memory"] = LongTermMemory(vectors, kernel=kernel)
        elif audit is not None:
            platform_options.setdefault("audit", _two_argument_audit(audit))
        platform = Platform.from_config(config, **platform_options)
    handlers: dict[str, Handler] = {
        lst.name: AgentLoop.of(lst, platform.session(lst.name), config.pump.max_fanout)
        for lst in config.listeners
        if lst.agent is not None
    }
    return AgentHandlers(handlers, platform)


def _two_argument_audit(
    audit: Callable[[str, Mapping[str, str]], None],
) -> Callable[[str, str, Mapping[str, Any]], None]:
    def adapted(kind: str, thread: str, fields: Mapping[str, Any]) -> None:
        name = f"llm-{fields.get('event', kind)}" if kind == "security" else f"llm-{kind}"
        audit(name, {"thread": thread, **{k: str(v) for k, v in fields.items()}})

    return adapted
