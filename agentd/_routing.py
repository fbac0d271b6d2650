"""Listeners, dispatch tables and profiles: the structural security of agentd.

A profile *is* a dispatch table: the map from routing key (payload namespace, local
name) to the listeners a thread of that profile may reach. The world is closed: a
key that is not in the table has no code path to any handler. Tables are immutable
once built; a reload builds new ones with a new version, and existing threads keep
the table they were created with (no runtime downgrade or upgrade).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from agentd import _metrics as metrics
from agentd._errors import ConfigError
from agentd._handler import never_suspends
from agentd._waiters import WaiterQueue
from agentd._xmlify import XmlSpec, spec_of
from agentd.durable.approvals import ApprovalRules

if TYPE_CHECKING:
    from agentd.config import ListenerConfig, OrganismConfig, SemanticRoutingConfig

# A routing key in Clark notation, "{namespace}localname": the payload element's tag
# as lxml reports it, so routing needs no string building on the hot path.
Key = str


@dataclass(eq=False)
class Listener:
    """The runtime form of a declared listener. Identity matters: tables point at
    these objects, so a thread pinned to an old table keeps reaching the listener
    objects that table was built with."""

    name: str
    handler: Callable[..., Any] | None
    payload_specs: tuple[XmlSpec, ...]
    response_specs: Mapping[Key, XmlSpec]
    peers: frozenset[str]
    is_agent: bool
    description: str
    timeout_s: float
    max_concurrency: int
    config: Any = None
    answers_text: bool = False  # may answer with core `answer` (agents, a peer's agent)
    takes_element: bool = False  # the handler takes the validated element (`takes_element`)
    immediate: bool = False  # the handler never suspends (`never_suspends`)
    retired: bool = False
    active: int = 0  # handler calls running now (bounded by max_concurrency)
    _slot_waiters: WaiterQueue = field(default_factory=WaiterQueue, repr=False)
    _seconds: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bind(self.handler)

    def bind(self, handler: Callable[..., Any] | None) -> None:
        """Make `handler` this listener's (and note whether it takes the element)."""
        self.handler = handler
        self.takes_element = getattr(handler, "takes_element", False) is True
        self.immediate = never_suspends(handler)

    def count(self, outcome: str) -> None:
        """agentd_dispatch_total{listener, outcome} += 1."""
        counts = metrics.HOT.dispatch
        key = (self.name, outcome)
        counts[key] = counts.get(key, 0) + 1

    def observe(self, seconds: float) -> None:
        """agentd_handler_seconds{listener} observes `seconds`."""
        if self._seconds is None:
            self._seconds = metrics.HOT.handler_histogram(self.name)
        metrics.observe_handler(self._seconds, seconds)

    async def wait_for_slot(self) -> None:
        """Wait until fewer than `max_concurrency` calls of this listener run. (A
        counter rather than asyncio.Semaphore: the uncontended path costs nothing.)"""
        while self.active >= self.max_concurrency:
            await self._slot_waiters.park(asyncio.get_running_loop())

    def release_slot(self) -> None:
        self.active -= 1
        if self._slot_waiters:
            self._slot_waiters.wake_one()

    def may_send_to(self, target: str) -> bool:
        # LLM agents iterate blindly through their own unique root tag.
        return target in self.peers or (self.is_agent and target == self.name)


@dataclass(frozen=True, eq=False)
class DispatchTable:
    version: int
    routes: Mapping[Key, tuple[Listener, ...]]
    listeners: Mapping[str, Listener]
    specs: Mapping[Key, XmlSpec]  # the payload schema of every routed key
    # Listeners behind an approval gate in this table, with the gate's rules. Empty
    # (falsy) for a table without gates: the pump's whole check is one truth test.
    gates: Mapping[str, ApprovalRules] = field(default_factory=lambda: _NO_GATES)

    def resolve(self, key: Key, to: str | None = None) -> tuple[Listener, ...]:
        """The listeners `key` reaches, narrowed by `to`; empty means unroutable."""
        found = self.routes.get(key, ())
        if to is not None:
            found = tuple(lst for lst in found if lst.name == to)
        return found


@dataclass(frozen=True, eq=False)
class Profile:
    name: str
    table: DispatchTable
    token_budget: int | None = None
    allow_intents: bool = False  # may a client of this profile send core `intent`?
    semantic: SemanticRoutingConfig | None = None  # routing.semantic with its overrides


_NO_GATES: Mapping[str, ApprovalRules] = MappingProxyType({})


def build_table(version: int, listeners: Iterable[Listener],
                profile_gate: Any = None) -> DispatchTable:
    routes: dict[Key, list[Listener]] = {}
    names: dict[str, Listener] = {}
    specs: dict[Key, XmlSpec] = {}
    gates: dict[str, ApprovalRules] = {}
    for lst in listeners:
        names[lst.name] = lst
        gate = getattr(lst.config, "approval", None) or profile_gate
        if gate is not None and gate.required:
            gates[lst.name] = ApprovalRules(tuple(gate.approvers), gate.timeout_s)
        for spec in lst.payload_specs:
            routes.setdefault(spec.clark, []).append(lst)
            specs[spec.clark] = spec
    for key, targets in routes.items():
        # A message to several listeners is parked once, under one gate: theirs must
        # be the same, or one gate's approvers would release it to another's listener.
        rules = {(frozenset(gates[t.name].approvers), gates[t.name].timeout_s)
                 for t in targets if t.name in gates}
        if len(rules) > 1:
            raise ConfigError([
                f"payload {key} goes to {', '.join(sorted(t.name for t in targets))}, "
                "whose approval gates differ: one approval would release it to all of "
                "them; give them the same approval settings, or payload classes of their "
                "own"])
    return DispatchTable(
        version,
        MappingProxyType({k: tuple(v) for k, v in routes.items()}),
        MappingProxyType(names),
        MappingProxyType(specs),
        MappingProxyType(gates) if gates else _NO_GATES,
    )


