"""One task's working memory: its segments, their vectors, and their durable log.

`WorkingMemory` places each turn into a segment (`add_turn`) and keeps one vector per
segment for relevance; `KernelSegmentLog` writes every change to the kernel's
`segments` table. Relevance of a segment is the cosine similarity of its vector with
the query's (the task and the newest segment), clipped to [0, 1]. Vectors are made
lazily, in one provider call per LLM call for the segments new or grown since the
last; if the provider fails, the task switches to `HashedTerms` for good (logged)
rather than calling without relevance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agentd.context._segments import IntegrityError, Part, Segment, Tier, add_turn
from agentd.context._vectors import HashedTerms, TextVectors, VectorIndex

if TYPE_CHECKING:
    from agentd.kernel import Kernel

log = logging.getLogger("agentd.context")


class SegmentLog(Protocol):
    def put(self, thread: str, conversation: str, agent: str, segment: Segment) -> None: ...

    def move(self, thread: str, segment: Segment) -> None: ...

    async def load(self, thread: str) -> list[Segment]: ...


class NoSegmentLog:
    """For runs without a kernel: segments live with the task, in memory."""

    def put(self, thread: str, conversation: str, agent: str, segment: Segment) -> None:
        return None

    def move(self, thread: str, segment: Segment) -> None:
        return None

    async def load(self, thread: str) -> list[Segment]:
        return []


class KernelSegmentLog:
    """Write-through to the kernel's `segments` table (committed by its batching
    writer; a failed write is logged, the task goes on with its in-memory copy)."""

    def __init__(self, kernel: Kernel, clock: Callable[[], float] = time.time) -> None:
        self._kernel = kernel
        self._clock = clock

    def put(self, thread: str, conversation: str, agent: str, segment: Segment) -> None:
        tx = self._kernel.transaction()
        tx.segment_put(segment.row(thread, conversation, agent, self._clock()))
        self._kernel.commit(tx).add_done_callback(_log_failure)

    def move(self, thread: str, segment: Segment) -> None:
        tx = self._kernel.transaction()
        tx.segment_move(thread, segment.id, segment.tier.value, float(segment.relevance),
                        segment.summary)
        self._kernel.commit(tx).add_done_callback(_log_failure)

    async def load(self, thread: str) -> list[Segment]:
        await self._kernel.flush()
        out: list[Segment] = []
        for row in await self._kernel.segments(thread=thread):
            try:
                out.append(Segment.from_row(row))
            except IntegrityError as exc:
                log.error("context segment damaged thread=%s: %s", thread, exc)
                return []  # rebuilt from the history instead
        return out


def _log_failure(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("segment write failed: %s", fut.exception())


class WorkingMemory:
    def __init__(self, vectors: TextVectors) -> None:
        self._vectors = vectors
        self.segments: list[Segment] = []
        self._index = VectorIndex()
        self._dirty: set[int] = set()  # positions whose vector is missing or stale

    def add(self, part: Part) -> Segment:
        """Place a turn; returns the segment it went into (new or grown)."""
        seg = add_turn(self.segments, part)
        seg.summary = ""  # a grown segment's summary is stale
        self._dirty.add(seg.id - 1)
        return seg

    async def relevance(self, query: str) -> np.ndarray:
        if not self.segments:
            return np.zeros(0)
        try:
            q = await self._refresh(query)
        except Exception as exc:
            log.warning("context relevance: the embeddings provider %s failed (%s); this "
                        "task goes on with hashed lexical vectors", self._vectors.identity, exc)
            self._vectors = HashedTerms()
            self._index = VectorIndex()
            self._dirty = set(range(len(self.segments)))
            q = await self._refresh(query)
        return self._index.similarities(q)

    async def _refresh(self, query: str) -> np.ndarray:
        dirty = sorted(self._dirty)
        made = await self._vectors.vectors([*(self.segments[i].text for i in dirty), query])
        for i, row in zip(dirty, made[:-1], strict=True):
            if i < len(self._index):
                self._index.replace(i, row)
            else:
                self._index.append(row)
        self._dirty.clear()
        return np.asarray(made[-1])

    def adopt(self, stored: Sequence[Segment]) -> None:
        """Take tiers, relevance and summaries from stored segments (after a restart)
        where their originals equal the rebuilt ones."""
        for old in stored:
            if 0 < old.id <= len(self.segments):
                seg = self.segments[old.id - 1]
                if seg.sha256 == old.sha256:
                    seg.tier, seg.relevance, seg.summary = old.tier, old.relevance, old.summary

    def get(self, segment_id: int) -> Segment | None:
        if 0 < segment_id <= len(self.segments):
            return self.segments[segment_id - 1]
        return None

    def counts(self) -> dict[str, int]:
        out = {t.value: 0 for t in Tier}
        for seg in self.segments:
            out[seg.tier.value] += 1
        return out
