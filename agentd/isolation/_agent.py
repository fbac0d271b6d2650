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
  the answer, checked for type and bound; a lie harms only its own task;
- native tool calls are the daemon's: it decides the model's calls (payload or
  error result, recorded under its call id), keeps which are in flight, and gives
  the call it is running the ids that may go out now. The worker names those ids in
  its answer and the daemon sends its own payloads, each under its ref: an id not
  given to this call, or named twice, breaks the protocol, so each call id is sent
  at most once. A result is recorded under the call id its ref (the pump's) names
  (a refusal of the whole output: under each open call's, and the worker is told
  how many, so its count of results to come agrees); while calls are open the
  worker may send nothing else, so no payload of its own can pose as one.
Anything else (an unknown request, a wrong type, a second `begin`) breaks the
protocol: the worker is killed and replaced, the call gets `huh internal`.

The tool catalogue (the peers' schemas; generated classes, as for MCP servers and
federation peers, cannot be imported by a worker) crosses in INIT as XSD text.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lxml import etree

from agentd._core import Huh
from agentd._handler import HandlerMetadata, HandlerResponse, ResponseKind
from agentd._xmlify import XmlSpec
from agentd.isolation._protocol import MAX_TARGETS, ProtocolError, decode_answer, opt_bool
from agentd.llm import LlmError, ToolCall, ToolResult
from agentd.platform import (
    ASSISTANT,
    AddressedCall,
    AgentLoop,
    BudgetExceeded,
    HistoryFull,
    IsolationError,
    PeerTool,
    Phase,
    TaskState,
    Tool,
    ToolCatalogue,
    Turn,
    call_ref,
    decide,
    open_calls,
    peer_tools,
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
    # Native calls this call may send (call id -> the daemon's payload), each once.
    ready: dict[str, AddressedCall] = dataclasses.field(default_factory=dict)


# ---- the daemon's side -------------------------------------------------------------


@dataclass
class OpenCalls:
    """The native calls of a task's last reply that have no result yet, as the daemon
    keeps them for an isolated agent: all in flight at once, each under its ref, by
    which a result is matched to its call (`TaskState.answered`, as in process).
    `restored`: the task's history, when it was rebuilt after a restart."""

    state: TaskState  # only its calls in flight are used
    restored: tuple[Turn, ...] = ()

    @classmethod
    def of(cls, calls: Sequence[AddressedCall], restored: tuple[Turn, ...] = ()
           ) -> OpenCalls:
        state = TaskState()
        state.sent(calls)
        return cls(state, restored)

    @property
    def pending(self) -> int:
        return len(self.state.in_flight)


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
                 own_keys: Collection[str], max_fanout: int = 64) -> None:
        self.session = session
        self.platform = platform  # whose session this is (a reload may bring another)
        self.max_iterations = max_iterations
        self.max_fanout = max_fanout
        self.own_keys = frozenset(own_keys)
        self.iterations: dict[str, int] = {}  # model calls per live task
        self.states: dict[str, dict[str, Any]] = {}  # the worker's state per live task
        self.calls: dict[str, OpenCalls] = {}  # native calls of a task's last reply
        session.on_task_end(self._forget)

    def _forget(self, thread: str) -> None:
        self.iterations.pop(thread, None)
        self.states.pop(thread, None)
        self.calls.pop(thread, None)

    def open_tasks(self) -> int:
        return len(self.iterations.keys() | self.states.keys() | self.calls.keys())

    @functools.cached_property
    def tools(self) -> dict[str, PeerTool]:
        """Tool name -> peer, for the model's native calls (as in process)."""
        return peer_tools((t.peer, t.spec) for t in self.session.catalogue.tools
                          if not t.is_self)

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

    def answer(self, ctx: CallContext, header: dict[str, Any], body: bytes
               ) -> HandlerResponse | None:
        """The worker's ANSWER as the pump gets it: native calls named by id become the
        daemon's own payloads, addressed to their listeners."""
        self.answered(ctx, header)
        ids = header.get("calls")
        if ids is None:
            result = decode_answer(header, body)
            open_calls = self.calls.get(ctx.meta.thread_id)
            if (open_calls is not None and open_calls.pending and result is not None
                    and result.kind is not ResponseKind.ERROR):
                raise ProtocolError("output of its own while native calls are open")
            return result
        if (not isinstance(ids, list) or not 0 < len(ids) <= MAX_TARGETS or body
                or header.get("kind") != ResponseKind.SEND.value
                or header.get("to") is not None or header.get("targets")):
            raise ProtocolError("calls: not a list of call ids alone")
        if (not all(isinstance(i, str) and i in ctx.ready for i in ids)
                or len(set(ids)) != len(ids)):
            raise ProtocolError("calls: an id this call was not given, or named twice")
        sent = [ctx.ready.pop(i) for i in ids]
        return HandlerResponse.addressed(b"".join(c.payload for c in sent),
                                         [c.to for c in sent], [c.ref for c in sent])

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
            return self._record(ctx, thread), b""
        elif op == "complete":
            done = self.iterations.get(thread)
            if done is None:
                raise IsolationError(f"no task on {thread}")
            if done >= self.max_iterations:
                return {"error": "budget"}, b""
            self.iterations[thread] = done + 1
            completion = await session.complete(thread)
            if not completion.calls:
                return {}, completion.text.encode()
            return {"native": self._native(ctx, thread, completion.calls)}, \
                completion.text.encode()
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
            found: dict[str, Any] = {"found": True}
            calls = self._restored_calls(turns)
            if calls is not None:
                self.calls[thread] = calls
                found["open"] = calls.pending
            return found, json.dumps([[t.kind, t.content] for t in turns]).encode()
        elif op == "end":
            self._forget(thread)
            session.end(thread)
        else:
            raise ProtocolError("unknown request")
        return {}, b""

    # ---- native calls: decided, matched and resent here, never by the worker --------

    def _native(self, ctx: CallContext, thread: str, calls: Sequence[ToolCall]
                ) -> dict[str, Any]:
        """The model's native calls, as `AgentLoop` handles them in process: each
        decided, the error results recorded under their ids, every call that passed
        ready for this call to send, each under its ref."""
        reply = self.iterations.get(thread, 0)  # this reply's number (counted in complete)
        decided: list[AddressedCall | ToolResult] = [
            decide(c, self.tools, call_ref(reply, i)) for i, c in enumerate(calls)]
        if len(calls) > self.max_fanout:
            decided = [ToolResult(c.id, f"error: {len(calls)} calls in one reply; at most "
                       f"{self.max_fanout} are allowed. Nothing was sent.", True) for c in calls]
        errors = [d for d in decided if isinstance(d, ToolResult)]
        addressed = [d for d in decided if isinstance(d, AddressedCall)]
        for e in errors:
            self.session.record(thread, e.content, source="platform", call_id=e.call_id,
                                is_error=True)
        if addressed:
            self.calls[thread] = OpenCalls.of(addressed)
        else:  # only errors: the model reads them in its next turn
            self.calls.pop(thread, None)
        ctx.ready.update((c.call_id, c) for c in addressed)
        return {"calls": len(addressed), "errors": len(errors),
                "send": [c.call_id for c in addressed]}

    def _record(self, ctx: CallContext, thread: str) -> dict[str, Any]:
        """Record the call's result under the call id its ref names (the pump's, from
        the call's frame); a message that answers no open call is not recorded."""
        meta, calls = ctx.meta, self.calls.get(thread)
        source, content, xml = render_result(ctx.payload, meta.from_id)
        if (calls is not None and calls.restored and meta._seq
                and any(t.seq == meta._seq for t in calls.restored)):
            # Redelivered after a crash: its result is in the history; what its handling
            # sent never committed, so the same calls go again, under their ids.
            again = self._resent(calls, meta._seq)
            ctx.ready.update((c.call_id, c) for c in again)
            return {"duplicate": True, "send": [c.call_id for c in again]}
        huh = isinstance(ctx.payload, Huh)
        ids = [""] if calls is None else calls.state.answered(
            meta._ref, huh and meta.from_id == "core", meta.from_id)
        if ids is None:
            log.warning("isolated agent %s: a reply from %s answers no call in flight "
                        "thread=%s, ignored", self.session.agent, meta.from_id, thread)
            return {"duplicate": True}
        recorded = 0
        for call_id in ids or [""]:
            recorded += self.session.record(thread, content, source=source, xml=xml,
                                            seq=meta._seq, call_id=call_id,
                                            is_error=call_id != "" and huh)
        if calls is not None and calls.pending <= 0:
            del self.calls[thread]
        if not recorded:
            return {"duplicate": True}  # in the restored history
        # Several: a refusal of the whole output, each open call's result; the worker
        # counts them all, or its task would wait for results that never come.
        return {} if recorded == 1 else {"results": recorded}

    def _restored_calls(self, turns: Sequence[Turn]) -> OpenCalls | None:
        """The native calls in flight of a restored task (None: its last reply made
        none), as a restarted in-process agent finds them."""
        last = max((i for i, t in enumerate(turns) if t.kind == ASSISTANT), default=-1)
        if last < 0 or not turns[last].calls:
            return None
        return OpenCalls.of(open_calls(turns, last, self.tools), tuple(turns))

    def _resent(self, calls: OpenCalls, seq: int) -> list[AddressedCall]:
        """What handling message `seq` sent, to send again: the calls of the reply
        made after it that are in flight (a result alone sends nothing)."""
        turns = calls.restored
        at = next(i for i, t in enumerate(turns) if t.seq == seq)
        last = max(i for i, t in enumerate(turns) if t.kind == ASSISTANT)
        if last > at:
            return [c for c in open_calls(turns, last, self.tools)
                    if c.ref in calls.state.in_flight]
        return []


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
class NativeReply:
    """The daemon's account of a reply with native calls (it decided them): how many
    passed and wait for a result, how many were answered with their error, and
    whether some go out with this call."""

    calls: int
    errors: int
    send: bool


@dataclass(frozen=True)
class _Completion:
    text: str
    calls: tuple[NativeReply, ...] = ()  # one, when the model made native calls


# What a worker returns to send the native calls it was given: the ids cross in the
# answer's header, the payloads are the daemon's.
SEND_CALLS = HandlerResponse.addressed(b"", ())


class WorkerSession:
    """The worker's stand-in for `AgentSession`: every call a request to the daemon,
    which knows the thread (the call's) by itself."""

    def __init__(self, ask: Ask, catalogue: ToolCatalogue) -> None:
        self._ask = ask
        self.catalogue = catalogue
        self.ready: list[str] = []  # native call ids the daemon gave the running call
        self.restored_open: int | None = None  # native calls open in a restored task
        self.results = 1  # results the daemon recorded for the last `record`

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
        self.ready.extend(header.get("send") or ())
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
        """The daemon records the call's own result (neither `content`, `seq` nor
        `call_id` is sent: it has the first two and matches the call itself): False
        when its restored history holds it already. A native call that may go now
        (it waited for this result) is in `ready`."""
        header, _ = self._request("record", {"notice": notice},
                                  content.encode() if notice else b"")
        results = header.get("results", 1)
        self.results = results if type(results) is int and 1 <= results <= MAX_PENDING else 1
        return header.get("duplicate") is not True

    async def restore(self, thread: str) -> tuple[Turn, ...] | None:
        header, body = self._request("restore")
        if not header.get("found"):
            return None
        self.restored_open = header.get("open")
        return tuple(Turn(kind, content) for kind, content in json.loads(body))

    async def complete(self, thread: str) -> _Completion:
        header, body = self._request("complete")
        native = header.get("native")
        if native is None:
            return _Completion(body.decode())
        self.ready.extend(native["send"])
        return _Completion(body.decode(), (NativeReply(native["calls"], native["errors"],
                                                       bool(native["send"])),))

    async def unfold(self, thread: str, segment_ids: Any) -> list[str]:
        return list(json.loads(self._request("unfold", {"segments": list(segment_ids)})[1]))

    def end(self, thread: str) -> None:
        self._request("end")


class WorkerLoop(AgentLoop):
    """`AgentLoop` in a worker: the daemon decides, matches and resends native calls;
    the loop here keeps only the task's phase and counters."""

    def _arrived(self, state: TaskState) -> None:
        state.result_arrived(cast(WorkerSession, self.session).results)

    def _native(self, thread: str, state: TaskState, calls: Sequence[Any]
                ) -> HandlerResponse | None:
        (reply,) = calls
        state.thought(reply.calls, reply.errors)
        return SEND_CALLS if reply.send else None

    async def _restore(self, thread: str) -> TaskState | None:
        session = cast(WorkerSession, self.session)
        session.restored_open = None
        state = await super()._restore(thread)
        open_calls = session.restored_open
        if state is not None and open_calls is not None:  # its last reply was native
            state.phase = Phase.WAITING if open_calls else Phase.THINKING
            state.pending = open_calls
        return state


class WorkerAgent:
    """The handler a worker runs for an isolated agent: `WorkerLoop` on a
    `WorkerSession`, its task state taken from the call and handed back."""

    def __init__(self, init: Mapping[str, Any], own_classes: tuple[type, ...], ask: Ask) -> None:
        self.session = WorkerSession(ask, catalogue_of(init["catalogue"]))
        self.loop = WorkerLoop(init["name"], cast("AgentSession", self.session),
                               max_iterations=init["max_iterations"],
                               own_classes=own_classes, max_fanout=init["max_fanout"])
        self.sending: list[str] = []  # the native calls this answer sends

    def enter(self, thread: str, state: Mapping[str, Any] | None) -> None:
        self.loop.tasks.clear()
        self.session.ready.clear()
        self.sending = []
        if state is not None:
            self.loop.tasks[thread] = TaskState(_PHASES[state["phase"]], state["iterations"],
                                                state["pending"])

    def leave(self, thread: str) -> dict[str, Any]:
        """What the answer's header carries besides the response: the task state (None
        once it finished) and the native calls it sends."""
        state = self.loop.tasks.pop(thread, None)
        self.loop.tasks.clear()
        out: dict[str, Any] = {"state": None if state is None or state.phase is Phase.FINISHED
                               else {"phase": state.phase.value,
                                     "iterations": state.iterations,
                                     "pending": state.pending}}
        if self.sending:
            out["calls"] = self.sending
        return out

    async def __call__(self, payload: Any, meta: HandlerMetadata) -> HandlerResponse | None:
        result = await self.loop(payload, meta)
        ready, self.session.ready = self.session.ready, []
        if ready and (result is None or result is SEND_CALLS):
            self.sending = ready
            return SEND_CALLS
        return None if result is SEND_CALLS else result
