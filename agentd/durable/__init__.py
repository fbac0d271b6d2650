"""Durable waits: timers, per-conversation handler state and approval gates, and
the one deadline scheduler that wakes the first and expires the last. Pure rules and
small owners; the pump applies them and the kernel stores them."""

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
from agentd.durable.deadlines import Deadline, DeadlineScheduler, is_late, sleep_for, take_due
from agentd.durable.operator import END_THREAD, end_thread
from agentd.durable.state import StateBook, StateLimitExceeded, StateView
from agentd.durable.timers import NAMESPACE as TIMER_NAMESPACE
from agentd.durable.timers import TimerRequest, Wait, Woke

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
