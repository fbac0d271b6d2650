"""Explicit state machines, the one way agentd writes them: each machine is an enum
of states, an enum of events and a transition table; `step` applies an event or
refuses it. A missing entry in a table is an event that cannot happen in that state,
so it is a bug: it raises instead of being ignored. Every transition table of
agentd steps through it; a leaf module that imports nothing of agentd."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(RuntimeError):
    """An event that the transition table does not allow in the current state."""


def step(machine: str, table: Mapping[S, Mapping[E, S]], state: S, event: E) -> S:
    try:
        return table[state][event]
    except KeyError:
        raise IllegalTransition(
            f"{machine}: {event.value} is not possible while {state.value}") from None
