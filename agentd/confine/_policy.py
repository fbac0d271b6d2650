"""What a confined process may do (`Policy`) and what this kernel can enforce.

`Policy` is a frozen value: limits, the paths a process may read, list or write,
whether it may use the network, its environment and working directory. The
decision whether a policy can be enforced here (`check_enforceable`) is made in
the parent, before anything is spawned, so configuration can refuse a listener
whose `network: false` nothing on this kernel can enforce.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentd.confine import _shim

log = logging.getLogger("agentd.confine")

# What a dynamically linked program (or a Python interpreter) needs to read to start.
SYSTEM_READ_PATHS: tuple[str, ...] = (
    "/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
    "/etc/nsswitch.conf", "/etc/passwd", "/etc/group",
    "/dev/null", "/dev/zero", "/dev/urandom", "/dev/random",
)


class ConfinementUnavailable(RuntimeError):
    """A restriction the policy requires cannot be enforced on this kernel."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The confinement of one process. `None` limits are not set (inherited)."""

    memory_mb: int | None = None  # RLIMIT_AS
    cpu_s: int | None = None  # RLIMIT_CPU (SIGXCPU then SIGKILL)
    open_files: int | None = 256  # RLIMIT_NOFILE
    processes: int | None = None  # RLIMIT_NPROC: per uid, and not enforced for root
    # Processes and threads of the child and all it starts, at once: its own pids
    # cgroup's pids.max, where a pids cgroup can be made (see _cgroup).
    max_tasks: int | None = None
    file_size_mb: int | None = None  # RLIMIT_FSIZE
    read_paths: tuple[str, ...] = SYSTEM_READ_PATHS  # read + execute, beneath each
    list_paths: tuple[str, ...] = ()  # directory listing only, beneath each
    write_paths: tuple[str, ...] = ()  # every right, beneath each
    network: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = "/"
    uid: int | None = None  # run as another user (the parent must be root)
    gid: int | None = None
    # Refuse to run at all when Landlock is missing (default: run with a warning).
    require_filesystem: bool = False

    def to_shim(self) -> dict:
        """The dict form `_shim.apply` takes (plain values only: it crosses as marshal data)."""
        return {
            "memory_mb": self.memory_mb, "cpu_s": self.cpu_s,
            "open_files": self.open_files, "processes": self.processes,
            "file_size_mb": self.file_size_mb,
            "read_paths": [os.path.abspath(p) for p in self.read_paths],
            "list_paths": [os.path.abspath(p) for p in self.list_paths],
            "write_paths": [os.path.abspath(p) for p in self.write_paths],
            "network": self.network, "cwd": self.cwd, "uid": self.uid, "gid": self.gid,
            "require_filesystem": self.require_filesystem,
            # a network namespace needs CAP_SYS_ADMIN; without it Landlock TCP rules do it
            "netns": _netns_possible(),
        }


@dataclass(frozen=True, slots=True)
class LandlockStatus:
    """What this kernel can enforce, for `agentctl status` and health."""

    abi: int  # 0: no Landlock
    filesystem: bool  # file access rules (ABI >= 1)
    network_tcp: bool  # TCP bind/connect rules (ABI >= 4)
    scopes: bool  # signals and abstract Unix sockets scoped to the domain (ABI >= 6)
    network_namespace: bool  # unshare(CLONE_NEWNET) possible (CAP_SYS_ADMIN)
    seccomp: bool  # the setsid/setpgid filter (x86_64)

    @property
    def network_denial(self) -> bool:
        return self.network_tcp or self.network_namespace

    def as_dict(self) -> dict[str, object]:
        return {"landlock_abi": self.abi, "filesystem": self.filesystem,
                "network_tcp": self.network_tcp, "scopes": self.scopes,
                "network_namespace": self.network_namespace, "seccomp": self.seccomp,
                "network_denial": self.network_denial}


def _netns_possible() -> bool:
    return sys.platform == "linux" and os.geteuid() == 0


@functools.cache
def landlock_status() -> LandlockStatus:
    abi = _shim.landlock_abi()
    return LandlockStatus(abi=abi, filesystem=abi >= 1, network_tcp=abi >= 4,
                          scopes=abi >= 6, network_namespace=_netns_possible(),
                          seccomp=_shim.seccomp_available())


_warned_fs = False


def check_enforceable(policy: Policy, status: LandlockStatus | None = None) -> None:
    """Raise `ConfinementUnavailable` if `policy` cannot be enforced here.

    Network denial is never degraded. Filesystem confinement degrades with a
    logged warning (once) unless the policy requires it.
    """
    global _warned_fs
    st = status if status is not None else landlock_status()
    if not policy.network and not st.network_denial:
        raise ConfinementUnavailable(
            "network: false cannot be enforced on this kernel (no Landlock TCP rules, "
            "ABI >= 4, and no permission to create a network namespace)")
    if not st.filesystem:
        if policy.require_filesystem:
            raise ConfinementUnavailable("filesystem confinement needs Landlock")
        if not _warned_fs:
            _warned_fs = True
            log.warning("confine: Landlock unavailable; confined processes keep the "
                        "filesystem access of their uid (rlimits and network still apply)")
    if policy.uid is not None and os.geteuid() != 0:
        raise ConfinementUnavailable("running as another uid needs a daemon started as root")