def listener_from_config(
    cfg: ListenerConfig, default_timeout_s: float, default_conc: int
) -> Listener:
    return Listener(
        name=cfg.name,
        handler=cfg.handler,
        payload_specs=tuple(spec_of(c) for c in cfg.payload_classes),
        response_specs=MappingProxyType(
            {spec_of(c).clark: spec_of(c) for c in cfg.response_classes}
        ),
        peers=frozenset(cfg.peers),
        is_agent=cfg.agent is not None,
        description=cfg.description,
        timeout_s=cfg.timeout_s if cfg.timeout_s is not None else default_timeout_s,
        max_concurrency=cfg.max_concurrency or default_conc,
        config=cfg,
        answers_text=cfg.agent is not None or cfg.answers_text,
    )


@dataclass(frozen=True, eq=False)
class Routing:
    """Everything routing needs, built from one configuration: listeners by name,
    one profile (dispatch table) per configured profile, and the schema of every key."""

    version: int
    listeners: Mapping[str, Listener]
    profiles: Mapping[str, Profile]
    specs: Mapping[Key, XmlSpec]

    @classmethod
    def build(
        cls,
        config: OrganismConfig,
        version: int = 1,
        agent_handlers: Mapping[str, Callable[..., Any]] | None = None,
        previous: Routing | None = None,
        rebuild: Collection[str] = (),
        isolated_handlers: Mapping[str, Callable[..., Any]] | None = None,
    ) -> Routing:
        """Build from `config`: the runtime listeners, each bound to its handler (a
        `handler:` listener's imported function, an agent's from `agent_handlers`, an
        isolated listener's pool's from `isolated_handlers`, a tool's built here from
        its description by `agentd.tools.tool_handlers`). With `previous` (a reload),
        listeners whose declaration did not change keep their runtime objects, so
        threads pinned to older tables and the new tables share them; those named in
        `rebuild` get new ones anyway (an agent moving to a new LLM platform), and so
        does every tool: its handler is built on what this load found (an MCP
        server's pins), the listeners of one `tool:` block together."""
        issues: list[str] = []
        listeners: dict[str, Listener] = {}
        specs: dict[Key, XmlSpec] = {}
        tools = _tool_handlers(config)
        for cfg in config.listeners:
            old = previous.listeners.get(cfg.name) if previous is not None else None
            if (
                old is not None
                and cfg.loaded_tool is None
                and cfg.name not in rebuild
                and listener_signature(old.config) == listener_signature(cfg)
            ):
                listeners[old.name] = old
                for spec in old.payload_specs:
                    specs.setdefault(spec.clark, spec)
                continue
            lst = listener_from_config(
                cfg, config.pump.handler_timeout_s, config.pump.per_listener_concurrency
            )
            if lst.is_agent:
                # An isolated agent runs the platform's loop in its pool's workers.
                handler = (isolated_handlers or {}).get(lst.name) or (
                    agent_handlers or {}).get(lst.name)
                if handler is None:
                    issues.append(
                        f"{cfg.location}: listeners: {cfg.name}: no handler for this LLM "
                        "agent (build them with agentd.platform.make_agent_handlers)"
                    )
                lst.bind(handler)
            elif isolated_handlers is not None and lst.name in isolated_handlers:
                lst.bind(isolated_handlers[lst.name])
            elif lst.name in tools:
                lst.bind(tools[lst.name])
            for spec in lst.payload_specs:
                other = specs.setdefault(spec.clark, spec)
                if other is not spec and other.cls is not spec.cls:
                    issues.append(
                        f"{cfg.location}: listeners: {cfg.name}: payload key {spec.clark} is "
                        f"already used by a different class ({other.cls.__qualname__})"
                    )
            listeners[lst.name] = lst
        if issues:
            raise ConfigError(issues)
        profiles: dict[str, Profile] = {}
        for pname, pcfg in config.profiles.items():
            # `all` never includes a peer's listeners (GATEWAY:LISTENER); a named one
            # is absent until its schema is pinned at the first link-up.
            chosen = (
                [lst for name, lst in listeners.items() if ":" not in name]
                if pcfg.listeners == "all"
                else [listeners[n] for n in pcfg.listeners if n in listeners or ":" not in n]
            )
            semantic = config.routing.semantic
            if pcfg.routing is not None:
                semantic = pcfg.routing.semantic.over(semantic)
            profiles[pname] = Profile(
                pname, build_table(version, chosen, pcfg.approval), pcfg.token_budget,
                pcfg.allow_intents, semantic,
            )
        return cls(
            version,
            MappingProxyType(listeners),
            MappingProxyType(profiles),
            MappingProxyType(specs),
        )


def _tool_handlers(config: OrganismConfig) -> Mapping[str, Callable[..., Any]]:
    """The handlers of the configuration's tools, built from their descriptions."""
    described = [cfg.loaded_tool for cfg in config.listeners if cfg.loaded_tool is not None]
    if not described:
        return {}
    from agentd.tools import tool_handlers  # late: an organism without tools imports none

    return tool_handlers(described)


def listener_signature(cfg: ListenerConfig | None) -> tuple[Any, ...]:
    """What makes two declarations of a listener the same (its location does not)."""
    if cfg is None:
        return ()
    return (
        cfg.payload_refs,
        cfg.response_refs,
        cfg.handler_ref,
        cfg.agent,
        cfg.peers,
        cfg.description,
        cfg.semantic_description,
        cfg.max_concurrency,
        cfg.timeout_s,
        cfg.tool,
        cfg.isolation,
        cfg.approval,
    )
