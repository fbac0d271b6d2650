"""The approval gate: does a routed request run now, wait for a human, or is it refused.

`gate` is a pure decision over values: the admitted message, the gates of its
thread's table and the counts of what is parked (`ParkedCounts`, kept by the
pump's waits as messages are parked and decided). The pump applies the result:
`PASS` queues the message, `Park` parks it under the rules it names, `Deny` answers
its sender with the code and reports the `approval-limit` security event.

Invariants:
- Only a request is gated (an answer, an ack or an intent never is), at the first
  of its targets that has a gate.
- Parked messages are bounded per conversation, per client and in all, by count and
  by envelope bytes (they are held in memory until decided), so one client cannot
  fill the daemon's share for everyone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from agentd._errors import HuhCode
from agentd.durable import ApprovalRules
from agentd.kernel import ApprovalRow
from agentd.pump.message import Message, MsgKind

# Messages waiting for a human decision: a handler (or a client) cannot park more,
# in one conversation, in one client's conversations or in all, whatever its fan-out
# and rate.
MAX_PARKED_PER_CONVERSATION = 64
MAX_PARKED_PER_CLIENT = 1_000
MAX_PARKED = 10_000

_REQUEST = MsgKind.REQUEST


class Pass:
    """Not gated: the message runs now."""

    __slots__ = ()


PASS = Pass()


class Park(NamedTuple):
    """Parked for a decision under `rules`, the gate of the target `listener`."""

    rules: ApprovalRules
    listener: str


class Deny(NamedTuple):
    """Refused: too much is parked. The sender is answered `huh code`; `event` holds
    the fields of the `approval-limit` security event."""

    code: HuhCode
    event: dict[str, str]


class ParkedCounts:
    """What is parked, counted the ways the gate bounds it. A key leaves with its
    last message, so each map holds only what is pending."""

    __slots__ = ("bytes", "bytes_of_client", "ids_of", "max_bytes", "max_bytes_per_client",
                 "max_parked", "max_parked_per_client", "of_client", "total")

    def __init__(self, max_bytes: int, max_bytes_per_client: int, *,
                 max_parked: int = MAX_PARKED,
                 max_parked_per_client: int = MAX_PARKED_PER_CLIENT) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_client = max_bytes_per_client
        self.max_parked = max_parked
        self.max_parked_per_client = max_parked_per_client
        self.total = 0
        self.bytes = 0  # envelope bytes of every parked message
        self.ids_of: dict[str, set[str]] = {}  # conversation -> approval ids
        self.of_client: dict[str, int] = {}  # client -> how many parked
        self.bytes_of_client: dict[str, int] = {}  # client -> bytes parked

    def add(self, row: ApprovalRow) -> None:
        self.total += 1
        self.ids_of.setdefault(row.conversation, set()).add(row.id)
        count_up(self.of_client, row.owner)
        size = len(row.envelope)
        self.bytes += size
        count_up(self.bytes_of_client, row.owner, size)

    def remove(self, row: ApprovalRow) -> None:
        self.total -= 1
        unindex(self.ids_of, row.conversation, row.id)
        count_down(self.of_client, row.owner)
        size = len(row.envelope)
        self.bytes -= size
        count_down(self.bytes_of_client, row.owner, size)


def gate(msg: Message, gates: Mapping[str, ApprovalRules], counts: ParkedCounts
         ) -> Pass | Park | Deny:
    """Whether `msg`, admitted on a thread whose table has `gates`, runs now, parks,
    or is refused: `huh denied` if its conversation, its client or everyone already
    has the most messages parked; `huh rate-limited` (retry once a decision made
    room) if its envelope would take its client's parked bytes past
    `pump.max_parked_bytes_per_client` or everyone's past `pump.max_parked_bytes`."""
    if not gates or msg.kind is not _REQUEST:
        return PASS
    for target in msg.targets:
        rules = gates.get(target.name)
        if rules is not None:
            break
    else:
        return PASS
    root = msg.frame.root
    owner = root.owner
    size = len(msg.envelope)
    if (counts.total >= counts.max_parked
            or len(counts.ids_of.get(root.uuid, ())) >= MAX_PARKED_PER_CONVERSATION
            or counts.of_client.get(owner, 0) >= counts.max_parked_per_client):
        code = HuhCode.DENIED
    elif (counts.bytes + size > counts.max_bytes
          or counts.bytes_of_client.get(owner, 0) + size > counts.max_bytes_per_client):
        code = HuhCode.RATE_LIMITED
    else:
        return Park(rules, target.name)
    return Deny(code, {"thread": root.uuid, "sender": msg.sender, "pending": str(counts.total),
                       "parked_bytes": str(counts.bytes), "refused": code.value})


# Counts and indexes of what is pending (here, and the waits' holds by frame and
# timers by client): a key leaves with its last item.


def count_up(counts: dict[str, int], key: str, by: int = 1) -> None:
    counts[key] = counts.get(key, 0) + by


def count_down(counts: dict[str, int], key: str, by: int = 1) -> None:
    n = counts.get(key, 0) - by
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def unindex(index: dict[str, set[str]], key: str, item: str) -> bool:
    """Take `item` out of `index[key]`; whether `key` still holds any."""
    items = index.get(key)
    if items is None:
        return False
    items.discard(item)
    if not items:
        del index[key]
    return bool(items)
