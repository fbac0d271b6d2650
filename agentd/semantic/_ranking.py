"""Ranking an intent against the listeners a sender may reach: mask first, then rank.

The candidates are exactly the listeners the thread's dispatch table holds and,
for a listener sender, its peers allow (never the sender itself). Nothing outside
them is embedded, scored, logged or shown to a model, so the outcome equals
rank-then-mask, and a masked listener cannot even shift the scores (with `lexical`,
BM25's IDF is fit over the permitted candidates only).

`select` is pure: scores in, the ranking out (best first, at most `top_k`, ties in
table order) and the selected listener: the best one scoring at least `threshold`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import numpy as np

from agentd._routing import DispatchTable, Listener, Profile
from agentd.embeddings import Embedder, Matrix, similarities

_DOCUMENTS_KEPT = 64  # candidate sets whose vectors are kept (absolute providers)


def permitted(profile: Profile, sender: Listener | None) -> tuple[Listener, ...]:
    """The listeners `sender` (None: a client) may reach in `profile`, table order."""
    return tuple(
        lst for lst in profile.table.listeners.values()
        if not lst.retired
        and (sender is None or (lst.name != sender.name and sender.may_send_to(lst.name)))
    )


def candidate_text(listener: Listener) -> str:
    extra = getattr(listener.config, "semantic_description", "") or ""
    return f"{listener.description}\n{extra}" if extra else listener.description


@dataclass(frozen=True)
class Ranking:
    entries: tuple[tuple[str, float], ...]  # (listener, score), best first
    selected: str | None
    threshold: float

    def as_json(self) -> dict[str, Any]:
        return {
            "ranking": [{"listener": n, "score": round(s, 6)} for n, s in self.entries],
            "selected": self.selected,
        }


def select(
    names: Sequence[str], scores: Sequence[float], threshold: float, top_k: int
) -> Ranking:
    order = sorted(range(len(names)), key=lambda i: -scores[i])[: max(top_k, 1)]
    entries = tuple((names[i], float(scores[i])) for i in order)
    best = entries[0] if entries else None
    chosen = best[0] if best is not None and best[1] >= threshold and best[1] > 0 else None
    return Ranking(entries, chosen, threshold)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Its waiters got the outcome, or all left: no "exception never retrieved"."""
    if not task.cancelled():
        task.exception()


class Ranker:
    """Scores an intent over candidates with one embedder; keeps the candidates'
    vectors per candidate set (an absolute provider embeds each set once)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._documents: OrderedDict[tuple[str, ...], Matrix] = OrderedDict()
        # A candidate set being embedded: concurrent intents wait for the one request.
        self._embedding: dict[tuple[str, ...], asyncio.Task[Matrix]] = {}
        self._candidates: WeakKeyDictionary[
            DispatchTable, dict[str | None, tuple[tuple[Listener, ...], tuple[str, ...]]]
        ] = WeakKeyDictionary()

    async def _matrix(self, texts: tuple[str, ...]) -> Matrix:
        if self.embedder.corpus_relative:
            return await self.embedder.embed_documents(texts)  # the provider caches its fit
        found = self._documents.get(texts)
        if found is not None:
            self._documents.move_to_end(texts)
            return found
        task = self._embedding.get(texts)
        if task is None:
            task = self._embedding[texts] = asyncio.ensure_future(self._embed(texts))
            task.add_done_callback(_retrieved)
        return await asyncio.shield(task)  # a waiter cancelled leaves it to the others

    async def _embed(self, texts: tuple[str, ...]) -> Matrix:
        try:
            found = self._documents[texts] = await self.embedder.embed_documents(texts)
        finally:
            del self._embedding[texts]
        if len(self._documents) > _DOCUMENTS_KEPT:
            self._documents.popitem(last=False)
        return found

    def candidates(
        self, profile: Profile, sender: Listener | None
    ) -> tuple[tuple[Listener, ...], tuple[str, ...]]:
        """`permitted(profile, sender)` and their texts, computed once per table and
        sender: tables are immutable (a reload builds new ones), except that a reload
        retires the listeners it removes from the tables threads still hold."""
        per_table = self._candidates.get(profile.table)
        if per_table is None:
            per_table = self._candidates[profile.table] = {}
        key = None if sender is None else sender.name
        found = per_table.get(key)
        if found is None or any(x.retired for x in found[0]):
            listeners = permitted(profile, sender)
            found = per_table[key] = (listeners, tuple(candidate_text(x) for x in listeners))
        return found

    async def rank(
        self, text: str, profile: Profile, sender: Listener | None, threshold: float, top_k: int
    ) -> Ranking:
        candidates, texts = self.candidates(profile, sender)
        if not candidates:
            return Ranking((), None, threshold)
        matrix = await self._matrix(texts)
        query = await self.embedder.embed_query(text, texts)
        scores = similarities(query, matrix) if matrix.shape[1] else np.zeros(len(texts))
        return select([lst.name for lst in candidates], scores.tolist(), threshold, top_k)
