"""The client's calls as values: which frame belongs to which call, and what it means.

Sans-I/O: `Calls.feed(frame)` takes one envelope as the daemon sent it and returns
the call it belongs to (or None: a frame of a thread this client did not start,
such as an earlier process's answer replayed from the outbox) and the event it
makes; `Client` only moves bytes. Each call is a small state machine:

    SENT --accepted--> ACCEPTED --approval-required--> PARKED (--approval-required-->)
      |                   |                               |
      +-------------------+---- outcome (answer or huh) --+--> DONE

An outcome is any frame on the call's thread that is not `accepted` or
`approval-required`: the listener's response, core `ack`, core `answer`, or a
`huh` (raised as `Huh`). A refusal of bytes too broken to name a thread comes on
the nil thread: it goes to the oldest call sent on it (the daemon answers a
connection's frames in order). A frame from the daemon's outbox carries its
delivery seq (`<d:seq>`, increasing): `delivered` is the highest seen, and a frame
at or below it (resent after a reconnect) is a duplicate, fed as no event. New
kinds of frames (streamed previews, agent steps) are new events of the same feed,
not a new path.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from agentd import _core
from agentd._delivery import seq_of
from agentd._envelope import NIL_THREAD, parse_envelope
from agentd._errors import AgentdError, HuhCode
from agentd._schemas import NS_CORE
from agentd._states import step
from agentd._xml import c14n
from agentd._xmlify import class_for, from_xml

_CORE = "{" + NS_CORE + "}"
_ACCEPTED, _APPROVAL, _HUH = _CORE + "accepted", _CORE + "approval-required", _CORE + "huh"
_PARTIAL, _FINAL, _STEP = _CORE + "partial", _CORE + "final", _CORE + "step"


class Huh(AgentdError):
    """The daemon refused a call, or its handler failed: core `huh`. `code` is one
    of the core `huh` codes (`unroutable`, `invalid-payload`, `denied`, ...);
    `message` the daemon's text; `retry_allowed` whether sending it again may
    succeed. `thread` and `frame` (the envelope as received) locate it."""

    def __init__(self, code: str, message: str, retry_allowed: bool, *, thread: str = "",
                 frame: bytes = b"") -> None:
        super().__init__(f"huh {code}: {message}")
        self.code = code
        self.message = message
        self.retry_allowed = retry_allowed
        self.thread = thread
        self.frame = frame
        self.sender = "core"


@dataclass(frozen=True)
class Event:
    """Something the daemon said about a call. `frame` is the envelope as received."""

    thread: str
    sender: str
    frame: bytes = field(repr=False)


@dataclass(frozen=True)
class Accepted(Event):
    """The envelope passed every check and is durably journaled (`seq`)."""

    seq: int


@dataclass(frozen=True)
class ApprovalRequired(Event):
    """The message is parked until a human decides (`agentctl approve ID`, or this
    client's core `approve` when the gate allows it). The call goes on waiting."""

    approval: str
    listener: str
    payload: bytes
    payload_sha256: str
    expires: str


@dataclass(frozen=True)
class Answer(Event):
    """The call's outcome: the response `payload` (an @xmlify instance when its class
    is known in this process, else its C14N XML), `tag` its Clark name."""

    tag: str
    payload: Any
    xml: bytes = field(repr=False)

    @property
    def text(self) -> str | None:
        """The text of an LLM agent's core `answer`, else None."""
        if self.tag != _CORE + "answer":
            return None
        el = parse_envelope(self.frame).payload
        return "".join(c.text or "" for c in el)


@dataclass(frozen=True)
class Partial(_core.Partial, Event):
    """The next piece of a model's text while it writes (a preview: the answer, when
    it comes, is what counts): the core `partial` frame as received (`stream`, `seq`
    counting from 1 within it, `text`) with the envelope it came in."""


@dataclass(frozen=True)
class Final(_core.Final, Event):
    """No more partials of `stream` will come (`last_seq`; `interrupted`: it broke
    off, and a new stream may follow): the core `final` frame as received."""


@dataclass(frozen=True)
class Step(_core.Step, Event):
    """What an agent is doing (a preview): the core `step` frame as received, with
    the envelope it came in. `kind` is `tool-call`, `tool-result`, `approval-wait`,
    `timer-wait` or `progress`; `listener` the listener it is about; `call` the id a
    call's steps share. `payload` (C14N) is the call's payload for a `tool-call`;
    `progress`, `total` and `message` an MCP tool's progress report."""

    def describe(self) -> str:
        """The step in words, one line (`agentd send --stream` writes it to stderr,
        `mcp-serve` makes it a progress message)."""
        if self.kind == "progress":
            total = f"/{self.total:g}" if self.total is not None else ""
            said = f": {self.message}" if self.message else ""
            return f"progress of {self.listener}: {self.progress or 0:g}{total}{said}"
        what = {"tool-call": "calls", "tool-result": "answered:",
                "approval-wait": "waits for approval of a call to",
                "timer-wait": "waits on its timer:"}.get(self.kind, self.kind)
        return f"{what} {self.listener}" + (f" (call {self.call})" if self.call else "")


@dataclass(frozen=True)
class Other(Event):
    """A frame of a thread this client did not start (for instance an answer an
    earlier process left in the outbox): not any call's."""

    tag: str


class CallState(enum.Enum):
    SENT = "sent"
    ACCEPTED = "accepted"
    PARKED = "parked"
    DONE = "done"


class CallEvent(enum.Enum):
    ACCEPTED = "accepted"
    PARKED = "approval-required"
    PREVIEW = "preview"  # partial or final: the call goes on
    OUTCOME = "outcome"


_S, _E = CallState, CallEvent
# SENT also takes approval-required and an outcome: after a reconnect the `accepted`
# may be gone (it is not kept in the outbox); PARKED takes approval-required again
# (an agent's next gated call on the same thread).
TRANSITIONS: dict[CallState, dict[CallEvent, CallState]] = {
    _S.SENT: {_E.ACCEPTED: _S.ACCEPTED, _E.PARKED: _S.PARKED, _E.PREVIEW: _S.SENT,
              _E.OUTCOME: _S.DONE},
    _S.ACCEPTED: {_E.PARKED: _S.PARKED, _E.PREVIEW: _S.ACCEPTED, _E.OUTCOME: _S.DONE},
    _S.PARKED: {_E.PARKED: _S.PARKED, _E.PREVIEW: _S.PARKED, _E.OUTCOME: _S.DONE},
    _S.DONE: {},
}


@dataclass
class Call:
    thread: str
    state: CallState = CallState.SENT


class Calls:
    """The calls in flight, by thread (insertion order: the order they were sent)."""

    def __init__(self) -> None:
        self._open: OrderedDict[str, list[Call]] = OrderedDict()
        self.delivered = 0  # the highest delivery seq received
        # Streams not yet final: the last partial seq received, and its thread (a
        # resumed connection asks for the rest).
        self.streams: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._open.values())

    def start(self, thread: str) -> Call:
        call = Call(thread)
        self._open.setdefault(thread, []).append(call)
        return call

    def forget(self, call: Call) -> None:
        """A call given up (timed out or cancelled): its later frames are `Other`."""
        calls = self._open.get(call.thread)
        if calls is not None and call in calls:
            calls.remove(call)
            if not calls:
                del self._open[call.thread]

    def feed(self, frame: bytes) -> tuple[Call | None, Event | Huh | None]:
        """The call `frame` belongs to (None if none) and what it says; (None, None)
        for a duplicate. Raises `AgentdError` for a frame that is not an envelope."""
        env = parse_envelope(frame, max_bytes=max(len(frame), 1))
        seq = seq_of(env)
        if seq is not None:
            if seq <= self.delivered:
                return None, None
            self.delivered = seq
        tag = env.payload.tag if isinstance(env.payload.tag, str) else "?"
        thread, sender = env.thread, env.sender
        calls = self._open.get(thread, ())
        kind = CallEvent.OUTCOME
        if sender == "core" and tag == _ACCEPTED:
            kind = CallEvent.ACCEPTED
        elif sender == "core" and tag == _APPROVAL:
            kind = CallEvent.PARKED
        elif sender == "core" and tag == _STEP:
            kind = CallEvent.PREVIEW
        elif sender == "core" and tag in (_PARTIAL, _FINAL):
            kind = CallEvent.PREVIEW
            kids = _children(env.payload)
            stream = kids.get("stream", "")
            if tag == _PARTIAL:
                seq = int(kids.get("seq", "0") or 0)
                if seq <= self.streams.get(stream, ("", 0))[1]:
                    return None, None  # sent again after a resume: had it
                self.streams[stream] = (thread, seq)
                self.streams.move_to_end(stream)
                while len(self.streams) > 256:
                    self.streams.popitem(last=False)
            else:
                self.streams.pop(stream, None)
        # The oldest call on the thread this frame can move (several calls may share
        # a thread: `agentd send --thread`).
        call = next((c for c in calls if kind in TRANSITIONS[c.state]), None)
        if call is None:
            return None, Other(thread, sender, frame, tag)
        call.state = step("call", TRANSITIONS, call.state, kind)
        if kind is CallEvent.PREVIEW:
            kids = _children(env.payload)
            if tag == _STEP:
                return call, _step(thread, sender, frame, env.payload, kids)
            if tag == _PARTIAL:
                text = next((c.text or "" for c in env.payload if _local(c.tag) == "text"), "")
                return call, Partial(thread, sender, frame, kids.get("stream", ""),
                                     int(kids.get("seq", "0") or 0), text)
            return call, Final(thread, sender, frame, kids.get("stream", ""),
                               int(kids.get("last-seq", "0") or 0),
                               kids.get("interrupted", "") in ("true", "1"))
        if kind is CallEvent.ACCEPTED:
            kids = _children(env.payload)
            return call, Accepted(thread, sender, frame, int(kids.get("seq", "0") or 0))
        if kind is CallEvent.PARKED:
            kids = _children(env.payload)
            # The parked payload's exact C14N bytes, carried as text.
            held = next((c for c in env.payload if _local(c.tag) == "payload"), None)
            inner = (held.text or "").encode() if held is not None else b""
            return call, ApprovalRequired(
                thread, sender, frame, kids.get("approval", ""), kids.get("listener", ""),
                inner, kids.get("payload-sha256", ""), kids.get("expires", ""))
        event: Event | Huh
        self.forget(call)
        if sender == "core" and tag == _HUH:
            kids = _children(env.payload)
            event = Huh(kids.get("code", HuhCode.INTERNAL.value), kids.get("message", ""),
                        kids.get("retry-allowed", "") in ("true", "1"), thread=thread,
                        frame=frame)
        else:
            xml = c14n(env.payload)
            event = Answer(thread, sender, frame, tag, typed(tag, xml), xml)
        return call, event


def _step(thread: str, sender: str, frame: bytes, el: Any, kids: dict[str, str]) -> Step:
    held = next((c for c in el if _local(c.tag) == "payload"), None)
    payload = c14n(held[0]) if held is not None and len(held) else None
    return Step(thread, sender, frame, kids.get("kind", ""), kids.get("listener", ""),
                kids.get("call", ""), payload, _number(kids.get("progress")),
                _number(kids.get("total")), kids.get("message"))


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def typed(tag: str, xml: bytes) -> Any:
    """`xml` as an instance of the one @xmlify class of this process for `tag`, or
    the bytes themselves (no such class, several, or it does not validate)."""
    cls = class_for(tag)
    if cls is None:
        return xml
    try:
        return from_xml(cls, xml)
    except AgentdError:
        return xml


def _local(tag: Any) -> str:
    return tag.rsplit("}", 1)[-1] if isinstance(tag, str) else ""


def _children(el: Any) -> dict[str, str]:
    return {_local(c.tag): (c.text or "").strip() for c in el}


__all__ = [
    "NIL_THREAD", "Accepted", "Answer", "ApprovalRequired", "Call", "CallState", "Calls",
    "Event", "Final", "Huh", "Other", "Partial", "Step", "typed",
]
