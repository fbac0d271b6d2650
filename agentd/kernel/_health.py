"""Whether the kernel's writes succeed: an explicit state machine, pure.

Two states. HEALTHY: commits are acknowledged. FAILING: the last write failed (full
disk, I/O error, a size cap) or the writer process exited; nothing is acknowledged
until a write or a probe of the disk succeeds, and the writer retries with a backoff
that doubles on every further failure. `TRANSITIONS` is the whole machine;
`next_health` raises `IllegalTransition` on an event that makes no sense in a state
(a bug, not a storage problem). `WriteHealth` carries the state with the facts that go with it
(since when, the last error, the current backoff) and takes no I/O and no clock of
its own: the kernel passes the time in and logs what changed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agentd._states import step

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0


class Health(enum.Enum):
    HEALTHY = "healthy"
    FAILING = "failing"


class HealthEvent(enum.Enum):
    WRITE_SUCCEEDED = "write-succeeded"  # a batch that wrote something committed
    WRITE_FAILED = "write-failed"  # a batch failed on the storage
    WRITER_EXITED = "writer-exited"  # the writer process died on its own
    PROBE_SUCCEEDED = "probe-succeeded"  # the idle disk probe wrote and synced
    PROBE_FAILED = "probe-failed"


TRANSITIONS: dict[Health, dict[HealthEvent, Health]] = {
    Health.HEALTHY: {
        HealthEvent.WRITE_SUCCEEDED: Health.HEALTHY,
        HealthEvent.WRITE_FAILED: Health.FAILING,
        HealthEvent.WRITER_EXITED: Health.FAILING,
    },
    Health.FAILING: {
        HealthEvent.WRITE_SUCCEEDED: Health.HEALTHY,
        HealthEvent.WRITE_FAILED: Health.FAILING,
        HealthEvent.WRITER_EXITED: Health.FAILING,
        HealthEvent.PROBE_SUCCEEDED: Health.HEALTHY,
        HealthEvent.PROBE_FAILED: Health.FAILING,
    },
}


def next_health(state: Health, event: HealthEvent) -> Health:
    """The state after `event`; `IllegalTransition` if the table has no such entry
    (the probe runs only while failing)."""
    return step("kernel health", TRANSITIONS, state, event)


@dataclass
class WriteHealth:
    """The health state and its facts. `record` applies an event and says whether
    the state changed (the kernel logs the changes, not every repeat)."""

    state: Health = Health.HEALTHY
    since: float = 0.0  # when the current FAILING period began
    last_error: str = ""
    backoff: float = BACKOFF_START_S  # wait before the next retry while failing

    @property
    def healthy(self) -> bool:
        return self.state is Health.HEALTHY

    def record(self, event: HealthEvent, now: float, error: str = "") -> bool:
        before = self.state
        after = next_health(before, event)
        self.state = after
        if after is Health.HEALTHY:
            self.last_error = ""
            self.backoff = BACKOFF_START_S
        else:
            if before is Health.HEALTHY:
                self.since = now
            elif event is not HealthEvent.WRITER_EXITED:
                # Repeated failures back off; a writer exit alone changes no timing.
                self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
            self.last_error = error
        return after is not before
