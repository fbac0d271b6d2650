"""A pids cgroup for each confined child: how many processes and threads it and
everything it starts may have at once, and a list of all of them to kill.

rlimits cannot bound a process tree: `RLIMIT_NPROC` counts every process of a uid
(and root is exempt), so a fork bomb in a handler was bounded only by its call's
timeout and the service's `TasksMax`. A cgroup's `pids.max` is. Each confined child
gets a cgroup of its own, `agentd-<daemon pid>.<its start time>-<n>`, with `pids.max` set to its
policy's `max_tasks`; the exec shim moves itself into it (writes its pid to
`cgroup.procs`) first of all, before it drops privileges and long before the target
runs, so nothing the target starts is outside it. A fork past the limit fails with
EAGAIN. Killing the child kills every process listed in the cgroup too (those that
left the process group, where the seccomp filter that forbids it is missing), then
removes the cgroup.

Where: the pids controller of the hierarchy the daemon runs in.
- cgroup v1 (and the v1 `pids` hierarchy of a hybrid system): beneath the daemon's
  own pids cgroup, if the daemon may write there (root, or a delegated subtree).
- cgroup v2: beneath the daemon's own cgroup, if `pids` is in its controllers and it
  may enable it for children. A cgroup that holds processes cannot enable a
  controller for its children (the "no internal processes" rule), so under systemd
  the daemon runs in a sub-cgroup `daemon` of its service (`Delegate=pids`,
  `DelegateSubgroup=daemon`) and the children go beside it, in the service's cgroup.
Where neither is possible (no controller, no permission), `Cgroups.reason` says why and
the callers warn: the children then run without the bound, never silently.

The bound holds where the child cannot write its cgroup's files (mode 0644, the
daemon's): under Landlock, or as another uid (`_spawn` warns otherwise). A child
that could make cgroups beneath its own has them killed and removed with it.

A daemon killed with SIGKILL leaves its cgroups behind; the next daemon removes
those of daemons no longer running (another pid, or the same pid with another start
time), killing what is left in them, when it first needs one (waiting at most
`_SWEEP_S` for them to exit).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from agentd._procfs import stat_fields

log = logging.getLogger("agentd.confine")

PREFIX = "agentd-"
DAEMON_SUBGROUP = "daemon"  # systemd: DelegateSubgroup=daemon (see the unit file)
# agentd-<daemon pid>.<its start time in clock ticks>-<n>: a pid alone is reused (a
# new daemon with the pid of one killed would take its cgroups for its own).
_NAME = re.compile(r"agentd-(\d+)\.(\d+)-\d+\Z")
_SWEEP_S = 0.5  # the most the first spawn waits for stale cgroups' processes to exit
_KILL_ROUNDS = 100  # a cgroup whose processes fork while killed: bounded by pids.max
REMOVE_TRIES = 50  # a cgroup whose killed processes are still exiting: every 10 ms
_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Hierarchy:
    """Where the per-child cgroups are made."""

    version: int  # 1 or 2
    base: Path

    def describe(self) -> str:
        return f"cgroup v{self.version} pids at {self.base}"


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field (spaces and such are octal escapes)."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def locate(cgroup_text: str, mountinfo_text: str) -> tuple[Hierarchy | None, str]:
    """The daemon's own pids cgroup directory, from /proc/self/cgroup and
    /proc/self/mountinfo: (Hierarchy, "") or (None, why not). A v1 pids hierarchy is
    preferred where both exist (on a hybrid system the v2 one has no controllers)."""
    own_v1 = own_v2 = None
    for line in cgroup_text.splitlines():
        ident, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if ident == "0" and controllers == "":
            own_v2 = path
        elif "pids" in controllers.split(","):
            own_v1 = path
    mounts_v1: list[tuple[str, str]] = []
    mounts_v2: list[tuple[str, str]] = []
    for line in mountinfo_text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        root, point, fstype = _unescape(fields[3]), _unescape(fields[4]), tail[0]
        if fstype == "cgroup" and "pids" in tail[2].split(","):
            mounts_v1.append((root, point))
        elif fstype == "cgroup2":
            mounts_v2.append((root, point))
    for version, own, mounts in ((1, own_v1, mounts_v1), (2, own_v2, mounts_v2)):
        if own is None:
            continue
        for root, point in mounts:
            rel = _beneath(own, root)
            if rel is not None:
                return Hierarchy(version, Path(point, rel)), ""
    if own_v1 is None and own_v2 is None:
        return None, "the daemon is in no cgroup (no /proc/self/cgroup entry)"
    return None, "no pids cgroup hierarchy mounted where the daemon's cgroup is visible"


def _beneath(path: str, root: str) -> str | None:
    """`path` relative to a mount's `root` ('' for the root itself), or None when the
    mount does not show it."""
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")) + 1:]
    return None


def prepare(found: Hierarchy) -> tuple[Hierarchy | None, str]:
    """Check that children can be made at `found` (and, for v2, that `pids` is
    enabled for them, enabling it or going up to a delegated parent): the hierarchy
    to use, or (None, why not)."""
    base = found.base
    if found.version == 1:
        if not (base / "cgroup.procs").exists():
            return None, f"{base} is not a cgroup"
        if not os.access(base, os.W_OK):
            return None, f"no permission to make cgroups in {base}"
        return found, ""
    try:
        controllers = (base / "cgroup.controllers").read_text().split()
    except OSError as exc:
        return None, f"cannot read {base}/cgroup.controllers: {exc.strerror}"
    if "pids" not in controllers:
        return None, f"the pids controller is not delegated to {base}"
    # The daemon in its service's sub-cgroup `daemon` (systemd's DelegateSubgroup):
    # the children go beside it. Never beside any other cgroup: they would leave the
    # service (its TasksMax) for a slice shared with other services.
    candidates = (base, base.parent) if base.name == DAEMON_SUBGROUP else (base,)
    for candidate in candidates:
        if _enabled_for_children(candidate) and os.access(candidate, os.W_OK):
            return Hierarchy(2, candidate), ""
    try:
        (base / "cgroup.subtree_control").write_text("+pids")
    except OSError as exc:
        why = ("it holds processes: run the daemon in a sub-cgroup (systemd: "
               "Delegate=pids, DelegateSubgroup=daemon)" if exc.errno == errno.EBUSY
               else exc.strerror)
        return None, f"cannot enable pids for the children of {base}: {why}"
    return Hierarchy(2, base), ""


def _enabled_for_children(path: Path) -> bool:
    try:
        return "pids" in (path / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


class TaskGroup:
    """One child's cgroup."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def procs(self) -> str:
        """What the shim writes its pid to."""
        return str(self.path / "cgroup.procs")

    def _tree(self) -> list[str]:
        """The cgroup and any made beneath it (a child without Landlock could), deepest
        first. Not through symbolic links (cgroupfs has none)."""
        return [top for top, _, _ in os.walk(self.path, topdown=False)]

    def pids(self) -> list[int]:
        out: list[int] = []
        for folder in self._tree():
            try:
                with open(os.path.join(folder, "cgroup.procs")) as f:
                    out.extend(int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
        return out

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (and beneath it), reading the lists again
        while they have new ones (a process may fork while the others are killed). A
        killed process stays listed until it has exited: callers wait for `remove`."""
        killed: set[int] = set()
        for _ in range(_KILL_ROUNDS):
            fresh = [pid for pid in self.pids() if pid not in killed]
            if not fresh:
                return
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed.update(fresh)

    def remove(self) -> bool:
        """Remove the cgroup, deepest first (False while processes are still in one)."""
        for folder in self._tree():
            try:
                os.rmdir(folder)
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return True


class Cgroups:
    """The per-child cgroups of this daemon; `make` is the only thing callers need."""

    def __init__(self, hierarchy: Hierarchy | None, reason: str = "") -> None:
        self.hierarchy = hierarchy
        self.reason = reason
        self._ids = itertools.count(1)
        self._swept = False
        # This daemon's cgroups: agentd-<pid>.<start time>-<n> (see _NAME).
        self._prefix = f"{PREFIX}{os.getpid()}.{start_time('self') or 0}-"

    @classmethod
    def discover(cls) -> Cgroups:
        try:
            cgroup_text = Path("/proc/self/cgroup").read_text()
            mountinfo_text = Path("/proc/self/mountinfo").read_text()
        except OSError as exc:
            return cls(None, f"cannot read /proc/self: {exc.strerror}")
        found, why = locate(cgroup_text, mountinfo_text)
        if found is None:
            return cls(None, why)
        usable, why = prepare(found)
        return cls(usable, why)

    @property
    def available(self) -> bool:
        return self.hierarchy is not None

    def describe(self) -> str:
        """For `agentctl status`: where the cgroups are made, or why none can be."""
        if self.hierarchy is None:
            return f"unavailable: {self.reason}"
        return self.hierarchy.describe()

    def make(self, max_tasks: int) -> TaskGroup:
        """A new cgroup allowing `max_tasks` processes and threads. Raises OSError."""
        assert self.hierarchy is not None
        if not self._swept:
            self._swept = True
            self.sweep()
        path = self.hierarchy.base / f"{self._prefix}{next(self._ids)}"
        path.mkdir(mode=0o755)
        try:
            (path / "pids.max").write_text(str(int(max_tasks)))
        except BaseException:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise
        return TaskGroup(path)

    def sweep(self) -> int:
        """Remove the cgroups of daemons no longer running, killing what is left in
        them; how many were removed."""
        assert self.hierarchy is not None
        removed = 0
        try:
            entries = list(self.hierarchy.base.iterdir())
        except OSError:
            return 0
        deadline = time.monotonic() + _SWEEP_S
        for entry in entries:
            match = _NAME.match(entry.name)
            if match is None or _alive(int(match.group(1)), int(match.group(2))):
                continue
            group = TaskGroup(entry)
            while True:
                group.kill()
                if group.remove():
                    removed += 1
                    break
                if time.monotonic() > deadline:
                    log.warning("confine: stale cgroup %s still has processes", entry)
                    break
                time.sleep(0.01)
        if removed:
            log.info("confine: removed %d cgroups left by daemons no longer running",
                     removed)
        return removed


def start_time(pid: int | str) -> int | None:
    """A process's start time (clock ticks after boot, /proc/PID/stat field 22): with
    its pid, it names one process for the machine's uptime."""
    try:
        return int(stat_fields(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, started: int) -> bool:
    """Whether the daemon that made a cgroup runs still (the same pid and start time)."""
    return start_time(pid) == started


_cgroups: Cgroups | None = None


def cgroups() -> Cgroups:
    """This daemon's `Cgroups`, found on first use."""
    global _cgroups
    if _cgroups is None:
        _cgroups = Cgroups.discover()
    return _cgroups
