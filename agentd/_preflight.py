"""Preflight: every check that `agentd run` and `agentctl reload` make on a loaded
configuration and on the files it names, before anything listens or changes.

`agentd check-config` runs the same list (`PREFLIGHT_CHECKS`) through the same
function (`preflight`), so the three cannot disagree about what is valid.

Invariants:
- A check reads files and builds values; it never binds a socket, opens the state
  directory or changes anything live.
- Every check runs even when an earlier one failed: the operator sees every problem
  at once, each prefixed with the configuration file and the setting it concerns.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agentd._errors import AgentdError, ConfigError
from agentd.config import ClientEntry, OrganismConfig

log = logging.getLogger("agentd.config")


@dataclass(frozen=True)
class CheckedConfig:
    """A configuration that passed preflight, with what the checks loaded."""

    config: OrganismConfig
    clients: Mapping[str, ClientEntry] | None = None  # None: no clients file
    authorized_keys: Mapping[str, Any] | None = None  # key id -> public key
    tls: ssl.SSLContext | None = None  # the bus's server context; None: no bus TLS
    prompt_digests: Mapping[str, str] = field(default_factory=dict)  # agent -> sha256
    cassette_digests: Mapping[str, str] = field(default_factory=dict)  # backend -> sha256
    identity: Any = None  # the organism's federation Identity; None: no identity key
    federation_tls: ssl.SSLContext | None = None  # the /federation server context


@dataclass(frozen=True)
class PreflightCheck:
    """One check: the setting it concerns, and a function that returns what it loaded
    (a keyword of `CheckedConfig`, or nothing) or raises with every problem."""

    setting: str
    run: Callable[[OrganismConfig], Mapping[str, Any]]


def _clients(config: OrganismConfig) -> Mapping[str, Any]:
    path = config.auth.clients_file
    if path is None:
        return {}
    from agentd.bus import AuthFileError, read_clients_file

    try:
        entries = read_clients_file(path)
    except AuthFileError as exc:
        raise ConfigError([str(exc)]) from None
    unknown = sorted({e.profile for e in entries.values()} - set(config.profiles))
    if unknown:
        raise ConfigError([f"clients file {path}: unknown profiles: {', '.join(unknown)}"])
    return {"clients": MappingProxyType(dict(entries))}


def _authorized_keys(config: OrganismConfig) -> Mapping[str, Any]:
    if config.oob.authorized_keys is not None:
        from agentd.oob import load_authorized_keys

        # AuthorizedKeysError is a ConfigError naming every bad line.
        return {"authorized_keys": load_authorized_keys(config.oob.authorized_keys)}
    return {}


def _bus_tls(config: OrganismConfig) -> Mapping[str, Any]:
    if config.bus.tls is None:
        return {}
    from agentd.bus import TlsSetupError, server_context

    try:
        return {"tls": server_context(config.bus.tls)}
    except TlsSetupError as exc:
        raise ConfigError([str(exc)]) from None


def _bus_host(config: OrganismConfig) -> Mapping[str, Any]:
    """A name the bus could not listen on: found here, not when the daemon starts."""
    if config.bus.tls is None:  # no bus is served
        return {}
    host = config.bus.host
    try:
        socket.getaddrinfo(host, config.bus.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError([f"{host!r} cannot be resolved ({why})"]) from None
    return {}


def _prompts(config: OrganismConfig) -> Mapping[str, Any]:
    if not any(lst.agent is not None for lst in config.listeners):
        return {}
    if config.llm is None:
        raise ConfigError(["agents need an llm section"])
    registry = _prompt_registry(config)
    return {"prompt_digests": MappingProxyType(
        {name: registry.get(name).sha256 for name in registry.names()}
    )}


_built: tuple[OrganismConfig, Any] | None = None  # the last registry, and its config


def _prompt_registry(config: OrganismConfig) -> Any:
    """`PromptRegistry.build(config)`, once per configuration: the prompts check and
    the isolation check (the agents' tool catalogues) both need it."""
    global _built
    if _built is None or _built[0] is not config:
        from agentd.platform import PromptRegistry

        _built = (config, PromptRegistry.build(config))
    return _built[1]


def _cassettes(config: OrganismConfig) -> Mapping[str, Any]:
    if config.llm is None:
        return {}
    from agentd.llm import Cassette

    issues: list[str] = []
    digests: dict[str, str] = {}
    for i, backend in enumerate(config.llm.backends):
        if backend.provider == "replay" and backend.cassette is not None:
            try:
                cassette = Cassette.load(backend.cassette, f"llm.backends[{i}].cassette")
            except ConfigError as exc:
                issues.extend(exc.issues)
            else:
                digests[backend.name] = cassette.digest  # of the bytes just checked
    if issues:
        raise ConfigError(issues)
    return {"cassette_digests": MappingProxyType(digests)}


def _listeners(config: OrganismConfig) -> Mapping[str, Any]:
    """The dispatch tables build (no payload key claimed by two classes); agents get a
    stand-in handler, since their platform is only built when the daemon runs."""
    from agentd._routing import Routing

    def stand_in(*_args: Any) -> None:
        return None

    Routing.build(config, agent_handlers={
        lst.name: stand_in for lst in config.listeners if lst.agent is not None
    })
    return {}


def _isolation(config: OrganismConfig) -> Mapping[str, Any]:
    """The workers' confinement as the daemon will start them: no secret beneath a
    folder a worker may read, a `user` the daemon may switch to."""
    from agentd.isolation import IsolationPools, effective_isolation

    if not effective_isolation(config):
        return {}
    registry = None
    if any(lst.agent is not None for lst in config.listeners):
        registry = _prompt_registry(config)
    IsolationPools.specs(config, None if registry is None else (
        lambda name: registry.get(name).catalogue))
    return {}


def _federation(config: OrganismConfig) -> Mapping[str, Any]:
    """The identity key, the gateways' public keys and the /federation TLS pair."""
    loaded: dict[str, Any] = {}
    if config.identity is None:
        return loaded
    from agentd.federation import check_gateways, federation_server_context, load_identity

    issues: list[str] = []
    try:
        loaded["identity"] = load_identity(config.identity.key, config.name)
    except AgentdError as exc:
        issues.append(f"identity.key: {exc}")
    issues += check_gateways(config)
    if config.federation is not None:
        try:
            loaded["federation_tls"] = federation_server_context(config.federation)
        except AgentdError as exc:
            issues.append(f"federation.tls: {exc}")
    if issues:
        raise ConfigError(issues)
    return loaded


PREFLIGHT_CHECKS: tuple[PreflightCheck, ...] = (
    PreflightCheck("auth.clients_file", _clients),
    PreflightCheck("oob.authorized_keys", _authorized_keys),
    PreflightCheck("bus.tls", _bus_tls),
    PreflightCheck("bus.host", _bus_host),
    PreflightCheck("prompts", _prompts),
    PreflightCheck("llm.backends", _cassettes),
    PreflightCheck("listeners", _listeners),
    PreflightCheck("isolation", _isolation),
    PreflightCheck("federation", _federation),
)


def preflight(config: OrganismConfig) -> CheckedConfig:
    """Run every check; `ConfigError` listing every problem, or what they loaded.
    The checked configuration includes the listeners its gateways import (as pinned
    in the state directory): they are the daemon's, not the file's."""
    if config.gateways:
        from agentd.federation import with_remote_listeners

        config = with_remote_listeners(config)
    issues: list[str] = []
    loaded: dict[str, Any] = {}
    source = str(config.source or "<config>")
    for check in PREFLIGHT_CHECKS:
        try:
            loaded.update(check.run(config))
        except ConfigError as exc:
            issues.extend(_located(source, check.setting, issue) for issue in exc.issues)
        except AgentdError as exc:
            issues.append(_located(source, check.setting, str(exc)))
    if issues:
        raise ConfigError(issues)
    for name in unbudgeted_agents(config):
        log.warning("agent %s has no token_budget, and no profile that lists it has one: "
                    "a model that calls the agent itself (up to pump.max_fanout calls a "
                    "turn, each a task of its own) is bounded only by pump.max_hops",
                    name)
    return CheckedConfig(config, **loaded)


def unbudgeted_agents(config: OrganismConfig) -> list[str]:
    """Agents whose conversations no token budget bounds (its own, or a profile's)."""
    budgeted = [p for p in config.profiles.values() if p.token_budget is not None]
    return [lst.name for lst in config.listeners
            if lst.agent is not None and lst.agent.token_budget is None
            and not any(p.listeners == "all" or lst.name in p.listeners for p in budgeted)]


def _located(source: str, setting: str, issue: str) -> str:
    """`issue` prefixed with the file and setting, unless it already names the file."""
    return issue if issue.startswith(source) else f"{source}: {setting}: {issue}"

