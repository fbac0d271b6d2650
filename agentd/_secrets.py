"""Files that hold secrets, or decide who may do what: the one reader and the one
writer.

Every such file (the clients file, the auth state file, the operator's private key,
`authorized_keys`, the bus's TLS key) is read by `read_secret_file`, which decides
on the descriptor it reads from, never on a path looked up a second time:

- opened with O_NOFOLLOW (a symbolic link as the last component is refused; the
  directories above it are the operator's to trust), O_NONBLOCK (a FIFO must not
  hang the daemon) and O_CLOEXEC;
- `fstat` of that open descriptor: a regular file, owned by root or by this
  process's user (or by the daemon's user, when an operator checks the files as
  root on the daemon's behalf: `checking_as`), with no permission bits for group or
  others (`authorized_keys` holds public keys and may be readable, never writable,
  by others);
- read with a size cap: a larger file is refused, not truncated.

Errors say which file and what is wrong with it; they never carry its content.
`write_private_atomic` is the only writer: mode 0600 from creation, then an atomic
rename, so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from agentd._errors import AgentdError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


# The daemon's uid when another user (root running `agentd check-config --user`)
# checks the files for it; None: this process is the one that will use them.
_daemon_uid: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "agentd_daemon_uid", default=None)


@contextlib.contextmanager
def checking_as(uid: int) -> Iterator[None]:
    """Within the block, also accept files owned by `uid` (the daemon's user), as the
    daemon running as that user would."""
    token = _daemon_uid.set(uid)
    try:
        yield
    finally:
        _daemon_uid.reset(token)


def daemon_uid() -> int:
    """The uid the daemon runs as: this process's, or the one `checking_as` names."""
    uid = _daemon_uid.get()
    return os.geteuid() if uid is None else uid


class SecretFileError(AgentdError):
    """A secret file is missing, unreadable, or not private enough to be trusted."""


def read_secret_file(path: Path | str, what: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                     readable_by_others: bool = False) -> bytes:
    """The bytes of `path` (`what` names it in errors: "clients file", "key", ...),
    if it passes the checks of the module docstring. Raises `SecretFileError`."""
    path = Path(path)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise SecretFileError(
                f"{what} {path} is a symbolic link; name the file itself") from None
        raise SecretFileError(f"cannot read {what} {path}: {_reason(exc)}") from None
    try:
        st = os.fstat(fd)
        problem = _refusal(st, readable_by_others, max_bytes)
        if problem:
            raise SecretFileError(f"{what} {path} {problem.format(path=path)}")
        try:
            data = _read_at_most(fd, max_bytes + 1)
        except OSError as exc:
            raise SecretFileError(f"cannot read {what} {path}: {_reason(exc)}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew after the fstat
        raise SecretFileError(f"{what} {path} is larger than {max_bytes} bytes")
    return data


def _refusal(st: os.stat_result, readable_by_others: bool, max_bytes: int) -> str:
    """What is wrong with a file of this `fstat` result ("" if nothing); `{path}` is
    filled in by the caller."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    uid = os.geteuid()
    daemon = _daemon_uid.get()
    if st.st_uid not in (0, uid, daemon):
        whose = f"this process's user (uid {uid})" if daemon is None else f"uid {daemon}"
        return f"is owned by uid {st.st_uid}, not by root or {whose}"
    mode = stat.S_IMODE(st.st_mode)
    if readable_by_others:
        if mode & 0o022:
            return (f"is writable by group or others (mode {mode:04o}); whoever can "
                    "write it decides who is trusted: chmod go-w {path}")
    elif mode & 0o077:
        return (f"is readable or writable by group or others (mode {mode:04o}); "
                "it holds secrets: chmod 600 {path}")
    if daemon not in (None, 0, st.st_uid) and not (readable_by_others and mode & 0o044):
        # Checked for another user (check-config --user): a private file (0600) it
        # does not own is one it cannot read (the daemon then failed at start). A
        # shared file may be read through its group (install.sh: root:agentd 0640);
        # whether that user is in the group is not checked here.
        return (f"is owned by uid {st.st_uid}, so uid {daemon} cannot read it: "
                f"chown {daemon} {{path}}")
    if st.st_size > max_bytes:
        return f"is larger than {max_bytes} bytes"
    return ""


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()


def write_private_atomic(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write `data` to `path` with mode 0600 from the start: a temporary file in the
    same folder (created 0700 if missing), fsynced, then renamed over `path` (or,
    with `replace=False`, linked to it: FileExistsError if anything, a symbolic link
    included, is already there), then the folder fsynced."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have narrowed it; it never widens
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if replace:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path, follow_symlinks=False)
        finally:
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


__all__ = ["DEFAULT_MAX_BYTES", "SecretFileError", "read_secret_file", "write_private_atomic"]
