"""The kernel's state machines (write health, open/closing/closed), without a
database."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest

from agentd._states import IllegalTransition
from agentd.kernel import _health, _lifecycle
from agentd.kernel._health import (
    BACKOFF_MAX_S,
    BACKOFF_START_S,
    Health,
    HealthEvent,
    WriteHealth,
    next_health,
)
from agentd.kernel._lifecycle import Phase, PhaseEvent, next_phase

MACHINES = [
    (_health.TRANSITIONS, Health, HealthEvent, next_health),
    (_lifecycle.TRANSITIONS, Phase, PhaseEvent, next_phase),
]


@pytest.mark.parametrize(("table", "states", "events", "next_state"), MACHINES)
def test_every_state_and_event_is_either_a_transition_or_refused(
        table: Mapping[Any, Mapping[Any, Any]], states: Any, events: Any,
        next_state: Callable[[Any, Any], Any]) -> None:
    assert set(table) == set(states)
    for state in states:
        for event in events:
            if event in table[state]:
                assert next_state(state, event) is table[state][event]
            else:
                with pytest.raises(IllegalTransition, match=f"{event.value} .* {state.value}"):
                    next_state(state, event)


def test_a_probe_while_healthy_is_a_bug() -> None:
    for event in (HealthEvent.PROBE_SUCCEEDED, HealthEvent.PROBE_FAILED):
        with pytest.raises(IllegalTransition):
            next_health(Health.HEALTHY, event)


def test_any_failure_makes_a_healthy_kernel_failing_and_a_success_heals_it() -> None:
    for failure in (HealthEvent.WRITE_FAILED, HealthEvent.WRITER_EXITED):
        assert next_health(Health.HEALTHY, failure) is Health.FAILING
        assert next_health(Health.FAILING, failure) is Health.FAILING
    for success in (HealthEvent.WRITE_SUCCEEDED, HealthEvent.PROBE_SUCCEEDED):
        assert next_health(Health.FAILING, success) is Health.HEALTHY
    assert next_health(Health.HEALTHY, HealthEvent.WRITE_SUCCEEDED) is Health.HEALTHY


def test_a_walk_through_a_full_disk_and_back() -> None:
    h = WriteHealth()
    assert h.healthy and h.backoff == BACKOFF_START_S and h.last_error == ""
    assert h.record(HealthEvent.WRITE_FAILED, 100.0, "database or disk is full")
    assert (h.state, h.since, h.last_error) == (Health.FAILING, 100.0, "database or disk is full")
    assert h.backoff == BACKOFF_START_S  # the first retry comes quickly
    assert not h.record(HealthEvent.WRITE_FAILED, 101.0, "still full")
    assert h.backoff == 2 * BACKOFF_START_S and h.since == 100.0
    assert not h.record(HealthEvent.PROBE_FAILED, 102.0, "probe: full")
    assert h.backoff == 4 * BACKOFF_START_S and h.last_error == "probe: full"
    for second in range(20):
        h.record(HealthEvent.PROBE_FAILED, 103.0 + second, "full")
    assert h.backoff == BACKOFF_MAX_S  # bounded
    assert h.record(HealthEvent.PROBE_SUCCEEDED, 130.0)
    assert h.healthy and h.last_error == "" and h.backoff == BACKOFF_START_S
    assert h.since == 100.0  # kept, so the recovery can say how long it took


def test_a_writer_exit_fails_without_changing_the_retry_timing() -> None:
    h = WriteHealth()
    assert h.record(HealthEvent.WRITER_EXITED, 5.0, "writer process 42 exited")
    assert (h.state, h.since, h.backoff) == (Health.FAILING, 5.0, BACKOFF_START_S)
    h.record(HealthEvent.WRITE_FAILED, 6.0, "disk I/O error")
    assert h.backoff == 2 * BACKOFF_START_S
    assert not h.record(HealthEvent.WRITER_EXITED, 7.0, "writer process 43 exited")
    assert h.backoff == 2 * BACKOFF_START_S and h.last_error == "writer process 43 exited"
    assert h.record(HealthEvent.WRITE_SUCCEEDED, 8.0)
    assert h.healthy


def test_an_illegal_event_leaves_the_state_unchanged() -> None:
    h = WriteHealth()
    with pytest.raises(IllegalTransition):
        h.record(HealthEvent.PROBE_SUCCEEDED, 1.0)
    assert h.healthy and h.since == 0.0


# ---- open, closing, closed --------------------------------------------------------------


def test_a_close_walks_open_closing_closed_and_nothing_follows() -> None:
    phase = next_phase(Phase.OPEN, PhaseEvent.CLOSE_REQUESTED)
    assert phase is Phase.CLOSING
    with pytest.raises(IllegalTransition):  # the first close() drives it, alone
        next_phase(phase, PhaseEvent.CLOSE_REQUESTED)
    phase = next_phase(phase, PhaseEvent.DRAINED)
    assert phase is Phase.CLOSED
    for event in PhaseEvent:
        with pytest.raises(IllegalTransition):
            next_phase(phase, event)


def test_a_kernel_cannot_drain_before_closing() -> None:
    with pytest.raises(IllegalTransition):
        next_phase(Phase.OPEN, PhaseEvent.DRAINED)
