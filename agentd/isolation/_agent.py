"""LLM agents in workers: the agent's loop runs confined; the platform stays here.

An isolated agent's worker runs the same `AgentLoop` the daemon would, with a
session that is a proxy: each session call (begin, record, complete, unfold,
restore, end) is an ASK frame to the daemon, answered by a REPLY while the worker
waits (it runs one call at a time). The daemon's side, `AgentBridge`, answers with
the agent's real `AgentSession`, so the platform still owns the prompt, the
history, the budgets and every LLM call; the worker holds no credential and has
no network unless its `isolation:` grants one.

The worker is as untrusted as any handler (it parses the model's replies, which
is the point of running it apart). What its requests can do:
- act only on the task of the call it is running: the thread is the call's, never
  a field the worker sends; a request outside a call is a protocol error;
- `begin` only on a call that carries the agent's own task payload, once; the
  task recorded is the payload the daemon sent, not text from the worker;
- record a result only as the daemon's own rendering of the call's payload, once
  per call; the worker's own text enters the history only as a platform notice;
- call the model at most `max_iterations` times per task, counted here whatever
  the worker's bookkeeping says; budgets and the override checks are the
  platform's, as in process;
- its task state (phase and counters) goes out with each call and comes back with
  the answer, checked for type and bound; a lie harms only its own task.
Anything else (an unknown request, a wrong type, a second `begin`) breaks the
protocol: the worker is killed and replaced, the call gets `huh internal`.

The tool catalogue (the peers' schemas; generated classes, as for MCP servers and
federation peers, cannot be imported by a worker) crosses in INIT as XSD text.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lxml import etree

from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import XmlSpec
from agentd.isolation._protocol import ProtocolError, opt_bool
from agentd.llm import LlmError
from agentd.platform import (
    ASSISTANT,
    AgentLoop,
    BudgetExceeded,
    HistoryFull,
    IsolationError,
    Phase,
    TaskState,
    Tool,
    ToolCatalogue,
    Turn,
    render_result,
)

if TYPE_CHECKING:
    from agentd.platform import AgentSession

log = logging.getLogger("agentd.isolation.agent")

MAX_NOTICE_BYTES = 64 * 1024
MAX_SEGMENTS = 64
MAX_PENDING = 4096
_PHASES = {p.value: p for p in Phase}


@dataclass(eq=False)
class CallContext:
    """One call to an agent's worker, as the daemon sent it."""

    meta: HandlerMetadata
    key: str | None  # the payload's routing key; None for a core payload
    body: bytes  # the payload's XML
    payload: Any  # the validated payload object
    begun: bool = False
    recorded: bool = False


# ---- the daemon's side -------------------------------------------------------------


def catalogue_wire(catalogue: ToolCatalogue) -> dict[str, Any]:
    """The agent's tools, as INIT carries them (public: its peers' schemas)."""
    return {"tools": [{"peer": t.peer, "namespace": t.spec.namespace, "tag": t.spec.tag,
                       "xsd": t.spec.xsd, "example": t.spec.example.decode(),
                       "is_self": t.is_self} for t in catalogue.by_key.values()],
            "results": sorted(catalogue.result_keys)}


