"""The platform's side of an agent task's working memory (layer 5).

`TaskContext` pairs the task's segments (`agentd.context.WorkingMemory`) with what
the prompt shows of each: the prepared fragments of an expanded segment (neutralised
once, when its turn arrived), the spotlighted summary of a folded one, the stub of an
evicted one. It keeps each segment's size at every tier, in bytes, so that the
librarian's plan for the next call costs a few array operations however long the
task has run.

Invariants: a segment is shown in exactly one form; an expanded `tool` segment shows
the reply that made the calls before their results, and a folded or evicted one shows
neither, so no result is ever in a prompt without its call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from agentd.context import (
    Costs,
    LibrarianRules,
    Part,
    Plan,
    Segment,
    Tier,
    WorkingMemory,
    extract,
    plan_tiers,
)
from agentd.context._vectors import TextVectors
from agentd.platform._context import Fragment, Layer

# Bytes a data block's markers add around a fragment (nonce, layer, source), rounded
# up: costs are over-estimates, never under.
BLOCK_FRAME = 96
COLLAPSED_STUB_BYTES = 200


def folded_text(seg: Segment) -> str:
    return (f"[segment {seg.id}: {seg.kind}, {seg.nbytes} bytes, folded; a summary follows; "
            f"send core unfold with segment {seg.id} for the original]\n{seg.summary}")


def collapsed_text(first: int, last: int, count: int) -> str:
    return (f"[{count} segments between {first} and {last} are evicted; send core unfold "
            "with a segment id to see one again]")


class TaskContext:
    def __init__(self, vectors: TextVectors) -> None:
        self.memory = WorkingMemory(vectors)
        self.fragments: dict[int, list[Fragment]] = {}
        self._expanded: list[int] = []  # bytes, by segment position
        self._folded: list[int] = []
        self._stub: list[int] = []
        self.collapsed = False

    @property
    def segments(self) -> list[Segment]:
        return self.memory.segments

    def add(self, part: Part, fragment: Fragment) -> Segment:
        seg = self.memory.add(part)
        shown = self.fragments.setdefault(seg.id, [])
        shown.append(fragment)
        expanded = sum(len(f.content.encode()) + BLOCK_FRAME for f in shown)
        stub = len(seg.stub().encode()) + BLOCK_FRAME
        if seg.id > len(self._expanded):
            self._expanded.append(expanded)
            self._folded.append(0)
            self._stub.append(stub)
        else:
            self._expanded[seg.id - 1] = expanded
            self._stub[seg.id - 1] = stub
        self._folded[seg.id - 1] = self._folded_bytes(seg)
        return seg

    def _folded_bytes(self, seg: Segment) -> int:
        # Before a summary exists its size is the extract's: the summary a model
        # writes is completed with the same facts, and the assembled request is
        # measured again before it is sent.
        summary = seg.summary or extract(seg.text)
        return len(summary.encode()) + 160 + BLOCK_FRAME

    def summarised(self, seg: Segment) -> None:
        self._folded[seg.id - 1] = self._folded_bytes(seg)

    async def plan(self, query: str, rules: LibrarianRules,
                   tokens: Callable[[np.ndarray], np.ndarray], fixed_tokens: int) -> Plan:
        relevance = await self.memory.relevance(query)
        for seg, r in zip(self.segments, relevance.tolist(), strict=True):
            seg.relevance = round(float(r), 4)
        costs = Costs(
            tokens(np.asarray(self._expanded, dtype=np.int64)),
            tokens(np.asarray(self._folded, dtype=np.int64)),
            tokens(np.asarray(self._stub, dtype=np.int64)),
            relevance.astype(np.float64),
            np.fromiter((s.pinned for s in self.segments), dtype=bool,
                        count=len(self.segments)),
        )
        collapsed = int(tokens(np.asarray([COLLAPSED_STUB_BYTES]))[0])
        return plan_tiers(costs, rules, fixed_tokens, collapsed)

    def apply(self, plan: Plan) -> list[Segment]:
        """Set the planned tiers; returns the segments whose tier changed."""
        moved: list[Segment] = []
        for seg, tier in zip(self.segments, plan.tiers, strict=True):
            if seg.tier is not tier:
                seg.tier = tier
                moved.append(seg)
        self.collapsed = plan.collapsed_stubs
        return moved

    def shown(self, prepared: Callable[[str, str], str]) -> list[Fragment]:
        """The fragments of layer 5 for the next call, per the segments' tiers.
        `prepared(text, source)` neutralises a summary (untrusted: it was made from
        untrusted content)."""
        out: list[Fragment] = []
        stubs: list[str] = []
        evicted: list[int] = []

        def flush() -> None:
            if stubs and not self.collapsed:
                out.append(Fragment(Layer.WORKING, "\n".join(stubs), "evicted"))
            stubs.clear()

        for seg in self.segments:
            if seg.tier is Tier.EVICTED:
                stubs.append(seg.stub())
                evicted.append(seg.id)
                continue
            flush()
            if seg.tier is Tier.EXPANDED:
                out.extend(self.fragments[seg.id])
            else:
                out.append(Fragment(Layer.WORKING, prepared(folded_text(seg), f"folded:{seg.id}"),
                                    f"folded:{seg.id}"))
        flush()
        if self.collapsed and evicted:
            out.insert(0, Fragment(Layer.WORKING,
                                   collapsed_text(evicted[0], evicted[-1], len(evicted)),
                                   "evicted"))
        return out

    def unpin(self) -> None:
        for seg in self.segments:
            seg.pinned = False

    def adopt(self, stored: Sequence[Segment]) -> None:
        self.memory.adopt(stored)
        for seg in self.segments:
            if seg.summary:
                self.summarised(seg)
