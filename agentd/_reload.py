"""Reload: a plan built from the new configuration alone, then an apply.

`plan_reload(current, new)` is pure: two checked configurations in, a `ReloadPlan`
out (or `ConfigError` for a change that only a restart can make). It compares
listener declarations, each agent's assembled prompt (by hash) and the LLM section,
the clients, the bus certificate and the settings that are read only at start. A dry
run stops there: nothing is built and nothing live changes.

`reload_daemon` runs preflight on the re-read file, plans, and (unless dry) applies:
it builds the new routing (and a new LLM platform when an agent is added or
changed) before touching anything, then swaps it in.

Invariants:
- Threads that exist keep the dispatch table they were created with, and so the
  listener objects and the LLM platform behind it; new threads get the new ones.
- A platform no longer behind the live routing is closed once no live thread's table
  can reach it (`AgentPlatforms.close_unused`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentd._errors import ConfigError
from agentd._preflight import CheckedConfig, preflight
from agentd._routing import Routing, listener_signature
from agentd.config import ClientEntry, OrganismConfig, load_config

if TYPE_CHECKING:
    from agentd.bus import ClientsDiff
    from agentd.isolation import IsolationPools
    from agentd.kernel import Kernel
    from agentd.platform import AgentHandlers
    from agentd.pump import Pump

log = logging.getLogger("agentd.reload")

# Settings a reload applies; every other change to these sections waits for a restart.
# Read again at every use or reload, so never a restart (pump.thread_idle_s: the idle
# collector reads the configuration in service each time it runs).
_RELOADED = frozenset({"bus.tls", "auth.clients_file", "oob.authorized_keys",
                       "pump.thread_idle_s"})
_READ_AT_START = ("bus", "auth", "oob", "metrics", "pump", "journal", "embeddings")
_FEDERATION_AT_START = ("identity", "federation", "gateways")  # whole sections, optional


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload changes. Listener names are sorted; `changed` includes agents
    whose prompt text or LLM backends changed with an identical declaration."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    clients: ClientsDiff | None = None  # None: the daemon has no clients file
    tls_cert: str | None = None  # the certificate new bus connections will get
    restart_needed: tuple[str, ...] = ()  # changed settings read only at start
    new_platform: bool = False  # an agent is added or changed, or `llm`: a new platform

    def result(self, version: int, dry_run: bool) -> dict[str, Any]:
        """The operator's view (`agentctl reload`)."""
        out: dict[str, Any] = {
            "added": list(self.added),
            "removed": list(self.removed),
            "changed": list(self.changed),
            "version": version,
            "dry_run": dry_run,
        }
        if self.clients is not None:
            out.update(clients_added=list(self.clients.added),
                       clients_removed=list(self.clients.removed),
                       clients_changed=list(self.clients.changed))
        if self.tls_cert is not None:
            out["tls_cert"] = self.tls_cert
        if self.restart_needed:
            out["restart_needed"] = list(self.restart_needed)
        return out


def llm_changed(current: CheckedConfig, new: CheckedConfig) -> bool:
    """Whether the agents' LLM side changed: the `llm` section, or the contents of a
    replay cassette (failover may reach any backend, so this concerns every agent)."""
    return (current.config.llm, current.cassette_digests) != (
        new.config.llm, new.cassette_digests
    )


def plan_reload(current: CheckedConfig, new: CheckedConfig,
                started: CheckedConfig | None = None) -> ReloadPlan:
    """The difference between the running configuration and the new one; raises
    `ConfigError` for what a reload cannot do (add or remove the bus or the clients
    file)."""
    old_cfg, new_cfg = current.config, new.config
    bus_running = old_cfg.bus.tls is not None and old_cfg.auth.clients_file is not None
    issues = []
    if bus_running and new_cfg.bus.tls is None:
        issues.append("bus.tls: the bus is running; removing it needs a restart")
    if (old_cfg.auth.clients_file is None) != (new_cfg.auth.clients_file is None):
        issues.append("auth.clients_file: adding or removing the clients file needs a restart")
    if issues:
        raise ConfigError(issues)
    old = {cfg.name: cfg for cfg in old_cfg.listeners}
    llm = llm_changed(current, new)
    new_names = _names(new_cfg)
    added = tuple(sorted(n for n in new_names if n not in old))
    removed = tuple(sorted(n for n in old if n not in new_names))
    changed = tuple(sorted(
        cfg.name
        for cfg in new_cfg.listeners
        if cfg.name in old
        and (
            listener_signature(old[cfg.name]) != listener_signature(cfg)
            or (cfg.agent is not None and (
                llm or current.prompt_digests.get(cfg.name) != new.prompt_digests[cfg.name]
            ))
        )
    ))
    agents = {cfg.name for cfg in new_cfg.listeners if cfg.agent is not None}
    return ReloadPlan(
        added=added,
        removed=removed,
        changed=changed,
        clients=_clients_change(current.clients, new.clients),
        tls_cert=str(new_cfg.bus.tls.cert) if bus_running and new_cfg.bus.tls else None,
        # Against what the daemon started with, not the last reload: settings read
        # at start keep their first values until a restart, whatever reloads said.
        restart_needed=_restart_needed(started or current, new),
        # Without agents the platform still serves semantic routing: a new `llm`
        # section is a new platform too.
        new_platform=bool(agents & {*added, *changed}) or llm,
    )


