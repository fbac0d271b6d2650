"""Opening files beneath a root directory, decided by the kernel, not by strings.

A tool's path comes from untrusted input. It is first normalised as text
(`relative_parts`): absolute paths, NUL bytes, over-long names and `..` that would
climb above the root are refused; `..` that stays inside is folded away, so the
kernel never sees one. Then `Root` opens the remaining components relative to a
descriptor of the root, never by name from `/`:

- with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`
  (Linux 5.6+, through ctypes) in one system call;
- else component by component from the root's descriptor, each directory opened with
  `O_NOFOLLOW | O_DIRECTORY` relative to the previous one.

Either way no symbolic link is followed at any component (one created or swapped in
during the call included: the kernel checks each component as it walks), so nothing
outside the root can be reached through a name inside it. Both ways refuse the same
inputs; the tests run every attack against both.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path

from agentd._errors import Denied

PATH_MAX = 4096
NAME_MAX = 255
_FIELD_CHARS = 200  # how much of a refused path goes into the log and the journal

_SYS_OPENAT2 = 437  # the same number on every architecture (added after the unification)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def shown(path: str) -> str:
    """A refused path as it may appear in a security event: bounded, printable."""
    text = path[:_FIELD_CHARS].encode("unicode_escape").decode("ascii")
    return text + ("…" if len(path) > _FIELD_CHARS else "")


def relative_parts(path: str) -> tuple[str, ...]:
    """The components of `path` below the root, `()` for the root itself.

    Raises `Denied` for what can never name something inside the root, whatever
    the disk holds: an absolute path, a NUL byte, a name or path longer than the
    kernel accepts, a `..` that climbs above the root.
    """
    if "\x00" in path:
        raise Denied("NUL byte in path", path=shown(path))
    if path.startswith("/"):
        raise Denied("absolute path", path=shown(path))
    if len(path.encode("utf-8", "surrogateescape")) >= PATH_MAX:
        raise Denied("path too long", path=shown(path))
    parts: list[str] = []
    for name in path.split("/"):
        if name in ("", "."):
            continue
        if name == "..":
            if not parts:
                raise Denied("path escapes the root", path=shown(path))
            parts.pop()
            continue
        if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise Denied("name too long", path=shown(path))
        parts.append(name)
    return tuple(parts)


def _probe_openat2() -> bool:
    """Whether this kernel (and any seccomp filter in front of it) has openat2."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_BENEATH)
        fd = libc.syscall(_SYS_OPENAT2, -100, b".", ctypes.byref(how), ctypes.sizeof(how))
    except (OSError, AttributeError):
        return False
    if fd >= 0:
        os.close(fd)
        return True
    return False


OPENAT2 = _probe_openat2()


class Root:
    """A directory a tool is confined to. Each call opens it afresh (one cheap
    system call) and resolves beneath that descriptor, so a reload that builds a
    new tool leaves no descriptor behind.

    `use_openat2=False` forces the component walk (the fallback for kernels before
    5.6), so both ways can be tested on one machine.
    """

    def __init__(self, path: Path, *, use_openat2: bool | None = None) -> None:
        self.path = path
        self.use_openat2 = OPENAT2 if use_openat2 is None else use_openat2 and OPENAT2
        self._libc = ctypes.CDLL(None, use_errno=True) if self.use_openat2 else None

    def open(self, parts: tuple[str, ...], flags: int, mode: int = 0o644, *,
             path: str = "") -> int:
        """A descriptor for `parts` beneath the root; `Denied` if a component is a
        symbolic link or the resolution would leave the root; `FileNotFoundError`
        and other `OSError`s as the kernel reports them."""
        flags |= os.O_CLOEXEC | os.O_NOCTTY
        root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not parts:
                return os.open(".", flags, dir_fd=root)
            if self._libc is not None:
                return self._openat2(root, "/".join(parts), flags, mode)
            return self._walk(root, parts, flags, mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Denied("symbolic link in path", path=shown(path)) from None
            if exc.errno == errno.EXDEV:
                raise Denied("path escapes the root", path=shown(path)) from None
            raise
        finally:
            os.close(root)

    def _openat2(self, root: int, relative: str, flags: int, mode: int) -> int:
        assert self._libc is not None
        how = _OpenHow(flags, mode if flags & os.O_CREAT else 0,
                       _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        fd: int = self._libc.syscall(_SYS_OPENAT2, root, os.fsencode(relative),
                                     ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), relative)
        return fd

    def _walk(self, root: int, parts: tuple[str, ...], flags: int, mode: int) -> int:
        here = root
        name = parts[0]
        try:
            for name in parts[:-1]:
                step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                               | os.O_CLOEXEC, dir_fd=here)
                if here != root:
                    os.close(here)
                here = step
            name = parts[-1]
            return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=here)
        except NotADirectoryError:
            # O_NOFOLLOW | O_DIRECTORY on a symbolic link reports ENOTDIR: tell a
            # link apart from a plain file so both ways refuse alike.
            raise self._link_or(name, here) from None
        finally:
            if here != root:
                os.close(here)

    def _link_or(self, name: str, here: int) -> OSError:
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=here, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        code = errno.ELOOP if is_link else errno.ENOTDIR
        return OSError(code, os.strerror(code), name)
