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
    EVICTED,
    EXPANDED,
    TIERS,
    Costs,
    LibrarianRules,
    Part,
    Plan,
    Segment,
    TextVectors,
    WorkingMemory,
    extract,
    plan_tiers,
)
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
        # Positions whose folded size is not measured yet: measured by the next plan,
        # not on every add (a tool segment grows with each result; its extract reads
        # the whole text, so measuring it per result would cost the square of it).
        self._unmeasured: set[int] = set()
        self._stub: list[int] = []
        self._codes = np.zeros(0, dtype=np.int64)  # the tier code of each segment
        self.relevance = np.zeros(0)
        self.pinned: set[int] = set()  # ids asked back with unfold, for the next call
        self.collapsed = False

    @property
    def segments(self) -> list[Segment]:
        return self.memory.segments

    def add(self, part: Part, fragment: Fragment) -> Segment:
        seg = self.memory.add(part)
        shown = self.fragments.setdefault(seg.id, [])
        shown.append(fragment)
        expanded = sum(f.nbytes + BLOCK_FRAME for f in shown)
        stub = len(seg.stub().encode()) + BLOCK_FRAME
        if seg.id > len(self._expanded):
            self._expanded.append(expanded)
            self._folded.append(0)
            self._stub.append(stub)
        else:
            self._expanded[seg.id - 1] = expanded
            self._stub[seg.id - 1] = stub
        self._unmeasured.add(seg.id - 1)
        return seg

    def _folded_bytes(self, seg: Segment) -> int:
        # Before a summary exists its size is the extract's: the summary a model
        # writes is completed with the same facts, and the assembled request is
        # measured again before it is sent.
        summary = seg.summary or extract(seg.text)
        return len(summary.encode()) + 160 + BLOCK_FRAME

    def summarised(self, seg: Segment) -> None:
        self._folded[seg.id - 1] = self._folded_bytes(seg)
        self._unmeasured.discard(seg.id - 1)

    async def plan(self, query: str, rules: LibrarianRules,
                   tokens: Callable[[np.ndarray], np.ndarray], fixed_tokens: int) -> Plan:
        for i in self._unmeasured:
            self._folded[i] = self._folded_bytes(self.segments[i])
        self._unmeasured.clear()
        relevance = await self.memory.relevance(query)
        self.relevance = relevance
        n = len(self.segments)
        pinned = np.zeros(n, dtype=bool)
        if self.pinned:
            pinned[[i - 1 for i in self.pinned if 0 < i <= n]] = True
        costs = Costs(
            tokens(np.asarray(self._expanded, dtype=np.int64)),
            tokens(np.asarray(self._folded, dtype=np.int64)),
            tokens(np.asarray(self._stub, dtype=np.int64)),
            relevance.astype(np.float64),
            pinned,
        )
        collapsed = int(tokens(np.asarray([COLLAPSED_STUB_BYTES]))[0])
        return plan_tiers(costs, rules, fixed_tokens, collapsed)

    def apply(self, plan: Plan) -> list[Segment]:
        """Set the planned tiers; returns the segments whose tier changed (they also
        take their current relevance)."""
        n = len(plan.codes)
        if len(self._codes) < n:
            self._codes = np.concatenate(
                [self._codes, np.zeros(n - len(self._codes), dtype=np.int64)])
        changed = np.flatnonzero(self._codes[:n] != plan.codes)
        self._codes = plan.codes.copy()
        moved: list[Segment] = []
        for i in changed.tolist():
            seg = self.segments[i]
            seg.tier = TIERS[int(plan.codes[i])]
            seg.relevance = round(float(self.relevance[i]), 4)
            moved.append(seg)
        self.collapsed = plan.collapsed_stubs
        return moved

    def current_relevance(self) -> None:
        """Copy the last computed relevance onto every segment (for introspection)."""
        for seg, r in zip(self.segments, self.relevance.tolist(), strict=False):
            seg.relevance = round(float(r), 4)

    def shown(self, prepared: Callable[[str, str], str]) -> list[Fragment]:
        """The fragments of layer 5 for the next call, per the segments' tiers.
        `prepared(text, source)` neutralises a summary (untrusted: it was made from
        untrusted content)."""
        out: list[Fragment] = []
        segments = self.segments
        codes = self._codes
        if len(codes) < len(segments):  # segments no plan has placed yet: expanded
            codes = np.concatenate([codes, np.zeros(len(segments) - len(codes), np.int64)])
        evicted = np.flatnonzero(codes == EVICTED)
        if self.collapsed and len(evicted):
            out.append(Fragment(Layer.WORKING, collapsed_text(
                int(evicted[0]) + 1, int(evicted[-1]) + 1, len(evicted)), "evicted"))
        stubs: list[str] = []

        def flush() -> None:
            if stubs:
                out.append(Fragment(Layer.WORKING, "\n".join(stubs), "evicted"))
            stubs.clear()

        # Only segments that show more than a collapsed stub are visited one by one.
        visible = np.flatnonzero(codes != EVICTED) if self.collapsed else range(len(segments))
        for i in (visible.tolist() if isinstance(visible, np.ndarray) else visible):
            seg = segments[i]
            code = codes[i]
            if code == EVICTED:
                stubs.append(seg.stub())
                continue
            flush()
            if code == EXPANDED:
                out.extend(self.fragments[seg.id])
            else:
                out.append(Fragment(Layer.WORKING, prepared(folded_text(seg), f"folded:{seg.id}"),
                                    f"folded:{seg.id}"))
        flush()
        return out

    def pin(self, segment_id: int) -> None:
        self.pinned.add(segment_id)

    def unpin(self) -> None:
        self.pinned.clear()

    def adopt(self, stored: Sequence[Segment]) -> None:
        self.memory.adopt(stored)
        self._codes = np.asarray([TIERS.index(s.tier) for s in self.segments], dtype=np.int64)
        for seg in self.segments:
            if seg.summary:
                self.summarised(seg)
