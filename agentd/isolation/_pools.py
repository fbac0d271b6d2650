"""The daemon's isolation pools: one `WorkerPool` per isolated listener.

Built from the configuration (`effective_isolation`), started before the bus
accepts anything, and passed to routing as the handlers of those listeners. On a
reload, a listener whose declaration is unchanged keeps its pool; changed and new
ones get new pools; pools no longer used are stopped.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from agentd.config import OrganismConfig
from agentd.confine import landlock_status
from agentd.isolation._plan import (
    WORKER_ARGV,
    effective_isolation,
    secret_paths,
    worker_init,
    worker_policy,
)
from agentd.isolation._pool import WorkerPool, WorkerSpec

log = logging.getLogger("agentd.isolation")


class IsolationPools:
    def __init__(self) -> None:
        self.pools: dict[str, WorkerPool] = {}

    @staticmethod
    def specs(config: OrganismConfig) -> dict[str, WorkerSpec]:
        """The worker spec of every isolated listener (raises ConfigError)."""
        chosen = effective_isolation(config)
        if not chosen:
            return {}
        secrets = secret_paths(config)
        sys_path = list(sys.path)
        specs = {}
        for name, iso in chosen.items():
            lst = config.listener(name)
            specs[name] = WorkerSpec(
                listener=name, argv=WORKER_ARGV,
                policy=worker_policy(lst, iso, secrets, sys_path),
                init=worker_init(lst, sys_path), workers=iso.workers,
                max_calls=iso.max_calls, max_rss_mb=iso.max_rss_mb)
        return specs

    async def apply(self, config: OrganismConfig) -> dict[str, Callable[..., Any]]:
        """Start the pools `config` needs (keeping unchanged ones); returns the
        handler of each isolated listener. Pools no longer needed are stopped."""
        specs = self.specs(config)
        if specs and not landlock_status().filesystem:
            log.warning("isolation: Landlock unavailable: workers keep the filesystem "
                        "access of the daemon's uid (see agentctl status)")
        keep = {n: pool for n, pool in self.pools.items() if specs.get(n) == pool.spec}
        fresh = {n: WorkerPool(s) for n, s in specs.items() if n not in keep}
        started: list[WorkerPool] = []
        try:
            for pool in fresh.values():
                await pool.start()
                started.append(pool)
        except BaseException:
            for pool in started:
                await pool.stop()
            raise
        old = [pool for n, pool in self.pools.items() if n not in keep]
        self.pools = {**keep, **fresh}
        for pool in old:
            await pool.stop()
        return {name: pool.call for name, pool in self.pools.items()}

    async def stop(self) -> None:
        for pool in self.pools.values():
            await pool.stop()
        self.pools = {}

    def status(self) -> Mapping[str, Any]:
        return {"confinement": landlock_status().as_dict(),
                "pools": [{"listener": name, **pool.status()}
                          for name, pool in sorted(self.pools.items())]}
