"""The single-writer lock: an exclusive, non-blocking `flock` on `state_dir/agentd.lock`.

flock belongs to the open file description, so it excludes a second agentd process
and a second Kernel in the same process alike, and the OS releases it when the
holder dies (even by SIGKILL): there is no stale lock to clean up. The file holds the
holder's pid, for the error message only; it is never deleted (deleting a lock file
that others may have open is how two holders happen).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from agentd._procfs import stat_fields
from agentd.kernel._errors import StateDirUnsafe, StateLocked

LOCK_NAME = "agentd.lock"
ORPHAN_WAIT_S = 10.0

log = logging.getLogger("agentd.kernel")


class StateDirLock:
    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateDirLock:
        created = not state_dir.exists()
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if created:
            os.chmod(state_dir, 0o700)  # mkdir's mode is filtered by the umask
        else:
            mode = stat.S_IMODE(state_dir.stat().st_mode)
            if mode & 0o022:
                # Another user could plant a link in place of the lock or the database,
                # and the daemon (root, perhaps) would write through it.
                raise StateDirUnsafe(f"state_dir {state_dir} is writable by group or others "
                                     f"(mode {mode:o}): chmod go-w it")
            if mode & 0o077:
                log.warning("state_dir %s is accessible to group/others (mode %o); "
                            "it holds message payloads", state_dir, mode)
        path = state_dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateDirUnsafe(f"{path} is a symbolic link") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StateDirUnsafe(f"{path} is not a regular file")
            _lock(fd, state_dir, path)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(state_dir, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor releases the flock

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("lock released")
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None


def _lock(fd: int, state_dir: Path, path: Path) -> None:
    """flock `fd`, or raise StateLocked. A lock whose recorded holder is dead is held
    by that holder's kernel writer process, finishing its last batch before it exits
    (see kernel/_writer.py): wait for it, up to ORPHAN_WAIT_S."""
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _read_pid(fd)
            if holder is not None and not _alive(holder) and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            who = f"process {holder}" if holder else "another process"
            raise StateLocked(
                f"state directory {state_dir} is in use by {who} (lock {path}); "
                f"only one agentd may run on a state directory"
            ) from None


def _alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (exited, not yet reaped by its
    parent: its writer may still hold the lock for a moment)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    try:
        return stat_fields(pid)[:1] != [b"Z"]
    except FileNotFoundError:  # gone meanwhile
        return False
    except OSError:  # no /proc: trust kill(0)
        return True


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
