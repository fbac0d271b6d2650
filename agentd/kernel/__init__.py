"""The kernel: the one writer of durable state (threads, journal, outboxes, context
buffers, audit events, timers, handler state, parked approvals)
in one SQLite database in WAL mode, or in PostgreSQL. See docs/kernel.md."""

from agentd.kernel._errors import (
    ContextLimitExceeded,
    KernelUnavailable,
    LeaseHeld,
    LeaseLost,
    SchemaTooNew,
    StateDirUnsafe,
    StateLocked,
    TransactionRejected,
)
from agentd.kernel._health import Health
from agentd.kernel._kernel import Kernel
from agentd.kernel._lock import StateDirLock
from agentd.kernel._offline import DB_NAME, check_database, read_lease, verify_journal_main
from agentd.kernel._options import DEFAULT_KERNEL_OPTIONS, KernelOptions
from agentd.kernel._records import (
    PRUNE_ON_DELIVERY,
    PRUNE_ON_DELIVERY_MODE,
    RETAIN_DAYS_MODE,
    RETAIN_FOREVER,
    RETAIN_FOREVER_MODE,
    ApprovalRow,
    JournalEntry,
    Retention,
    RetentionPolicy,
    ThreadRow,
    TimerRow,
    retain_days,
)
from agentd.kernel._sweeps import SweepReport
from agentd.kernel._transaction import Transaction

__all__ = [
    "DB_NAME",
    "DEFAULT_KERNEL_OPTIONS",
    "PRUNE_ON_DELIVERY",
    "PRUNE_ON_DELIVERY_MODE",
    "RETAIN_DAYS_MODE",
    "RETAIN_FOREVER",
    "RETAIN_FOREVER_MODE",
    "ApprovalRow",
    "ContextLimitExceeded",
    "Health",
    "JournalEntry",
    "Kernel",
    "KernelOptions",
    "KernelUnavailable",
    "LeaseHeld",
    "LeaseLost",
    "Retention",
    "RetentionPolicy",
    "SchemaTooNew",
    "StateDirLock",
    "StateDirUnsafe",
    "StateLocked",
    "SweepReport",
    "ThreadRow",
    "TimerRow",
    "Transaction",
    "TransactionRejected",
    "check_database",
    "read_lease",
    "retain_days",
    "verify_journal_main",
]
