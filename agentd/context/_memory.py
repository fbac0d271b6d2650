"""Long-term memory (layer 6): per agent, durable in the kernel, recalled by similarity.

Written only by operators (`agentctl memory add`, through the daemon) and by the
trusted platform API (`Platform.remember`); nothing an agent outputs reaches `add`.
Each memory's vector is stored beside it with the identity of the embedder that
made it; `load` re-embeds (and rewrites) the memories an earlier embedder made.

Recall: at most `k` memories whose cosine similarity with the query is above 0, most
similar first (ties: the newest first). The index is held in memory (one numpy
matrix per agent), so a recall reads no database; the kernel is written through.

What is recalled is still untrusted text: the platform spotlights it and drops a
keyed memory that redefines a fact of a higher layer.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from agentd.context._vectors import HashedTerms, TextVectors, VectorIndex

if TYPE_CHECKING:
    from agentd.kernel import Kernel

log = logging.getLogger("agentd.context.memory")

MAX_MEMORY_CHARS = 8192
MAX_KEY_CHARS = 128
REEMBED_RETRY_S = 60


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    id: str
    agent: str
    text: str
    key: str | None
    created: float


class _AgentMemories:
    __slots__ = ("index", "records")

    def __init__(self) -> None:
        self.records: list[MemoryRecord] = []
        self.index = VectorIndex()

    def fits(self, vector: np.ndarray) -> bool:
        """Whether `vector` has the width of the vectors held (any, if none is)."""
        return not len(self.index) or len(vector) == self.index.dimensions


class LongTermMemory:
    def __init__(self, embedder: TextVectors | None = None, *, kernel: Kernel | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.embedder: TextVectors = embedder or HashedTerms()
        self.degraded = ""  # why the last recall found nothing it could search, if so
        self._kernel = kernel
        self._clock = clock
        self._agents: dict[str, _AgentMemories] = {}
        self._loaded = kernel is None
        self._loading: asyncio.Lock | None = None
        self._retry_at = 0.0  # when to try re-embedding again after a provider failure

    # ---- loading ------------------------------------------------------------------

    async def ready(self) -> None:
        """Load from the kernel once (the first recall or command waits for it). If
        memories made by another embedder could not be re-embedded (the provider
        failed), the others are recalled and those are tried again at most every
        `REEMBED_RETRY_S`."""
        if self._loaded or self._clock() < self._retry_at:
            return
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if not self._loaded and self._clock() >= self._retry_at:
                await self.load()
                self._loaded = self._retry_at == 0.0

    async def load(self) -> int:
        """Read every memory from the kernel; re-embed those another embedder made.
        Returns how many were re-embedded. Memories already held are kept."""
        if self._kernel is None:
            return 0
        await self._kernel.flush()
        held = {r.id for mem in self._agents.values() for r in mem.records}
        rows = [r for r in await self._kernel.memories() if r[0] not in held]
        stale: list[int] = []
        vectors: list[np.ndarray | None] = []
        for i, (_mid, _agent, _key, _text, _created, identity, blob) in enumerate(rows):
            stored = np.frombuffer(blob, dtype=np.float32)
            if identity != self.embedder.identity:
                stale.append(i)
                vectors.append(None)
            else:
                vectors.append(stored)
        self._retry_at = 0.0
        if stale:
            try:
                fresh = await self.embedder.vectors(
                    [_embedded_text(rows[i][3], rows[i][2]) for i in stale])
            except Exception as exc:  # recall the others; these wait for the provider
                self.degraded = f"{self.embedder.identity}: {type(exc).__name__}"
                self._retry_at = self._clock() + REEMBED_RETRY_S
                log.warning("long-term memory: %d memories made by another embedder could "
                            "not be re-embedded with %s (%s); they are not recalled until "
                            "they are (next try in %d s)", len(stale), self.embedder.identity,
                            exc, REEMBED_RETRY_S)
                stale = []
        if stale:
            tx = self._kernel.transaction()
            for i, vector in zip(stale, fresh, strict=True):
                vectors[i] = vector
                mid, agent, key, text, created, _identity, _blob = rows[i]
                tx.memory_put((mid, agent, key, text, created, self.embedder.identity,
                               vector.astype(np.float32).tobytes()))
            await self._kernel.commit(tx)
            log.info("long-term memory: %d memories re-embedded with %s", len(stale),
                     self.embedder.identity)
        for (mid, agent, key, text, created, _identity, _blob), vector in zip(
                rows, vectors, strict=True):
            if vector is not None:  # None: made by another embedder, not re-embedded yet
                self._insert(MemoryRecord(mid, agent, text, key, created), vector)
        return len(stale)

    # ---- writing (trusted callers only) ---------------------------------------------

    async def add(self, agent: str, text: str, key: str | None = None) -> MemoryRecord:
        """Store a memory; returns once the kernel committed it (it is recalled from
        then on). Raises ValueError for empty or oversized text or key, the
        provider's error when its vector cannot be made, the kernel's when it cannot
        write: nothing is stored then."""
        text = text.strip()
        if not text or len(text) > MAX_MEMORY_CHARS:
            raise ValueError(f"a memory's text must have 1 to {MAX_MEMORY_CHARS} characters")
        if key is not None and (not key.strip() or len(key) > MAX_KEY_CHARS):
            raise ValueError(f"a memory's key must have 1 to {MAX_KEY_CHARS} characters")
        record = MemoryRecord(f"m-{secrets.token_hex(6)}", agent, text, key, self._clock())
        vector = (await self.embedder.vectors([_embedded_text(text, key)]))[0]
        mem = self._agents.get(agent)
        if mem is not None and not mem.fits(vector):
            raise ValueError(f"the embeddings provider gave {len(vector)} dimensions; this "
                             f"agent's memories have {mem.index.dimensions}")
        if self._kernel is not None:
            tx = self._kernel.transaction()
            tx.memory_put((record.id, agent, key, text, record.created, self.embedder.identity,
                           vector.astype(np.float32).tobytes()))
            await self._kernel.commit(tx)
        self._insert(record, vector)
        return record

    async def forget(self, agent: str, memory_id: str) -> bool:
        """Delete one memory (durably, before it leaves the index); False if `agent`
        has no memory `memory_id`."""
        mem = self._agents.get(agent)
        if mem is None:
            return False
        for i, record in enumerate(mem.records):
            if record.id == memory_id:
                if self._kernel is not None:
                    tx = self._kernel.transaction()
                    tx.memory_forget(agent, memory_id)
                    await self._kernel.commit(tx)
                i = mem.records.index(record)  # the list may have moved while awaiting
                del mem.records[i]
                mem.index.remove(i)
                return True
        return False

    def _insert(self, record: MemoryRecord, vector: np.ndarray) -> None:
        """Position i of the index is record i: a vector that cannot join the index
        (another width, stored by an earlier bug or a provider that changed) leaves
        its record out too, loudly."""
        mem = self._agents.get(record.agent)
        if mem is None:
            mem = self._agents[record.agent] = _AgentMemories()
        if not mem.fits(vector):
            log.warning("long-term memory %s of agent %s has %d dimensions, the others %d: "
                        "not recalled", record.id, record.agent, len(vector),
                        mem.index.dimensions)
            return
        mem.index.append(vector)
        mem.records.append(record)

    # ---- reading ----------------------------------------------------------------------

    def list(self, agent: str) -> list[MemoryRecord]:
        mem = self._agents.get(agent)
        return list(mem.records) if mem is not None else []

    async def recall(self, agent: str, query: str, k: int) -> Sequence[MemoryRecord]:
        """At most `k` memories of `agent` most similar to `query`. A provider that
        fails recalls nothing this time: logged, and named in `degraded`."""
        mem = self._agents.get(agent)
        if mem is None or k <= 0 or not mem.records:
            return ()
        try:
            q = (await self.embedder.vectors([query]))[0]
        except Exception as exc:
            self.degraded = f"{self.embedder.identity}: {type(exc).__name__}"
            log.warning("long-term memory recall skipped for agent %s: the embeddings "
                        "provider failed (%s)", agent, exc)
            return ()
        if len(q) != mem.index.dimensions:
            self.degraded = f"{self.embedder.identity}: {len(q)} dimensions, memories have " \
                            f"{mem.index.dimensions}"
            log.warning("long-term memory recall skipped for agent %s: %s", agent,
                        self.degraded)
            return ()
        self.degraded = ""
        scores = mem.index.similarities(q)
        n = len(scores)
        top = np.argpartition(-scores, k - 1)[:k] if n > k else np.arange(n)
        # Most similar first; ties: the newest (highest position) first.
        ranked = sorted((i for i in top.tolist() if scores[i] > 0),
                        key=lambda i: (-float(scores[i]), -i))
        return tuple(mem.records[i] for i in ranked)


def _embedded_text(text: str, key: str | None) -> str:
    return f"{key}: {text}" if key else text
