"""The kernel's life: open, closing, closed. An explicit state machine, pure.

OPEN: transactions are accepted. CLOSING: `close()` was called; nothing new is
accepted, what was submitted is still committed, then the writer stops and the lock
is released. CLOSED: all of that is done. The first `close()` drives the machine; a
second one while closing waits for CLOSED, and one on a closed kernel returns.
"""

from __future__ import annotations

import enum

from agentd._states import step


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


def next_phase(phase: Phase, event: PhaseEvent) -> Phase:
    """The phase after `event`; `IllegalTransition` if the table has no such entry."""
    return step("kernel", TRANSITIONS, phase, event)
