"""Confinement of untrusted child processes: rlimits, Landlock, seccomp, network.

Shared by the handler worker pool, the `exec` tool and MCP stdio servers. The
public surface:

- `Policy`: what a confined process may do (limits, read/list/write paths,
  network, environment, cwd, uid).
- `spawn(argv, policy)`: start a confined child from asyncio (own process group,
  empty environment plus the policy's, no inherited descriptors; confinement is
  applied in the child before the target runs, by an exec shim).
- `is_confined_child(pid)`: whether a process is such a child or one it started
  (the operator socket refuses them).
- `kill_group(proc)`: SIGKILL the child's whole process group and reap it.
- `Policy.max_tasks`: the processes and threads a child and all it starts may have
  at once, enforced by a pids cgroup of its own where one can be made
  (`cgroups()` says where, or why not; `tasks_limited(policy)`).
- `confine_self(policy)`: apply a policy to the current process (for a worker
  that confines itself after it started, or a single-threaded child).
- `landlock_status()`: what this kernel can enforce (for status and health).
- `check_enforceable(policy)`: raise `ConfinementUnavailable` when a required
  restriction cannot be enforced: `network: false` is never degraded; missing
  filesystem confinement is a logged warning unless `require_filesystem`.

A child whose confinement could not be applied exits with `SHIM_FAILED` (125)
and a one-line reason on its stderr; the target never runs less confined.
"""

from __future__ import annotations

from agentd.confine import _shim
from agentd.confine._cgroup import cgroups
from agentd.confine._policy import (
    SYSTEM_READ_PATHS,
    ConfinementUnavailable,
    LandlockStatus,
    Policy,
    check_enforceable,
    landlock_status,
)
from agentd.confine._spawn import (
    SHIM_FAILED,
    is_confined_child,
    kill_group,
    resolve_executable,
    spawn,
    tasks_limited,
)


def confine_self(policy: Policy) -> dict[str, object]:
    """Apply `policy` to the current process (irreversible); returns what was applied.

    Call it only in a single-threaded process you are about to hand to untrusted
    code: rlimits, uid, Landlock and seccomp apply to the whole process.
    """
    check_enforceable(policy)
    return _shim.apply(policy.to_shim())


__all__ = [
    "SHIM_FAILED",
    "SYSTEM_READ_PATHS",
    "ConfinementUnavailable",
    "LandlockStatus",
    "Policy",
    "cgroups",
    "check_enforceable",
    "confine_self",
    "is_confined_child",
    "kill_group",
    "landlock_status",
    "resolve_executable",
    "spawn",
    "tasks_limited",
]
