"""Start a confined child from asyncio, and kill it with everything it started.

The child is the exec shim: the compiled launcher (`_launcher.c`, built once per
process, run from a sealed memfd), or where it cannot be built `_shim.py`, run by
this interpreter with ``-I -S``. It reads the policy from a pipe, confines itself
and `execve`s the target. So the
restrictions are applied in the child, before the target runs, without
`preexec_fn` (unsafe in a threaded parent). The child starts in a new session
(its own process group), with an empty environment plus the policy's, and no
descriptor of ours except its three pipes: `close_fds` closes the rest, and the
shim closes everything beyond 0-2 before it execs (uvloop's spawn leaves copies of
the pipes open above 2), the policy pipe included.

`kill_group` SIGKILLs the whole process group and reaps the child; the shim's
seccomp filter refuses setsid/setpgid, so nothing the child starts can leave the
group and outlive it. A child whose policy sets `max_tasks` runs in a pids cgroup of
its own (`_cgroup`), where one can be made: `kill_group` also kills every process
in it and removes it.

`is_confined_child(pid)` says whether a process is one of these children or of what
they started (its process group, which they cannot leave, or its cgroup): the
operator socket refuses them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys

from agentd._procfs import stat_fields
from agentd.confine import _launcher, _shim
from agentd.confine._cgroup import REMOVE_TRIES, TaskGroup, cgroups
from agentd.confine._policy import Policy, check_enforceable, landlock_status

log = logging.getLogger("agentd.confine")

SHIM_PATH = os.path.abspath(_shim.__file__)
SHIM_FAILED = _shim.SHIM_FAILED
_PIPE_MAX = 60 * 1024  # written before the child reads: must fit a pipe buffer
# The cgroup of each child that has one, until `kill_group` removes it (held
# strongly: a child whose process object was dropped still has its cgroup killed at
# exit).
_GROUPS: dict[asyncio.subprocess.Process, TaskGroup] = {}
# The process group (the child's pid) of every child not yet killed, with the
# child's start time: a pid reused by another process is not taken for a child.
_LIVE: dict[int, bytes] = {}
_warned_tasks = False
_warned_owner = False
_launcher_built = False


def resolve_executable(argv0: str, env: dict[str, str] | None = None) -> str:
    """The absolute path of `argv0` (searched in the policy env's PATH, else the default)."""
    if os.path.isabs(argv0):
        return argv0
    found = shutil.which(argv0, path=(env or {}).get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(f"program not found: {argv0}")
    return os.path.abspath(found)


def shim_command(argv: list[str], policy: Policy, group: TaskGroup | None = None,
                 launcher: int | None = None) -> tuple[list[str], bytes]:
    """The shim's argv (policy descriptor left as ``{fd}``) and the request it reads;
    `group`: the cgroup it moves itself into first. `launcher`: the compiled
    launcher's memfd (`_launcher`), else the Python shim."""
    if not argv:
        raise ValueError("empty argv")
    env = dict(policy.env)
    shim_policy = policy.to_shim()
    if group is not None:
        shim_policy["cgroup_procs"] = group.procs
    executable = resolve_executable(argv[0], env)
    if launcher is not None:
        command = [f"/proc/self/fd/{launcher}", "{fd}"]
        request = _launcher.request(shim_policy, executable, list(argv), env,
                                    landlock_status().abi)
    else:
        command = [sys.executable, "-I", "-S", SHIM_PATH, "{fd}"]
        request = marshal.dumps({
            "policy": shim_policy, "executable": executable, "argv": list(argv), "env": env,
        })
    if len(request) > _PIPE_MAX:
        raise ValueError("confinement policy too large")
    return command, request


async def spawn(argv: list[str], policy: Policy, *,
                stdin: int | None = subprocess.PIPE,
                stdout: int | None = subprocess.PIPE,
                stderr: int | None = subprocess.PIPE,
                check: bool = True) -> asyncio.subprocess.Process:
    """Start `argv` confined by `policy`; returns the asyncio process.

    The child is in its own process group (``pgid == pid``). A child whose
    confinement failed exits with `SHIM_FAILED` (125) and says why on stderr.
    `check=False` skips `check_enforceable` (the caller checked at configuration).
    """
    if check:
        check_enforceable(policy)
    global _launcher_built
    if not _launcher_built:  # the first spawn compiles it, off the event loop
        await asyncio.to_thread(_launcher.launcher_fd)
        _launcher_built = True
    launcher = _launcher.launcher_fd()
    group = task_group(policy)
    try:
        command, request = shim_command(argv, policy, group, launcher)
        r, w = os.pipe()
        try:
            os.write(w, request)
            os.close(w)
            w = -1
            command[-1] = str(r)
            proc = await asyncio.create_subprocess_exec(
                *command, stdin=stdin, stdout=stdout, stderr=stderr, env={},
                cwd="/", close_fds=True, pass_fds=(r,) if launcher is None else (r, launcher),
                start_new_session=True)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
    except BaseException:  # cancelled after the fork, say: its child goes too
        if group is not None:
            group.kill()
            if not group.remove():
                log.warning("confine: cgroup %s kept: its process is still exiting",
                            group.path)
        raise
    if group is not None:
        _GROUPS[proc] = group
    with contextlib.suppress(OSError, IndexError):
        _LIVE[proc.pid] = stat_fields(proc.pid)[19]
    return proc


def is_confined_child(pid: int) -> bool:
    """Whether `pid` is a confined child of this process or a process one started:
    in a child's process group (the seccomp filter keeps them there) or in one of
    the children's cgroups. False for a process that no longer exists."""
    try:
        fields = stat_fields(pid)
        pgid = int(fields[2])
    except (OSError, IndexError, ValueError):
        return False
    started = _LIVE.get(pgid)
    if started is not None:
        try:
            leader = stat_fields(pgid)[19]
        except (OSError, IndexError):
            return True  # the leader exited; its pid cannot be reused while its group lives
        if leader == started:
            return True
        del _LIVE[pgid]  # the child ended unseen and its pid went to another process
    if not _GROUPS:
        return False
    names = {group.path.name for group in _GROUPS.values()}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    # beneath its own cgroup too: a child without Landlock could make cgroups there
    return any(part in names for line in lines
               for part in line.partition(":")[2].partition(":")[2].split("/"))


@atexit.register
def _kill_live_cgroups() -> None:
    """At exit, what a child left in its cgroup goes (its process group may not hold
    it all); the cgroup is removed if it is already empty, else by the next start."""
    for group in list(_GROUPS.values()):
        group.kill()
        group.remove()


def task_group(policy: Policy) -> TaskGroup | None:
    """A pids cgroup for a child allowed `policy.max_tasks` processes and threads, or
    None (no limit asked; or none can be made here, said once in a warning)."""
    global _warned_tasks, _warned_owner
    if policy.max_tasks is None:
        return None
    found = cgroups()
    if not found.available:
        if not _warned_tasks:
            _warned_tasks = True
            log.warning("confine: no pids cgroup (%s); the processes a confined child "
                        "starts are bounded only by its timeout and the service's "
                        "TasksMax", found.reason)
        return None
    if not _cannot_write_cgroups(policy) and not _warned_owner:
        _warned_owner = True
        log.warning("confine: without Landlock a child running as the daemon's uid may "
                    "write its own cgroup's files (raise its pids.max): max_tasks is "
                    "not enforced; set isolation.user")
    return found.make(policy.max_tasks)


def _cannot_write_cgroups(policy: Policy) -> bool:
    """Whether a child under `policy` is kept from its cgroup's files (root-owned, or
    the daemon's: mode 0644): by Landlock, or by running as another uid."""
    return landlock_status().filesystem or (
        policy.uid is not None and policy.uid != os.geteuid())


def tasks_limited(policy: Policy) -> bool:
    """Whether children spawned under `policy` get their `max_tasks` bound here: a
    pids cgroup, which they cannot change."""
    return (policy.max_tasks is not None and cgroups().available
            and _cannot_write_cgroups(policy))


async def kill_group(proc: asyncio.subprocess.Process) -> int:
    """SIGKILL `proc`'s whole process group (and every process in its cgroup), reap
    `proc` and remove its cgroup; returns its return code."""
    # ProcessLookupError: the group is already empty
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    group = _GROUPS.pop(proc, None)
    if group is not None:
        group.kill()
    code = await proc.wait()
    _LIVE.pop(proc.pid, None)
    if group is not None:
        for _ in range(REMOVE_TRIES):  # a killed process leaves its cgroup as it exits
            if group.remove():
                break
            group.kill()
            await asyncio.sleep(0.01)
        else:
            log.warning("confine: cgroup %s still has processes; left for the next "
                        "start to remove", group.path)
    return code