def checked_state(value: Any, max_iterations: int) -> dict[str, Any] | None:
    """A task state the worker sent back, or ProtocolError."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"phase", "iterations", "pending"}:
        raise ProtocolError("state: not a task state")
    phase, iterations, pending = value["phase"], value["iterations"], value["pending"]
    if (phase not in _PHASES or not _small_int(iterations, max_iterations)
            or not _small_int(pending, MAX_PENDING)):
        raise ProtocolError("state: a field out of bounds")
    return {"phase": phase, "iterations": iterations, "pending": pending}


def _small_int(value: Any, limit: int) -> bool:
    return type(value) is int and 0 <= value <= limit


class AgentBridge:
    """Answers one isolated agent's requests with its real session."""

    def __init__(self, session: AgentSession, platform: Any, max_iterations: int,
                 own_keys: Collection[str]) -> None:
        self.session = session
        self.platform = platform  # whose session this is (a reload may bring another)
        self.max_iterations = max_iterations
        self.own_keys = frozenset(own_keys)
        self.iterations: dict[str, int] = {}  # model calls per live task
        self.states: dict[str, dict[str, Any]] = {}  # the worker's state per live task
        session.on_task_end(self._forget)

    def _forget(self, thread: str) -> None:
        self.iterations.pop(thread, None)
        self.states.pop(thread, None)

    def open_tasks(self) -> int:
        return len(self.iterations.keys() | self.states.keys())

    @staticmethod
    def context(meta: HandlerMetadata, key: str | None, body: bytes, payload: Any
                ) -> CallContext:
        """The scope of one call's requests (the pool keeps it with the call)."""
        return CallContext(meta, key, body, payload)

    def call_fields(self, ctx: CallContext) -> dict[str, Any]:
        return {"state": self.states.get(ctx.meta.thread_id)}

    def answered(self, ctx: CallContext, header: Mapping[str, Any]) -> None:
        state = checked_state(header.get("state"), self.max_iterations)
        thread = ctx.meta.thread_id
        if state is None:
            self.states.pop(thread, None)
        elif thread in self.iterations:  # a live task (not one the worker invents)
            self.states[thread] = state

    async def ask(self, ctx: CallContext, header: dict[str, Any], body: bytes
                  ) -> tuple[dict[str, Any], bytes]:
        thread = ctx.meta.thread_id
        try:
            return await self._ask(ctx, thread, header, body)
        except (BudgetExceeded, HistoryFull) as exc:
            log.warning("isolated agent %s stopped thread=%s: %s",
                        self.session.agent, thread, exc)
            return {"error": "budget"}, b""
        except LlmError as exc:
            log.error("isolated agent %s: no completion thread=%s retry_allowed=%s: %s",
                      self.session.agent, thread, str(exc.retry_allowed).lower(), exc)
            return {"error": "llm", "retry": exc.retry_allowed}, b""
        except IsolationError:
            return {"error": "isolation"}, b""
        except ProtocolError:
            raise
        except Exception:  # an override violation, a bug: the task fails, loudly, here
            log.exception("isolated agent %s: request %r failed thread=%s",
                          self.session.agent, str(header.get("op"))[:32], thread)
            return {"error": "internal"}, b""

    async def _ask(self, ctx: CallContext, thread: str, header: dict[str, Any], body: bytes
                   ) -> tuple[dict[str, Any], bytes]:
        session, op = self.session, header.get("op")
        if op == "begin":
            if ctx.key not in self.own_keys or ctx.begun:
                raise ProtocolError("begin outside the first call of a task")
            ctx.begun = True
            session.begin(thread, ctx.body.decode(), again=ctx.meta.redelivered)
            self.iterations[thread] = 0
        elif op == "record" and opt_bool(header, "notice"):
            if len(body) > MAX_NOTICE_BYTES:
                raise ProtocolError("notice too long")
            session.record(thread, body.decode("utf-8", "replace"), source="platform",
                           notice=True)
        elif op == "record":
            if ctx.recorded or ctx.key in self.own_keys:
                raise ProtocolError("a result recorded that this call does not carry")
            ctx.recorded = True
            source, content, xml = render_result(ctx.payload, ctx.meta.from_id)
            if not session.record(thread, content, source=source, xml=xml,
                                  seq=ctx.meta._seq):
                return {"duplicate": True}, b""  # in the restored history already
        elif op == "complete":
            done = self.iterations.get(thread)
            if done is None:
                raise IsolationError(f"no task on {thread}")
            if done >= self.max_iterations:
                return {"error": "budget"}, b""
            self.iterations[thread] = done + 1
            return {}, (await session.complete(thread)).text.encode()
        elif op == "unfold":
            segments = header.get("segments")
            if (not isinstance(segments, list) or len(segments) > MAX_SEGMENTS
                    or not all(_small_int(s, 10**9) for s in segments)):
                raise ProtocolError("segments: not a list of segment numbers")
            return {}, json.dumps(await session.unfold(thread, segments)).encode()
        elif op == "restore":
            turns = await session.restore(thread)
            if turns is None:
                return {"found": False}, b""
            self.iterations[thread] = sum(t.kind == ASSISTANT for t in turns)
            return {"found": True}, json.dumps([[t.kind, t.content] for t in turns]).encode()
        elif op == "end":
            self._forget(thread)
            session.end(thread)
        else:
            raise ProtocolError("unknown request")
        return {}, b""


# ---- the worker's side -------------------------------------------------------------

Ask = Callable[[dict[str, Any], bytes], tuple[dict[str, Any], bytes]]


