"""Which OOB refusals are journaled one by one, and which only counted.

A peer that sends garbage as fast as it can would get one security row per frame
(thousands a second, each journaled for as long as the journal is kept) and bury
the events an operator needs. So each peer (uid and pid) has a window of
`interval_s` from its first refusal: the first `burst` refusals in it are journaled
whole, the rest are counted, and when the window ends the count is journaled as one
`repeated-refusals` row (with how many of each kind). At most `max_peers` peers have
a window of their own at a time; the others share one, so a flood from many pids is
bounded too: at most `(burst + 1) * (max_peers + 1)` rows an interval.

Pure: the caller passes the time and acts on what comes back.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

REPEATED_KIND = "repeated-refusals"
OTHER_PEERS = "other"


@dataclass
class _Window:
    started: float
    logged: int = 0
    suppressed: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Summary:
    """The refusals of one peer in one window that were counted, not journaled."""

    peer: str
    count: int
    kinds: dict[str, int]


class RefusalLimiter:
    def __init__(self, interval_s: float = 10.0, burst: int = 10, max_peers: int = 64) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self.max_peers = max_peers
        self._windows: dict[str, _Window] = {}

    def admit(self, peer: str, kind: str, now: float) -> bool:
        """Record a refusal from `peer`; True: journal it whole, False: it was counted
        (the next `due` reports it once its window ends)."""
        if peer not in self._windows and len(self._windows) >= self.max_peers:
            peer = OTHER_PEERS
        window = self._windows.get(peer)
        if window is None or now - window.started >= self.interval_s:
            if window is not None and window.suppressed:
                return self._count(window, kind)  # reported by `due` first
            window = self._windows[peer] = _Window(now)
        if window.logged < self.burst:
            window.logged += 1
            return True
        return self._count(window, kind)

    @staticmethod
    def _count(window: _Window, kind: str) -> bool:
        window.suppressed[kind] += 1
        return False

    def pending(self) -> bool:
        """Whether some counted refusal has yet to be reported."""
        return any(w.suppressed for w in self._windows.values())

    def due(self, now: float) -> list[Summary]:
        """The counts of the windows that have ended (each reported once); forgets
        those windows."""
        out: list[Summary] = []
        for peer, window in list(self._windows.items()):
            if now - window.started < self.interval_s:
                continue
            del self._windows[peer]
            if window.suppressed:
                out.append(Summary(peer, sum(window.suppressed.values()),
                                   dict(sorted(window.suppressed.items()))))
        return out
