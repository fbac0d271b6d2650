"""Long-term memory (layer 6): a per-agent store with keyword recall.

This is NOT vector search yet: recall scores entries by how many distinct words
(three letters or more, or numbers; minus common stop words and XML markup) they
share with the query, newest first on ties. Memories are written by the platform's trusted API
(`Platform.remember`), never by an agent, and they are untrusted content all the
same: they enter the prompt as layer 6, spotlighted, and a keyed memory cannot
redefine a fact of a higher layer. `MemoryStore` is the seam for a kernel-backed or
vector-backed implementation.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

_WORD = re.compile(r"[A-Za-z0-9]{3,}|[0-9]+")
_TAG = re.compile(r"<[^<>]*>")
_STOP_WORDS = (
    "the and for are but not you all any can her was one our out has his how its may new "
    "now see two who did get let put say she too use that with this from they will have "
    "what when your which their there been into than them then these would about"
)
_STOP = frozenset(_STOP_WORDS.split(" "))


@dataclass(frozen=True)
class Memory:
    text: str
    key: str | None = None  # a keyed memory: subject to the fact rules


def words(text: str) -> frozenset[str]:
    """The recall vocabulary of `text`: words of 3+ letters and numbers, lower case,
    without stop words and without XML markup (a task is recalled by its content)."""
    text = _TAG.sub(" ", text)
    return frozenset(w for w in (m.lower() for m in _WORD.findall(text)) if w not in _STOP)


class MemoryStore(Protocol):
    def remember(self, agent: str, memory: Memory) -> None: ...

    def recall(self, agent: str, query: str, limit: int = 3) -> Sequence[Memory]: ...


class KeywordMemory:
    def __init__(self, max_per_agent: int = 10_000) -> None:
        self.max_per_agent = max_per_agent
        self._entries: dict[str, list[tuple[Memory, frozenset[str]]]] = {}

    def remember(self, agent: str, memory: Memory) -> None:
        entries = self._entries.setdefault(agent, [])
        entries.append((memory, words(memory.text) | words(memory.key or "")))
        if len(entries) > self.max_per_agent:
            del entries[0]

    def recall(self, agent: str, query: str, limit: int = 3) -> Sequence[Memory]:
        entries = self._entries.get(agent)
        if not entries or limit <= 0:
            return ()
        wanted = words(query)
        scored = [
            (len(ws & wanted), i, m) for i, (m, ws) in enumerate(entries) if ws & wanted
        ]
        scored.sort(key=lambda t: (-t[0], -t[1]))
        return tuple(m for _, _, m in scored[:limit])
