"""Segments: the units an agent task's working memory (layer 5) is kept in.

A segment is a model reply (kind `reply`), a model reply that made tool calls
together with the results of those calls (`tool`: the call and its result fold and
evict together, so no result is ever shown without the call that asked for it), or a
notice the platform fed back (`notice`). Its parts are the turns it was made of; its
original bytes are the canonical encoding of those parts, hashed with SHA-256, so an
unfold can prove it restored exactly what was there.

Invariants: parts are only ever appended while the segment is the task's newest
reply (results arriving for its calls); a segment's original never changes after
that; `from_row` refuses a row whose original does not match its hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

REPLY, TOOL, NOTICE = "reply", "tool", "notice"
KINDS = (REPLY, TOOL, NOTICE)

# The kinds of the parts (the history's turn kinds).
ASSISTANT_PART, RESULT_PART, NOTICE_PART = "assistant", "result", "notice"


class Tier(StrEnum):
    EXPANDED = "expanded"
    FOLDED = "folded"
    EVICTED = "evicted"


class IntegrityError(Exception):
    """A segment's stored original does not match its hash."""


def estimate_tokens(nbytes: int) -> int:
    """The uncalibrated estimate: ceil(UTF-8 bytes / 4)."""
    return (nbytes + 3) // 4


@dataclass(frozen=True, slots=True)
class Part:
    kind: str  # assistant | result | notice
    content: str
    source: str = ""
    xml: bool = False


def encode_parts(parts: Sequence[Part]) -> bytes:
    """The canonical original of a segment: JSON lines, one part a line."""
    return b"\n".join(_encode_part(p) for p in parts)


def _encode_part(p: Part) -> bytes:
    return json.dumps([p.kind, p.source, p.xml, p.content], ensure_ascii=False,
                      separators=(",", ":")).encode("utf-8")


def decode_parts(original: bytes) -> tuple[Part, ...]:
    parts: list[Part] = []
    for line in original.decode("utf-8").split("\n"):
        kind, source, xml, content = json.loads(line)
        parts.append(Part(str(kind), str(content), str(source), bool(xml)))
    return tuple(parts)


@dataclass(slots=True)
class Segment:
    """One segment of a task. Mutable in its tier, relevance, summary and pin; its
    parts grow only while results for its calls arrive."""

    id: int
    kind: str
    parts: list[Part]
    tier: Tier = Tier.EXPANDED
    relevance: float = 1.0
    summary: str = ""
    _original: bytes | None = field(default=None, repr=False)

    @property
    def original(self) -> bytes:
        if self._original is None:
            self._original = encode_parts(self.parts)
        return self._original

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.original).hexdigest()

    @property
    def nbytes(self) -> int:
        return len(self.original)

    @property
    def tokens(self) -> int:
        return estimate_tokens(self.nbytes)

    @property
    def text(self) -> str:
        """What relevance and summaries read: the parts' contents."""
        return "\n".join(p.content for p in self.parts)

    def append(self, part: Part) -> None:
        self.parts.append(part)
        if self._original is not None:  # one more line: the others are not encoded again
            self._original += b"\n" + _encode_part(part)
        if part.kind == RESULT_PART and self.kind == REPLY:
            self.kind = TOOL

    def stub(self) -> str:
        """The one line an evicted segment leaves: id, kind and size, never content."""
        return (f"[segment {self.id}: {self.kind}, {self.nbytes} bytes, evicted; "
                f"send core unfold with segment {self.id} to see it again]")

    def row(self, thread: str, conversation: str, agent: str, ts: float
            ) -> tuple[object, ...]:
        """The kernel row (see the kernel's `segments` table)."""
        return (thread, self.id, conversation, agent, self.kind, self.tier.value,
                float(self.relevance), self.nbytes, self.tokens, self.sha256, self.summary,
                self.original, ts)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Segment:
        """A segment from a kernel row; raises IntegrityError if the original does not
        hash to the stored SHA-256."""
        (_thread, sid, _conv, _agent, kind, tier, relevance, _nbytes, _tokens, sha, summary,
         original, _ts) = row
        assert isinstance(original, bytes)
        if hashlib.sha256(original).hexdigest() != sha:
            raise IntegrityError(f"segment {sid}: the stored original does not match its hash")
        seg = cls(int(sid), str(kind), list(decode_parts(original)), Tier(str(tier)),
                  float(relevance), str(summary))
        seg._original = original
        return seg


def add_turn(segments: list[Segment], part: Part) -> Segment:
    """Place one turn: a reply starts a segment; a result joins the newest reply's
    segment (the reply that made the call); a notice is a segment of its own.
    Returns the segment that changed."""
    if part.kind == RESULT_PART:
        # Only notices (refused calls) come between a reply and its results, so the
        # search stops at the first segment that is not a notice.
        for seg in reversed(segments):
            if seg.kind == NOTICE:
                continue
            if seg.parts[0].kind == ASSISTANT_PART:
                seg.append(part)
                return seg
            break
    kind = {ASSISTANT_PART: REPLY, RESULT_PART: TOOL}.get(part.kind, NOTICE)
    seg = Segment(len(segments) + 1, kind, [part])
    segments.append(seg)
    return seg
