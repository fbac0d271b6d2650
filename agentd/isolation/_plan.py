"""Which listeners run isolated, and the confinement of their workers: pure decisions.

- `effective_isolation`: a handler's or an agent's own `isolation:` wins;
  otherwise the `isolation:` of the profiles that list it (the configuration
  refuses profiles that disagree). An isolated agent's worker runs the platform's
  agent loop and asks the daemon for every model call (`_agent.py`). Tools confine
  themselves. `process: false` means in the daemon.
- `worker_policy`: what a worker may read. Read and execute: the Python
  installation, the system libraries, the agentd package, exactly the packages
  (or single module files) that hold the listener's handler and payload classes,
  the modules of the configuration's folders that those import by name (found in
  their source: a handler's helper module beside it), and the listener's
  `isolation.read` paths. Directory listing only: the other `sys.path` folders,
  so imports still resolve. Nothing else: not the state directory, the TLS key, the clients
  file, the operator keys, nor `/proc`. A secret that lies beneath a path the
  worker may read is a configuration error, not a silent exposure.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agentd._errors import ConfigError
from agentd.config import IsolationConfig, ListenerConfig, OrganismConfig
from agentd.config.values import run_as
from agentd.confine import SYSTEM_READ_PATHS, Policy
from agentd.durable.state import DEFAULT_MAX_BYTES

WORKER_ARGV = (sys.executable, "-E", "-s", "-P", "-m", "agentd.isolation.worker")


def effective_isolation(config: OrganismConfig) -> dict[str, IsolationConfig]:
    """Listener name -> its isolation, for the listeners that run in workers."""
    chosen: dict[str, IsolationConfig] = {}
    for lst in config.listeners:
        iso = config.isolation_of(lst)
        if iso is not None:
            chosen[lst.name] = iso
    return chosen


def secret_paths(config: OrganismConfig) -> tuple[Path, ...]:
    """What a worker must never read: the daemon's state and secret files."""
    paths: list[Path | None] = [config.state_dir, config.auth.clients_file,
                                config.oob.authorized_keys, config.oob.socket]
    if config.bus.tls is not None:
        paths.append(config.bus.tls.key)
    if config.source is not None:
        paths.append(config.source)
    return tuple(Path(os.path.abspath(p)) for p in paths if p is not None)


def _module_grant(module_name: str) -> str | None:
    """The package folder (or the single file) a worker needs to import `module_name`."""
    top = module_name.split(".")[0]
    module = sys.modules.get(top)
    if module is None:
        return None
    locations = list(getattr(module, "__path__", ()) or ())
    if locations:
        return os.path.abspath(locations[0])
    file = getattr(module, "__file__", None)
    return os.path.abspath(file) if file else None


def _imported_grants(module_names: Iterable[str], granted: set[str]) -> set[str]:
    """What the worker needs to read to import `module_names` beyond `granted`: the
    modules they import by name (absolute imports in their source), and those
    modules' own, found among the modules loading the configuration imported. A
    module under a granted path (the installation, a granted package) is not
    followed; a name imported only at run time (importlib) is not seen."""
    found: set[str] = set()
    queue = list(dict.fromkeys(module_names))
    seen: set[str] = set()
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        try:
            tree = ast.parse(Path(file).read_bytes(), file)
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for imported in names:
                grant = _module_grant(imported)
                if grant is None or any(_beneath(Path(grant), g) for g in granted | found):
                    continue
                found.add(grant)
                queue.append(imported.split(".")[0])
    return found


def _beneath(path: Path, root: str) -> bool:
    return path == Path(root) or Path(root) in path.parents


def python_read_paths() -> tuple[str, ...]:
    """The interpreter, its standard library and its site-packages."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    return tuple(sorted(os.path.abspath(r) for r in roots))


def worker_policy(lst: ListenerConfig, iso: IsolationConfig, secrets: Iterable[Path],
                  sys_path: Iterable[str], reply_refs: Iterable[str] = ()) -> Policy:
    import agentd

    grants = {*SYSTEM_READ_PATHS, *python_read_paths(), os.path.dirname(agentd.__file__)}
    refs = [ref.partition(":")[0] for ref in (
        lst.handler_ref, *lst.payload_refs, *lst.response_refs, *reply_refs) if ref]
    for module in refs:
        grant = _module_grant(module)
        if grant is not None:
            grants.add(grant)
    grants |= _imported_grants(refs, grants)
    for extra in iso.read:
        if not os.path.exists(extra):
            raise ConfigError([
                f"{lst.location}: listeners: {lst.name}: isolation: read: no such file or "
                f"folder: {extra}"])
        grants.add(os.path.abspath(extra))
    for secret in secrets:
        real = Path(os.path.realpath(secret))
        for grant in grants:  # the system's folders too: a secret under /usr is readable
            if _beneath(secret, grant) or _beneath(real, os.path.realpath(grant)):
                raise ConfigError([
                    f"{lst.location}: listeners: {lst.name}: isolation: the worker would be "
                    f"able to read {secret} (beneath {grant}); move the handler's code or "
                    "the secret, or narrow its isolation: read"])
    uid, gid = run_as(iso.user, f"{lst.location}: listeners: {lst.name}")
    hidden = set(secrets)
    listing = tuple(p for p in (os.path.abspath(x) for x in sys_path if x)
                    if os.path.isdir(p) and Path(p) not in hidden)
    return Policy(
        memory_mb=iso.memory_mb, cpu_s=iso.cpu_s, open_files=iso.open_files,
        max_tasks=iso.max_tasks,
        read_paths=tuple(sorted(grants)), list_paths=listing, network=iso.network,
        env=dict(iso.env), cwd="/", uid=uid, gid=gid,
    )


def reply_refs(config: OrganismConfig, lst: ListenerConfig) -> tuple[str, ...]:
    """The classes of what `lst`'s peers answer with (what comes back to it), as
    `module:attribute`; a peer's generated classes (tools) have none."""
    refs = dict.fromkeys(ref for peer in lst.peers
                         for other in config.listeners if other.name == peer
                         for ref in other.response_refs if ref not in lst.payload_refs)
    return tuple(refs)


def worker_init(lst: ListenerConfig, sys_path: Iterable[str], replies: Iterable[str] = (),
                agent: Mapping[str, object] | None = None,
                state_max: int = DEFAULT_MAX_BYTES) -> Mapping[str, object]:
    """The INIT header. `replies`: more classes the worker decodes (its peers'
    answers); `agent`: an isolated agent's loop settings and tool catalogue;
    `state_max`: `pump.max_state_bytes_per_thread`, so `meta.state.set` refuses in
    the worker what the daemon would refuse at commit."""
    return {"sys_path": list(sys_path), "listener": lst.name, "handler": lst.handler_ref,
            "payload_classes": [*lst.payload_refs, *replies], "agent": agent,
            "state_max": state_max}


def agent_init(lst: ListenerConfig, catalogue: Any, max_fanout: int) -> Mapping[str, object]:
    """What an isolated agent's worker needs to run the agent loop: its limits and its
    tool catalogue (the peers' public schemas, from the prompt registry)."""
    from agentd.isolation._agent import catalogue_wire  # the platform: agents only

    assert lst.agent is not None
    return {"name": lst.name, "max_iterations": lst.agent.max_iterations,
            "max_fanout": max_fanout, "catalogue": catalogue_wire(catalogue)}
