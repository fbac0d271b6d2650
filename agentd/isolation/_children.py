"""Whether a worker left processes behind: its children, read from `/proc`.

A worker is a subreaper it cannot stop being (the confinement shim sets
PR_SET_CHILD_SUBREAPER and its seccomp filter refuses to clear it), and no process
it starts may leave its tree (CLONE_PARENT is refused): a grandchild whose parent
exits is re-parented to the worker. So the worker has no child at all exactly when
nothing it started is still there, running or unreaped. The pool asks whenever a
worker has finished its calls with none queued behind, and every second for an idle
one (a thread the handler left may fork later); it replaces a worker that answers
with a reason (its process group is killed with it).

Each thread keeps its own children list (`/proc/PID/task/TID/children`, a kernel
built with CONFIG_PROC_CHILDREN), so every thread's list is read, each opened anew
(relative to the worker's task folder, kept open) and closed: a descriptor kept for
a thread would read nothing once that thread ended, even when a new thread got its
id. A one-thread worker (the usual one; the task folder's link count is 2 plus the
threads, read with one `fstat`) is checked on its main thread's list alone, kept
open and read again from its start (two system calls instead of the listing, an
open, a read and a close: the check follows every answer). More threads cost a
listing and a read each, so a worker with more than `MAX_THREADS` threads is
replaced too; a list that cannot be
read for any other reason than the thread having ended (the daemon out of
descriptors, say) counts as a leftover: the check fails closed.
"""

from __future__ import annotations

import errno
import os

_FLAGS = os.O_RDONLY | os.O_CLOEXEC
# A handler's thread pools stay far below (asyncio's default executor: at most 32).
MAX_THREADS = 128
_GONE = (errno.ENOENT, errno.ESRCH)


def children_listed() -> bool:
    """Whether this kernel lists a thread's children in `/proc` (CONFIG_PROC_CHILDREN)."""
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


class ChildWatch:
    """The children of one process, read from `/proc` on each check."""

    def __init__(self, pid: int) -> None:
        """Raises OSError if the process is gone already."""
        self._tasks = os.open(f"/proc/{pid}/task", _FLAGS | os.O_DIRECTORY)
        try:
            self._main = os.open(f"{pid}/children", _FLAGS, dir_fd=self._tasks)
        except BaseException:
            os.close(self._tasks)
            raise

    def leftover(self) -> str | None:
        """None if the process has no child now (or is gone: its exit is noticed on
        its own); otherwise why it must be replaced."""
        try:
            # One thread: it is the main one (a main thread that ended while others
            # run still counts until the process ends), whose list is kept open.
            if os.fstat(self._tasks).st_nlink == 3:
                return "processes it started still there" if os.pread(self._main, 1, 0) else None
        except OSError as exc:
            if exc.errno not in _GONE:
                return f"its children unreadable ({exc.strerror})"
            return None
        try:
            tids = os.listdir(self._tasks)
        except OSError as exc:
            return None if exc.errno in _GONE else f"its threads unreadable ({exc.strerror})"
        if len(tids) > MAX_THREADS:
            return f"{len(tids)} threads (at most {MAX_THREADS})"
        for tid in tids:
            try:
                fd = os.open(f"{tid}/children", _FLAGS, dir_fd=self._tasks)
            except OSError as exc:
                if exc.errno in _GONE:  # the thread ended meanwhile
                    continue
                return f"its children unreadable ({exc.strerror})"
            try:
                if os.read(fd, 1):
                    return "processes it started still there"
            except OSError as exc:
                if exc.errno not in _GONE:
                    return f"its children unreadable ({exc.strerror})"
            finally:
                os.close(fd)
        return None

    def close(self) -> None:
        if self._tasks >= 0:
            os.close(self._main)
            os.close(self._tasks)
            self._tasks = -1