class _WireSpec:
    """What reading a reply needs of a peer's payload class, from its XSD text."""

    def __init__(self, namespace: str, tag: str, xsd: str, example: str) -> None:
        self.namespace, self.tag = namespace, tag
        self.clark = f"{{{namespace}}}{tag}"
        self.example = example.encode()
        self.schema = etree.XMLSchema(etree.fromstring(xsd.encode()))


def catalogue_of(wire: Mapping[str, Any]) -> ToolCatalogue:
    tools = [Tool(t["peer"], cast(XmlSpec, _WireSpec(t["namespace"], t["tag"], t["xsd"],
                                                     t["example"])), "", (), t["is_self"])
             for t in wire["tools"]]
    return dataclasses.replace(ToolCatalogue.of(tools), result_keys=frozenset(wire["results"]))


@dataclass(frozen=True)
class _Completion:
    text: str
    calls: tuple[Any, ...] = ()  # an isolated agent calls with XML: never native calls


class WorkerSession:
    """The worker's stand-in for `AgentSession`: every call a request to the daemon,
    which knows the thread (the call's) by itself."""

    def __init__(self, ask: Ask, catalogue: ToolCatalogue) -> None:
        self._ask = ask
        self.catalogue = catalogue

    def _request(self, op: str, fields: dict[str, Any] | None = None, body: bytes = b""
                 ) -> tuple[dict[str, Any], bytes]:
        header, reply = self._ask({"op": op, **(fields or {})}, body)
        error = header.get("error")
        if error == "budget":
            raise HistoryFull("the platform refused: budget or iteration cap")
        if error == "llm":
            exc = LlmError("no completion (the daemon's log says why)")
            exc.retry_allowed = bool(header.get("retry", True))
            raise exc
        if error is not None:
            raise IsolationError(str(error))
        return header, reply

    def on_task_end(self, hook: Callable[[str], None]) -> None:
        """Nothing to do here: the daemon's bridge forgets tasks that end."""

    def conversation(self, thread: str) -> str:
        return thread

    def begin(self, thread: str, task_xml: str, *, again: bool = False) -> None:
        self._request("begin")

    def record(self, thread: str, content: str, *, source: str, xml: bool = False,
               notice: bool = False, seq: int = 0, call_id: str = "",
               is_error: bool = False) -> bool:
        """The daemon records the call's own result (neither `content` nor `seq` is
        sent: it has both): False when its restored history holds it already. An
        isolated agent calls with XML: its results never carry a call id."""
        header, _ = self._request("record", {"notice": notice},
                                  content.encode() if notice else b"")
        return header.get("duplicate") is not True

    async def restore(self, thread: str) -> tuple[Turn, ...] | None:
        header, body = self._request("restore")
        if not header.get("found"):
            return None
        return tuple(Turn(kind, content) for kind, content in json.loads(body))

    async def complete(self, thread: str) -> _Completion:
        return _Completion(self._request("complete")[1].decode())

    async def unfold(self, thread: str, segment_ids: Any) -> list[str]:
        return list(json.loads(self._request("unfold", {"segments": list(segment_ids)})[1]))

    def end(self, thread: str) -> None:
        self._request("end")


class WorkerAgent:
    """The handler a worker runs for an isolated agent: `AgentLoop` on a
    `WorkerSession`, its task state taken from the call and handed back."""

    def __init__(self, init: Mapping[str, Any], own_classes: tuple[type, ...], ask: Ask) -> None:
        session = WorkerSession(ask, catalogue_of(init["catalogue"]))
        self.loop = AgentLoop(init["name"], cast("AgentSession", session),
                              max_iterations=init["max_iterations"],
                              own_classes=own_classes, max_fanout=init["max_fanout"])

    def enter(self, thread: str, state: Mapping[str, Any] | None) -> None:
        self.loop.tasks.clear()
        if state is not None:
            self.loop.tasks[thread] = TaskState(_PHASES[state["phase"]], state["iterations"],
                                                state["pending"])

    def leave(self, thread: str) -> dict[str, Any] | None:
        state = self.loop.tasks.pop(thread, None)
        self.loop.tasks.clear()
        if state is None or state.phase is Phase.FINISHED:
            return None
        return {"phase": state.phase.value, "iterations": state.iterations,
                "pending": state.pending}

    async def __call__(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse | None:
        return await self.loop(payload, meta)
