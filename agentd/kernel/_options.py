"""The kernel's options: one typed object, the one place their defaults live.

The daemon makes it from the configuration's `journal` and `profiles` sections
(whose defaults are these); tests and benchmarks that open a kernel directly get
the same defaults and change only what they test.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentd.kernel._records import RETAIN_FOREVER, Retention, RetentionPolicy


@dataclass(frozen=True)
class KernelOptions:
    synchronous: str = "NORMAL"  # PRAGMA synchronous of ordinary batches
    # 0: commit as soon as the writer is free (a batch forms while it works);
    # above 0: also wait this long after the oldest queued transaction.
    commit_interval_s: float = 0.0
    commit_max_entries: int = 512
    retention: RetentionPolicy = RETAIN_FOREVER
    sweep_interval_s: float = 60.0
    max_slots_per_thread: int = 1000
    max_threads: int = 100000
    context_ttl_hours: float = 24.0
    audit_retention: Retention = RETAIN_FOREVER  # audit and security entries
    full_sync_profiles: frozenset[str] = frozenset()  # their batches commit with FULL
    max_db_bytes: int | None = None  # writes beyond fail like a full disk
    checkpoint_idle_s: float = 1.0  # idle time before wal_checkpoint(TRUNCATE)
    sweep_chunk: int = 5000  # journal rows deleted per retention transaction
    max_outbox_per_client: int = 10_000
    # The postgres backend: the libpq DSN of its database (None: SQLite in state_dir).
    dsn: str | None = None
    # postgres: the organism whose lease this kernel takes (None: no lease), whether
    # it waits for it (a standby), and how often it renews it; a holder silent for
    # three intervals loses it (the server ends its session).
    lease: str | None = None
    standby: bool = False
    lease_interval_s: float = 1.0


DEFAULT_KERNEL_OPTIONS = KernelOptions()
