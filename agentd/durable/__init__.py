"""Durable waits: timers, per-conversation handler state and approval gates, and
the one deadline scheduler that wakes the first and expires the last. Pure rules and
small owners; the pump applies them and the kernel stores them."""

from typing import TYPE_CHECKING

from agentd._lazy import lazy_exports
from agentd.durable.deadlines import Deadline, DeadlineScheduler, is_late, sleep_for, take_due
from agentd.durable.state import StateBook, StateLimitExceeded, StateView
from agentd.durable.timers import NAMESPACE as TIMER_NAMESPACE
from agentd.durable.timers import TimerRequest, Wait, Woke

# Approvals and the operator's command need the kernel's records and the OOB layer: a
# handler's worker, which imports `meta.state`'s book from here, does without them.
if TYPE_CHECKING:
    from agentd.durable.approvals import (
        APPROVE,
        CLIENT,
        DECISIONS,
        DENY,
        NOT_APPROVED,
        OPERATOR,
        ApprovalEvent,
        ApprovalRules,
        ApprovalState,
        Decision,
        approval_required,
        close,
        decision_from,
        iso_time,
        judge,
        new_approval_id,
        payload_sha256,
    )
    from agentd.durable.operator import END_THREAD, end_thread

__getattr__, __dir__ = lazy_exports(__name__, {
    "agentd.durable.approvals": (
        "APPROVE", "CLIENT", "DECISIONS", "DENY", "NOT_APPROVED", "OPERATOR", "ApprovalEvent",
        "ApprovalRules", "ApprovalState", "Decision", "approval_required", "close",
        "decision_from", "iso_time", "judge", "new_approval_id", "payload_sha256"),
    "agentd.durable.operator": ("END_THREAD", "end_thread"),
})

__all__ = [
    "APPROVE",
    "CLIENT",
    "DECISIONS",
    "DENY",
    "END_THREAD",
    "NOT_APPROVED",
    "OPERATOR",
    "TIMER_NAMESPACE",
    "ApprovalEvent",
    "ApprovalRules",
    "ApprovalState",
    "Deadline",
    "DeadlineScheduler",
    "Decision",
    "StateBook",
    "StateLimitExceeded",
    "StateView",
    "TimerRequest",
    "Wait",
    "Woke",
    "approval_required",
    "close",
    "decision_from",
    "end_thread",
    "is_late",
    "iso_time",
    "judge",
    "new_approval_id",
    "payload_sha256",
    "sleep_for",
    "take_due",
]