def _names(config: OrganismConfig) -> set[str]:
    return {cfg.name for cfg in config.listeners}


def _clients_change(
    old: Mapping[str, ClientEntry] | None, new: Mapping[str, ClientEntry] | None
) -> ClientsDiff | None:
    if old is None or new is None:
        return None
    from agentd.bus import diff_clients

    return diff_clients(old, new)


def _restart_needed(current: CheckedConfig, new: CheckedConfig) -> tuple[str, ...]:
    found = []
    for section in _READ_AT_START:
        old_sec, new_sec = getattr(current.config, section), getattr(new.config, section)
        for f in dataclasses.fields(old_sec):
            key = f"{section}.{f.name}"
            if key not in _RELOADED and getattr(old_sec, f.name) != getattr(new_sec, f.name):
                found.append(key)
    for key in _FEDERATION_AT_START:
        if getattr(current.config, key) != getattr(new.config, key):
            found.append(key)
    return tuple(found)


# ---- the platforms behind the agents ----------------------------------------------------


@dataclass
class ServedPlatform:
    """A platform and the routing versions whose agents run on it."""

    handlers: AgentHandlers
    first_version: int
    last_version: int | None = None  # None: it serves the live routing


@dataclass
class AgentPlatforms:
    """The LLM platforms the daemon's agents run on: the live one, and older ones
    that threads pinned to older dispatch tables may still call."""

    served: list[ServedPlatform] = field(default_factory=list)

    @property
    def current(self) -> AgentHandlers | None:
        live = [s for s in self.served if s.last_version is None]
        return live[-1].handlers if live else None

    def adopt(self, handlers: AgentHandlers | None, version: int) -> None:
        """`handlers` serve routing `version` on; with None, the live one goes on."""
        if handlers is None:
            return
        for s in self.served:
            if s.last_version is None:
                s.last_version = version - 1
        self.served.append(ServedPlatform(handlers, version))

    def unused(self, live_versions: Collection[int]) -> list[ServedPlatform]:
        """Retired platforms that no table of `live_versions` reaches."""
        return [
            s for s in self.served
            if s.last_version is not None
            and not any(s.first_version <= v <= s.last_version for v in live_versions)
        ]

    async def close_unused(self, live_versions: Callable[[], Collection[int]]) -> int:
        """Close the unused retired platforms; `live_versions` is asked only when one
        is retired (it walks every live thread)."""
        if all(s.last_version is None for s in self.served):
            return 0
        gone = self.unused(live_versions())
        for s in gone:
            self.served.remove(s)
            await s.handlers.platform.aclose()
        if gone:
            log.info("llm platforms closed count=%d", len(gone))
        return len(gone)

    async def aclose(self) -> None:
        for s in self.served:
            await s.handlers.platform.aclose()
        self.served.clear()


def build_agent_handlers(
    config: Any,
    kernel: Kernel | None,
    audit: Callable[[str, Mapping[str, str]], None],
) -> AgentHandlers | None:
    """A new platform and its handlers for the agents of `config`; None when it has
    neither agents nor an `llm` section. An organism of tools only with `llm` still
    gets the platform: semantic routing fills intents through it."""
    if config.llm is None and not any(lst.agent is not None for lst in config.listeners):
        return None
    from agentd.platform import make_agent_handlers

    return make_agent_handlers(config, kernel=kernel, audit=audit)


# ---- the daemon's reload --------------------------------------------------------------


class ReloadedDaemon(Protocol):
    """The daemon as a reload sees it (`agentd._daemon.Daemon`): what it reads,
    what it swaps and whom it tells."""

    config: OrganismConfig
    config_path: Path | None
    checked: CheckedConfig
    started_with: CheckedConfig | None
    kernel: Kernel | None
    routing: Routing | None
    pump: Pump | None
    platforms: AgentPlatforms
    isolation: IsolationPools
    oob: Any
    bus: Any
    auth: Any

    @property
    def agents(self) -> AgentHandlers | None: ...

    def audit(self, kind: str, fields: Mapping[str, str]) -> None: ...

    def client_profiles(self) -> dict[str, str]: ...

    def preview(self, owner: str, conversation: str, agent: str,
                configured: bool = False) -> Any: ...


async def reload_daemon(daemon: ReloadedDaemon, dry_run: bool) -> dict[str, Any]:
    """Re-read the daemon's file, check it fully, plan, and (unless `dry_run`) apply.
    Any error before the swap changes nothing; nor does a dry run. Loading puts the
    new `python_path` folders on `sys.path`: they are taken off again unless the new
    configuration is put in service (else every later import, and the next reload,
    would see folders that a fresh start would not)."""
    path = list(sys.path)
    applied = False
    try:
        result = await _reload(daemon, dry_run)
        applied = not dry_run
        return result
    finally:
        if not applied:
            _forget_folders([f for f in sys.path if f not in path])
            sys.path[:] = path


