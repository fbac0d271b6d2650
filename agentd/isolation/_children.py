"""Whether a worker left processes behind: its children, read from `/proc`.

A worker is a subreaper it cannot stop being (the confinement shim sets
PR_SET_CHILD_SUBREAPER and its seccomp filter refuses to clear it), and no process
it starts may leave its tree (CLONE_PARENT is refused): a grandchild whose parent
exits is re-parented to the worker. So the worker has no child at all exactly when
nothing it started is still there, running or unreaped. The pool asks after each
call the worker has finished with nothing queued behind it, and replaces a worker
that answers yes (its process group is killed with it).

Each thread keeps its own children list (`/proc/PID/task/TID/children`, a kernel
built with CONFIG_PROC_CHILDREN), so every thread's list is read. The descriptors
stay open between checks: one check costs a listing of the worker's threads and one
`pread` per thread (about 6 us for a one-thread worker here).
"""

from __future__ import annotations

import contextlib
import os

_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def children_listed() -> bool:
    """Whether this kernel lists a thread's children in `/proc` (CONFIG_PROC_CHILDREN)."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class ChildWatch:
    """The children of one process, through descriptors kept open."""

    def __init__(self, pid: int) -> None:
        """Raises OSError if the process is gone already."""
        self.pid = pid
        self._tasks = os.open(f"/proc/{pid}/task", _FLAGS | os.O_DIRECTORY)
        self._lists: dict[str, int] = {}

    def any(self) -> bool:
        """Whether the process has a child (running or a zombie) now. False once the
        process is gone: its exit is noticed on its own (the pool's pidfd)."""
        try:
            tids = os.listdir(self._tasks)
        except OSError:
            return False
        lists = self._lists
        for tid in tids:
            fd = lists.get(tid)
            if fd is None:
                try:
                    fd = lists[tid] = os.open(f"/proc/{self.pid}/task/{tid}/children", _FLAGS)
                except OSError:  # the thread ended meanwhile
                    continue
            try:
                if os.pread(fd, 1, 0):
                    return True
            except OSError:  # ESRCH: the thread ended meanwhile
                continue
        if len(lists) > len(tids):  # threads that ended: their descriptors go
            for tid in set(lists).difference(tids):
                os.close(lists.pop(tid))
        return False

    def close(self) -> None:
        for fd in (self._tasks, *self._lists.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lists.clear()
        self._tasks = -1
