"""The gateway link's pure parts: the state machine, the backoff, the tie-break."""

from __future__ import annotations

import pytest

from agentd._states import IllegalTransition
from agentd.federation._gateway import (
    TRANSITIONS,
    Backoff,
    LinkEvent,
    LinkState,
    keeps_link,
    transition,
)
from tests.state_tables import walk_table


def test_transition_table_walk() -> None:
    walk_table(TRANSITIONS, transition, LinkState, LinkEvent)


def test_a_dial_that_fails_goes_back_down_and_an_accepted_link_comes_up() -> None:
    state = transition(LinkState.DOWN, LinkEvent.DIAL)
    assert transition(state, LinkEvent.FAILED) is LinkState.DOWN
    assert transition(LinkState.DOWN, LinkEvent.AUTHENTICATED) is LinkState.UP
    assert transition(LinkState.UP, LinkEvent.LOST) is LinkState.DOWN


def test_nothing_comes_up_after_stop() -> None:
    with pytest.raises(IllegalTransition):
        transition(LinkState.STOPPED, LinkEvent.AUTHENTICATED)
    with pytest.raises(IllegalTransition):
        transition(LinkState.STOPPED, LinkEvent.DIAL)


def test_backoff_grows_to_its_ceiling_with_jitter() -> None:
    b = Backoff(initial=0.5, maximum=30.0)
    assert b.delay(0, 0.0) == 0.25 and b.delay(0, 0.999) < 0.5
    assert b.delay(3, 0.0) == 2.0
    assert b.delay(10, 0.999) <= 30.0 and b.delay(10, 0.0) == 15.0
    assert b.delay(10_000, 0.5) <= 30.0  # no overflow for a peer down for days


def test_both_sides_keep_the_same_of_two_links() -> None:
    # alpha dialed link A, beta dialed link B: alpha sorts first, so A survives.
    assert keeps_link("alpha", "beta", dialed_by_local=True)
    assert not keeps_link("alpha", "beta", dialed_by_local=False)
    assert keeps_link("beta", "alpha", dialed_by_local=False)
    assert not keeps_link("beta", "alpha", dialed_by_local=True)