def _forget_folders(folders: list[str]) -> None:
    """Drop the modules imported from `folders` (python_path folders a reload that was
    not applied added): a later reload must import them again, from the folders its
    own file names, or fail as a fresh start would."""
    roots = tuple(os.path.join(os.path.abspath(f), "") for f in folders)
    if not roots:
        return
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if where and os.path.abspath(where).startswith(roots):
            del sys.modules[name]


async def _reload(daemon: ReloadedDaemon, dry_run: bool) -> dict[str, Any]:
    assert daemon.pump is not None and daemon.routing is not None
    if daemon.config_path is None:
        raise ConfigError(["the daemon was not started from a configuration file"])
    path, state_dir = daemon.config_path, daemon.config.state_dir
    # Off the event loop: loading compiles WASM modules (seconds for a large one) and
    # reads every file the configuration names; the daemon serves meanwhile.
    new = await asyncio.to_thread(
        lambda: preflight(load_config(path, state_dir_override=state_dir)))
    plan = plan_reload(daemon.checked, new, daemon.started_with)
    version = daemon.routing.version + 1
    if dry_run:
        return plan.result(version, dry_run=True)
    handlers = build_agent_handlers(new.config, daemon.kernel, daemon.audit) if (
        plan.new_platform) else None
    agents: Mapping[str, Any] = handlers or daemon.agents or {}  # those the new table runs
    try:
        isolated = await daemon.isolation.apply(new.config, daemon.routing.version,
                                                agents=agents)
        rebuild = [cfg.name for cfg in new.config.listeners if cfg.agent] if handlers else []
        # A listener whose pool changed (or that moved in or out of a worker), or whose
        # imported handler function is another one, gets a new runtime object; threads
        # on older tables keep theirs. (Every tool gets a new one: `Routing.build`.)
        for cfg in new.config.listeners:
            old = daemon.routing.listeners.get(cfg.name)
            if old is None or cfg.loaded_tool is not None or cfg.name in rebuild:
                continue
            now = isolated.get(cfg.name) or (
                cfg.handler if cfg.agent is None else agents.get(cfg.name))
            if old.handler != now:
                rebuild.append(cfg.name)
        new_routing = Routing.build(
            new.config,
            version=version,
            agent_handlers=handlers,
            previous=daemon.routing,
            # Every agent moves to the new platform; threads on older tables keep theirs.
            rebuild=rebuild,
            isolated_handlers=isolated,
        )
    except BaseException:
        if handlers is not None:
            await handlers.platform.aclose()
        raise
    _swap(daemon, plan, new, new_routing, handlers)
    result = plan.result(version, dry_run=False)
    daemon.audit(
        "reload", {k: ",".join(v) if isinstance(v, list) else str(v) for k, v in result.items()}
    )
    await daemon.platforms.close_unused(lambda: live_table_versions(daemon))
    await daemon.isolation.close_unused(lambda: live_table_versions(daemon))
    return result


def _swap(
    daemon: ReloadedDaemon,
    plan: ReloadPlan,
    new: CheckedConfig,
    routing: Routing,
    handlers: AgentHandlers | None,
) -> None:
    """Put the built configuration in service. Nothing here can fail on the new
    configuration: it passed preflight and every object is already built."""
    assert daemon.pump is not None and daemon.routing is not None
    if handlers is not None:
        handlers.platform.bind_threads(daemon.pump.registry)
        handlers.platform.bind_previews(daemon.preview)
    daemon.platforms.adopt(handlers, routing.version)
    old = daemon.routing
    daemon.routing = routing
    for name in plan.removed:  # what is queued for them gets `unroutable`
        old.listeners[name].retired = True
    daemon.config, daemon.checked = new.config, new
    if daemon.oob is not None and new.authorized_keys is not None:
        daemon.oob.reload_keys(new.authorized_keys)
    if daemon.bus is not None and new.config.bus.tls is not None:
        try:
            daemon.bus.reload_tls(new.config.bus.tls)
        except Exception as exc:  # changed on disk since preflight loaded it
            log.error("bus certificate not reloaded: %s", exc)
    withdrawn: tuple[str, ...] = ()
    clients = None
    if new.clients is not None and daemon.auth is not None:
        withdrawn = daemon.auth.replace(dict(new.clients)).withdrawn
        clients = daemon.client_profiles()
    daemon.pump.reload(routing, new.config.meta, clients)
    if daemon.bus is not None:
        for client in withdrawn:
            daemon.bus.disconnect(client)


def live_table_versions(daemon: ReloadedDaemon) -> set[int]:
    """The dispatch-table versions that live threads (and new ones) route with."""
    assert daemon.pump is not None and daemon.routing is not None
    versions = {frame.profile.table.version for frame in daemon.pump.registry}
    versions.add(daemon.routing.version)
    return versions
