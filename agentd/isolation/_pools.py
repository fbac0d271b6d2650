"""The daemon's isolation pools: one `WorkerPool` per isolated listener (handler
or agent).

Built from the configuration (`effective_isolation`), started before the bus
accepts anything, and passed to routing as the handlers of those listeners. On a
reload, a listener whose declaration is unchanged keeps its pool; changed and new
ones get new pools. A pool the new configuration no longer uses is *retired*, not
stopped: threads created before the reload keep routing with their own dispatch
table, which still names it. It is stopped once no live thread's table is that
old (`close_unused`, asked at each reload and by the daemon's maintenance loop).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any

from agentd._errors import ConfigError
from agentd.config import OrganismConfig
from agentd.confine import cgroups, landlock_status
from agentd.isolation._plan import (
    WORKER_ARGV,
    agent_init,
    effective_isolation,
    reply_refs,
    secret_paths,
    worker_init,
    worker_policy,
)
from agentd.isolation._pool import WorkerPool
from agentd.isolation._worker import WorkerSpec

log = logging.getLogger("agentd.isolation")


class IsolationPools:
    def __init__(self, others: int = 2) -> None:
        """`others`: the processes besides the workers that want a core under load,
        the daemon's and its kernel writer's (1 for a pump without a kernel); a
        worker spins under load only where its pool and these fit the cores."""
        self.others = others
        self.pools: dict[str, WorkerPool] = {}
        # (pool, the last dispatch-table version that routes to it)
        self.retired: list[tuple[WorkerPool, int]] = []

    @staticmethod
    def specs(config: OrganismConfig, catalogues: Callable[[str], Any] | None = None
              ) -> dict[str, WorkerSpec]:
        """The worker spec of every isolated listener (raises ConfigError).
        `catalogues(agent)`: an agent's tool catalogue, needed when an agent is
        isolated (its worker gets it at start)."""
        chosen = effective_isolation(config)
        if not chosen:
            return {}
        secrets = secret_paths(config)
        sys_path = list(sys.path)
        specs = {}
        for name, iso in chosen.items():
            lst = config.listener(name)
            agent = replies = None
            if lst.agent is not None:
                if catalogues is None:
                    raise ConfigError([f"{lst.location}: listeners: {name}: an isolated "
                                       "agent needs the platform (agent handlers)"])
                agent = agent_init(lst, catalogues(name), config.pump.max_fanout)
            else:
                replies = reply_refs(config, lst)
            specs[name] = WorkerSpec(
                listener=name, argv=WORKER_ARGV,
                policy=worker_policy(lst, iso, secrets, sys_path, replies or ()),
                init=worker_init(lst, sys_path, replies or (), agent,
                                 config.pump.max_state_bytes_per_thread),
                workers=iso.workers,
                max_calls=iso.max_calls, max_rss_mb=iso.max_rss_mb)
        return specs

    async def apply(
        self, config: OrganismConfig, last_version: int | None = None, agents: Any = None
    ) -> dict[str, Callable[..., Any]]:
        """Start the pools `config` needs (keeping unchanged ones); returns the
        handler of each isolated listener. Pools no longer needed are retired with
        `last_version`, the newest table that routes to them (None: stopped now,
        as nothing routes yet). An isolated agent's pool answers its worker's
        requests with `agents`' platform; a pool bound to another platform is
        replaced like a changed one."""
        platform = getattr(agents, "platform", None)
        specs = self.specs(config, None if platform is None else (
            lambda name: platform.prompt(name).catalogue))
        if specs and not landlock_status().filesystem:
            log.warning("isolation: Landlock unavailable: workers keep the filesystem "
                        "access of the daemon's uid (see agentctl status)")
        keep = {n: pool for n, pool in self.pools.items() if specs.get(n) == pool.spec
                and (pool.bridge is None or pool.bridge.platform is platform)}
        fresh = {n: WorkerPool(s, self._bridge(config, n, platform), self.others)
                 for n, s in specs.items() if n not in keep}
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
            if last_version is None:
                await pool.stop()
            else:
                self.retired.append((pool, last_version))
        return {name: pool.handler for name, pool in self.pools.items()}

    @staticmethod
    def _bridge(config: OrganismConfig, name: str, platform: Any) -> Any:
        lst = config.listener(name)
        if lst.agent is None:
            return None
        from agentd._xmlify import spec_of
        from agentd.isolation._agent import AgentBridge  # the platform: agents only

        return AgentBridge(platform.session(name), platform, lst.agent.max_iterations,
                           {spec_of(c).clark for c in lst.payload_classes},
                           config.pump.max_fanout)

    async def close_unused(self, live_versions: Callable[[], Collection[int]]) -> int:
        """Stop the retired pools that no live table reaches; `live_versions` is
        asked only when a pool is retired (it walks every live thread)."""
        if not self.retired:
            return 0
        live = live_versions()
        gone = [(pool, last) for pool, last in self.retired
                if not any(v <= last for v in live)]
        for entry in gone:
            self.retired.remove(entry)
            await entry[0].stop()
        if gone:
            log.info("isolation pools of older configurations stopped count=%d", len(gone))
        return len(gone)

    async def stop(self) -> None:
        for pool in [*self.pools.values(), *(pool for pool, _ in self.retired)]:
            await pool.stop()
        self.pools = {}
        self.retired = []

    def status(self) -> Mapping[str, Any]:
        return {"confinement": {**landlock_status().as_dict(), "pids_cgroup": cgroups().describe()},
                "pools": [{"listener": name, **pool.status()}
                          for name, pool in sorted(self.pools.items())],
                "retired_pools": len(self.retired)}
