"""The kernel's life: open, closing, closed. An explicit state machine, pure.

OPEN: transactions are accepted. CLOSING: `close()` was called; nothing new is
accepted, what was submitted is still committed, then the writer stops and the lock
is released. CLOSED: all of that is done. The first `close()` drives the machine; a
second one while closing waits for CLOSED, and one on a closed kernel returns.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class PhaseEvent(enum.Enum):
    CLOSE_REQUESTED = "close-requested"
    DRAINED = "drained"  # the writer loop ended, the writer stopped, the lock is free


TRANSITIONS: dict[Phase, dict[PhaseEvent, Phase]] = {
    Phase.OPEN: {PhaseEvent.CLOSE_REQUESTED: Phase.CLOSING},
    Phase.CLOSING: {PhaseEvent.DRAINED: Phase.CLOSED},
    Phase.CLOSED: {},
}


class IllegalPhaseEvent(RuntimeError):
    """An event that cannot happen in the current phase (a bug)."""


def next_phase(phase: Phase, event: PhaseEvent) -> Phase:
    try:
        return TRANSITIONS[phase][event]
    except KeyError:
        raise IllegalPhaseEvent(
            f"kernel: {event.value} is not possible while {phase.value}") from None
