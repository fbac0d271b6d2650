"""Timers: the `wait` and `woke` payloads, and what the timer tool hands the pump.

A timer is not a handler sleeping. The timer tool's handler checks the request and
returns a `TimerRequest` at once; the pump writes the timer's row in the same
kernel transaction as the rest of that step (the `wait` marked handled), keeps the
call's frame open, and when the deadline scheduler says it is due, answers the
call with `woke`, like any reply, deleting the row in the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated

from agentd._xmlify import MaxLen, xmlify

NAMESPACE = "https://xml-pipeline.org/ns/tools/timer/v1"
MAX_NOTE = 1024


@xmlify(namespace=NAMESPACE)
@dataclass
class Wait:
    """Wake me after a delay: the caller later receives `woke` with the note."""

    seconds: Annotated[Decimal, "how long to wait, in seconds (decimal)"]
    note: Annotated[str, MaxLen(MAX_NOTE), "given back in `woke`"] | None = None


@xmlify(namespace=NAMESPACE)
@dataclass
class Woke:
    """A timer fired."""

    note: Annotated[str, MaxLen(MAX_NOTE), "the note given in `wait`"]
    late: Annotated[bool, "true when it fired more than 1 s after its due time"]


@dataclass(frozen=True, slots=True)
class TimerRequest:
    """A timer tool's answer to `wait`: set a timer for `seconds` from now. The pump
    refuses it (`huh denied`) when the conversation has `max_pending` already."""

    seconds: float
    note: str
    max_pending: int
