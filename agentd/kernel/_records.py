"""Value types the kernel reads and writes: thread rows, journal entries, retention.

All frozen: a record read from the kernel is a snapshot, never a handle on the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

THREAD_STATES = frozenset({"active", "completed", "failed"})
DIRECTIONS = frozenset({"in", "out", "audit", "security"})
AUDIT_DIRECTIONS = frozenset({"audit", "security"})

RETAIN_FOREVER_MODE = "retain_forever"
PRUNE_ON_DELIVERY_MODE = "prune_on_delivery"
RETAIN_DAYS_MODE = "retain_days"


class ThreadRow(NamedTuple):
    """A NamedTuple, not a dataclass: one is built for every new conversation on the
    hot path, and a tuple is several times cheaper to build than a frozen dataclass."""

    uuid: str
    path: tuple[str, ...]
    parent: str | None
    owner: str
    profile: str
    table_version: int
    state: str  # "active" | "completed" | "failed"
    created: float
    updated: float
    hops: int = 0


@dataclass(frozen=True)
class JournalEntry:
    seq: int
    ts: float
    thread: str
    direction: str  # "in" | "out" | "audit" | "security"
    kind: str
    handler: str
    sender: str
    tag: str
    payload_hash: str  # sha256 hex of the payload bytes
    payload: bytes | None
    prev_hash: str
    hash: str
    profile: str = ""
    # Additions to the agreed API (defaults keep it source-compatible):
    pending: bool = False  # journaled for delivery; redelivered after a crash until delivered()
    expires: float | None = None  # retention decided at write time; None = forever, 0 = on delivery
    pos: int = 0  # position in the hash chain (commit order)


@dataclass(frozen=True)
class Retention:
    """One retention policy (seed 002 section 7.1).

    `retain_forever`: never deleted. `prune_on_delivery`: deleted by the next sweep
    once delivered (entries journaled without `pending` count as delivered).
    `retain_days`: deleted by the first sweep after `days` days. An entry that is
    still pending and undelivered is never deleted, whatever the policy.
    """

    mode: str = RETAIN_FOREVER_MODE
    days: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in (RETAIN_FOREVER_MODE, PRUNE_ON_DELIVERY_MODE, RETAIN_DAYS_MODE):
            raise ValueError(f"unknown retention policy {self.mode!r}")
        if self.mode == RETAIN_DAYS_MODE and not self.days > 0:
            raise ValueError(f"retain_days needs a positive number of days, got {self.days!r}")

    @classmethod
    def parse(cls, value: Any) -> Retention:
        """From the configuration form: `retain_forever`, `prune_on_delivery`,
        `{retain_days: N}` (also accepts `retain_days: N` / `retain_days(N)` strings)."""
        if isinstance(value, Retention):
            return value
        kind = getattr(value, "kind", None)  # agentd._config.RetentionPolicy
        if isinstance(kind, str):
            days = getattr(value, "days", None)
            return cls(kind, float(days) if days is not None else 0.0)
        if isinstance(value, Mapping) and set(value) == {RETAIN_DAYS_MODE}:
            return cls(RETAIN_DAYS_MODE, float(value[RETAIN_DAYS_MODE]))
        if isinstance(value, str):
            text = value.strip()
            if text in (RETAIN_FOREVER_MODE, PRUNE_ON_DELIVERY_MODE):
                return cls(text)
            for sep in (":", "("):
                head, found, rest = text.partition(sep)
                if found and head.strip() == RETAIN_DAYS_MODE:
                    return cls(RETAIN_DAYS_MODE, float(rest.rstrip(")").strip()))
        raise ValueError(f"not a retention policy: {value!r}")

    def expires(self, ts: float) -> float | None:
        """The `expires` stamp of an entry written at `ts` under this policy."""
        if self.mode == RETAIN_FOREVER_MODE:
            return None
        if self.mode == PRUNE_ON_DELIVERY_MODE:
            return 0.0
        return ts + self.days * 86400.0


RETAIN_FOREVER = Retention()
PRUNE_ON_DELIVERY = Retention(PRUNE_ON_DELIVERY_MODE)


def retain_days(days: float) -> Retention:
    return Retention(RETAIN_DAYS_MODE, float(days))


RetentionPolicy = Retention | Mapping[str, Any] | Any
"""One policy for every profile, or a mapping profile -> policy (key "*": default;
profiles not listed and without "*" are retained forever). Each policy may be a
`Retention` or anything `Retention.parse` accepts (e.g. the configuration's own
`RetentionPolicy(kind, days)`)."""
