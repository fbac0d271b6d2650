"""What travels through the pump: an admitted `Message` and what a client is told.

A `Message` is built only by admission (or recovery, through the same checks); every
field but `payload` is the pump's own, trusted, never taken from the envelope as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from lxml import etree

from agentd._errors import HuhCode
from agentd._routing import Listener
from agentd._threads import Frame
from agentd._xmlify import XmlSpec

# The sender name of the pump's own messages (ack, huh, accepted, meta answers).
CORE = "core"


class MsgKind(Enum):
    REQUEST = "request"  # routed by payload key; runs the callee in a child frame
    TO_HOLDER = "to-holder"  # a response, ack or huh for the holder of the frame
    INTENT = "intent"  # core `intent`: the pump's intent resolver picks and fills a payload


class Message:
    """A message admitted into the pump. Everything but `payload` is trusted."""

    __slots__ = (
        "call",
        "cause",
        "envelope",
        "frame",
        "hops",
        "kind",
        "payload",
        "redelivered",
        "ref",
        "sender",
        "seq",
        "spec",
        "targets",
    )

    def __init__(
        self,
        kind: MsgKind,
        sender: str,
        frame: Frame,
        payload: etree._Element,
        targets: tuple[Listener, ...],
        spec: XmlSpec | None,
        envelope: bytes,
        seq: int = 0,
        redelivered: bool = False,
    ) -> None:
        self.kind = kind
        self.sender = sender
        self.frame = frame
        self.payload = payload
        self.targets = targets  # REQUEST: the callees; TO_HOLDER: () for a client holder
        self.spec = spec  # None for core payloads
        self.envelope = envelope
        self.seq = seq  # its journal entry, 0 if not journaled (or no kernel)
        self.redelivered = redelivered
        self.hops = 0  # handler invocations on the causal chain before this message
        # The caller's reference of the call this request starts, or that this reply
        # (an answer, an ack or huh) is about: what the caller named it with
        # (`HandlerResponse.addressed(..., refs=)`), carried by the pump on the call's
        # frame and never read from a payload, so a callee cannot answer for another
        # call. Journaled in the entry's kind, kept on the frame's and an approval's
        # row: the same after a restart ("": none).
        self.ref = ""
        # With telemetry: the span whose work sent it (a handler's, an admission's),
        # the parent of the span of its handling. Never journaled.
        self.cause: object = None
        # A handler's request shown to the owning client as `step` frames: the id its
        # steps share ("" when none were shown). Never journaled.
        self.call = ""


@dataclass(frozen=True)
class SubmitResult:
    """What became of a client envelope: `seq` if accepted, else `code`."""

    thread: str
    seq: int | None = None
    code: HuhCode | None = None

    @property
    def accepted(self) -> bool:
        return self.code is None


# The one text of every unroutable intent, whether nothing matched or every match
# was outside the sender's profile: a sender learns nothing about what it cannot reach.
NO_CAPABILITY = "no matching capability in your profile"


@dataclass(frozen=True)
class IntentOutcome:
    """What became of a core `intent`: the filled payload (C14N bytes) for
    `listener`, or `payload` None (unroutable). `record` is the journal's account:
    the intent, the permitted ranking with its scores, the models tried."""

    payload: bytes | None
    listener: str | None
    record: bytes


class StepSink(Protocol):
    """Where the pump reports what a conversation's handlers do (core `step`
    frames for its owner, previews like `partial`: never journaled). `wanted`
    says whether the owner of `frame`'s conversation asked, or a listener on its
    path streams (the pump builds nothing otherwise)."""

    def wanted(self, frame: Frame) -> bool: ...

    def send(self, root: Frame, body: bytes, lossy: bool = False) -> None: ...


class IntentResolver(Protocol):
    """Ranks the listeners `sender` may reach from `frame` for the intent's text
    and fills the best one's payload (semantic routing). `sender_listener` is None
    for a client; never raises for a bad intent (it returns an unroutable outcome)."""

    async def resolve(
        self, text: str, sender: str, sender_listener: Listener | None, frame: Frame
    ) -> IntentOutcome: ...
