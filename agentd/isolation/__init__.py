"""Handler isolation: listeners whose handlers run in confined worker processes.

- `IsolationPools`: the daemon's pools, one per isolated listener; `apply(config)`
  starts them and returns the handlers routing gives those listeners.
- `WorkerPool`, `WorkerSpec`, `WorkerFailed`: one listener's pool.
- `effective_isolation(config)`: which listeners run isolated, and how.

The worker's own main is `agentd.isolation.worker`; the byte protocol between
them is `_protocol`. The exports load on first use: a worker imports this
package too, and must not pay for the daemon's side (configuration, metrics).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentd.isolation._plan import effective_isolation
    from agentd.isolation._pool import WorkerPool
    from agentd.isolation._pools import IsolationPools
    from agentd.isolation._worker import WorkerFailed, WorkerSpec

_EXPORTS = {
    "IsolationPools": "_pools",
    "WorkerFailed": "_worker",
    "WorkerPool": "_pool",
    "WorkerSpec": "_worker",
    "effective_isolation": "_plan",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"agentd.isolation.{module}"), name)


__all__ = ["IsolationPools", "WorkerFailed", "WorkerPool", "WorkerSpec", "effective_isolation"]
