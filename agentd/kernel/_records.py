"""Value types the kernel reads and writes: thread rows, journal entries, retention.

All frozen: a record read from the kernel is a snapshot, never a handle on the row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

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
    call_ref: str = ""  # the caller's reference of the call the frame runs


class TimerRow(NamedTuple):
    """A pending timer: `frame` is the call it answers, `conversation` its client's
    thread; `due` wall-clock seconds."""

    id: str
    conversation: str
    frame: str
    listener: str
    due: float
    note: str
    hops: int
    created: float


APPROVAL_STATES = frozenset({"pending", "approved", "denied", "expired", "cancelled"})


class ApprovalRow(NamedTuple):
    """A message parked at an approval gate, with the rules it was parked under
    (`approvers`, `deadline`): a reload does not change them."""

    id: str
    conversation: str
    frame: str
    owner: str
    listener: str
    sender: str
    hops: int
    envelope: bytes
    payload: bytes
    payload_sha256: str
    approvers: tuple[str, ...]
    created: float
    deadline: float
    state: str = "pending"
    decided_by: str | None = None
    reason: str | None = None
    decided_at: float | None = None
    call_ref: str = ""  # the caller's reference of the parked call


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
    """One retention policy, the one type for it in agentd (the configuration's
    `retention` keys are parsed into it).

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


RetentionPolicy = Retention | Mapping[str, Retention]
"""One policy for every profile, or a mapping profile -> policy (key "*": default;
profiles not listed and without "*" are retained forever). The configuration's
journal section parses the written form (`retain_days: N`, ...) into these."""
