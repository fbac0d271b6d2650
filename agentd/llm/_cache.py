"""The response cache: request key -> response, with a TTL and a size bound (LRU).

Keys are `LlmRequest.key` (the assembled request, nonce normalised) plus the backend
preference, so two agents with different prompts never share an entry. A TTL of 0
disables the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from agentd.llm._limits import Clock
from agentd.llm._types import LlmResponse


class ResponseCache:
    def __init__(self, ttl_s: float, clock: Clock, max_entries: int = 4096) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, LlmResponse]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def get(self, key: str) -> LlmResponse | None:
        if not self.enabled:
            return None
        entry = self._entries.get(key)
        if entry is None or entry[0] <= self._clock.now():
            if entry is not None:
                del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return replace(entry[1], cached=True, attempts=0, transport_s=0.0)

    def put(self, key: str, response: LlmResponse) -> None:
        if not self.enabled:
            return
        self._entries[key] = (self._clock.now() + self.ttl_s, response)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
