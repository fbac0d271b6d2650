"""The kernel's error types. All are `AgentdError`s; `KernelUnavailable` (and its
subclass `TransactionRejected`) is what the pump turns into `huh internal`."""

from __future__ import annotations

from agentd._errors import AgentdError


class StateLocked(AgentdError):
    """Another process (or another Kernel in this one) holds the state directory."""


class StateDirUnsafe(AgentdError):
    """The state directory (or its lock file) could be replaced by another user."""


class SchemaTooNew(AgentdError):
    """The database was written by a newer agentd than this one."""


class KernelUnavailable(AgentdError):
    """A write could not be made durable (disk full, I/O error, kernel closed).

    Nothing covered by the failed commit was written; the caller must not acknowledge it.
    """


class WriterExited(KernelUnavailable):
    """The writer process died with the call in flight: whether its batch committed is
    not known here. The kernel asks the next writer (see `Kernel._settle_orphans`)."""


class LeaseHeld(KernelUnavailable):
    """Another daemon holds the organism's lease on the postgres backend (and this one
    was not started to wait for it)."""


class LeaseLost(KernelUnavailable):
    """This daemon's lease on the postgres backend is gone (its epoch is stale: it
    lost its connection, was paused, or another daemon took over). Its kernel writes
    nothing more; the daemon stops serving and exits non-zero."""


class TransactionRejected(KernelUnavailable):
    """This one transaction failed on its own (e.g. a constraint), not the storage.

    The other transactions of its batch were committed without it.
    """


class ContextLimitExceeded(AgentdError):
    """`max_slots_per_thread` or `max_threads` of the context buffer would be exceeded."""
