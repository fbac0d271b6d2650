"""The `core` payloads agentd itself emits (`accepted`, `huh`, `ack`, `answer`).

They are written by hand rather than with `@xmlify` because their element names
(`retry-allowed`) are not Python identifiers; `schemas/core.xsd` is their schema, and
these classes serialise straight to exclusive-C14N bytes that validate against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from lxml import etree

from agentd._errors import GENERIC_MESSAGES, RETRY_ALLOWED, HuhCode
from agentd._schemas import NS_CORE
from agentd._xml import escape_text

_X = "{" + NS_CORE + "}"
# Characters XML cannot carry (a model may write them): replaced in a preview.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass(frozen=True, slots=True)
class Accepted:
    thread: str
    seq: int
    tag: ClassVar[str] = "accepted"

    def to_bytes(self) -> bytes:
        return (
            f'<accepted xmlns="{NS_CORE}"><thread>{self.thread}</thread>'
            f"<seq>{self.seq}</seq></accepted>"
        ).encode()


@dataclass(frozen=True, slots=True)
class Huh:
    code: HuhCode
    message: str
    retry_allowed: bool
    tag: ClassVar[str] = "huh"

    @classmethod
    def of(
        cls, code: HuhCode, message: str | None = None, retry_allowed: bool | None = None
    ) -> Huh:
        """The `huh` for `code`: its generic message and retry flag unless given."""
        return cls(
            code,
            GENERIC_MESSAGES[code] if message is None else message,
            RETRY_ALLOWED[code] if retry_allowed is None else retry_allowed,
        )

    def to_bytes(self) -> bytes:
        retry = "true" if self.retry_allowed else "false"
        return (
            f'<huh xmlns="{NS_CORE}"><code>{self.code.value}</code>'
            f"<message>{escape_text(self.message)}</message>"
            f"<retry-allowed>{retry}</retry-allowed></huh>"
        ).encode()


@dataclass(frozen=True, slots=True)
class Ack:
    thread: str
    tag: ClassVar[str] = "ack"

    def to_bytes(self) -> bytes:
        return f'<ack xmlns="{NS_CORE}"><thread>{self.thread}</thread></ack>'.encode()


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    tag: ClassVar[str] = "answer"

    def to_bytes(self) -> bytes:
        return f'<answer xmlns="{NS_CORE}"><text>{escape_text(self.text)}</text></answer>'.encode()


@dataclass(frozen=True, slots=True)
class Partial:
    """A preview of a model's text (never validated, journaled or routed)."""

    stream: str
    seq: int
    text: str
    tag: ClassVar[str] = "partial"

    def to_bytes(self) -> bytes:
        return (f'<partial xmlns="{NS_CORE}"><stream>{self.stream}</stream>'
                f"<seq>{self.seq}</seq><text>{escape_text(_NOT_XML.sub(chr(0xfffd), self.text))}"
                "</text></partial>").encode()


@dataclass(frozen=True, slots=True)
class Final:
    """No more partials of `stream` will come; `interrupted`: it broke off."""

    stream: str
    last_seq: int
    interrupted: bool = False
    tag: ClassVar[str] = "final"

    def to_bytes(self) -> bytes:
        flag = "<interrupted>true</interrupted>" if self.interrupted else ""
        return (f'<final xmlns="{NS_CORE}"><stream>{self.stream}</stream>'
                f"<last-seq>{self.last_seq}</last-seq>{flag}</final>").encode()


@dataclass(frozen=True, slots=True)
class Step:
    """What an agent is doing, for the owning client (a preview like `partial`):
    `kind` is tool-call, tool-result, approval-wait, timer-wait or progress;
    `listener` the listener the step is about; `call` the id a call's steps share
    (progress has none); `payload` the call's C14N payload (tool-call only);
    `progress`, `total`, `message` an MCP server's progress notification."""

    kind: str
    listener: str
    call: str = ""
    payload: bytes | None = None
    progress: float | None = None
    total: float | None = None
    message: str | None = None
    tag: ClassVar[str] = "step"

    def to_bytes(self) -> bytes:
        parts = [f'<step xmlns="{NS_CORE}"><kind>{self.kind}</kind>'
                 f"<listener>{escape_text(self.listener)}</listener>"]
        if self.call:
            parts.append(f"<call>{escape_text(self.call)}</call>")
        if self.payload is not None:
            parts.append(f"<payload>{self.payload.decode()}</payload>")
        if self.progress is not None:
            parts.append(f"<progress>{self.progress:g}</progress>")
            if self.total is not None:
                parts.append(f"<total>{self.total:g}</total>")
            if self.message is not None:
                text = _NOT_XML.sub(chr(0xfffd), self.message[:MAX_STEP_MESSAGE])
                parts.append(f"<message>{escape_text(text)}</message>")
        parts.append("</step>")
        return "".join(parts).encode()


MAX_STEP_MESSAGE = 4096  # characters of a progress message passed on

CorePayload = Accepted | Huh | Ack | Answer


def core_from_element(el: etree._Element) -> CorePayload:
    """Build a core payload from an element already validated against core.xsd."""
    tag = el.tag
    kids = {c.tag: (c.text or "") for c in el}
    if tag == _X + "huh":
        return Huh(
            HuhCode(kids[_X + "code"].strip()),
            kids[_X + "message"],
            kids[_X + "retry-allowed"].strip() in ("true", "1"),
        )
    if tag == _X + "ack":
        return Ack(kids[_X + "thread"].strip())
    if tag == _X + "answer":
        return Answer(kids[_X + "text"])
    if tag == _X + "accepted":
        return Accepted(kids[_X + "thread"].strip(), int(kids[_X + "seq"]))
    raise ValueError(f"not a core payload: {tag}")
