"""The one walk of a state machine's table: every (state, event) pair is either in
the table, and `transition` returns its target, or raises `IllegalTransition`."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from agentd._states import IllegalTransition


def walk_table(
    table: Mapping[Any, Mapping[Any, Any]],
    transition: Callable[[Any, Any], Any],
    states: type[enum.Enum],
    events: type[enum.Enum],
) -> None:
    for state, event in itertools.product(states, events):
        allowed = table[state].get(event)
        if allowed is None:
            with pytest.raises(IllegalTransition):
                transition(state, event)
        else:
            assert transition(state, event) is allowed
