"""The compiled exec shim: `_launcher.c`, built once per process, run from a sealed memfd.

Starting an interpreter for the Python shim costs most of a confined spawn (about
15-40 ms on a loaded 2-core machine, against ~1 ms for fork and exec). The launcher
makes the same system calls in the same order as `_shim.apply`, from a request in
which every decision was already taken here in Python (`request`): the Landlock
rules (`_shim.landlock_plan`), the seccomp program (`_shim.seccomp_program`), the
rlimits. So the policy logic stays in one place, tested in Python.

The binary is compiled with the system's C compiler on first use, copied into an
anonymous memfd sealed against writes and passed to each child, which execs it as
`/proc/self/fd/N`: no file on disk that a confined child could replace. Without a
compiler (or when the build fails) `launcher_fd()` is None and spawns use the
Python shim, as before; the reason is logged once.
"""

from __future__ import annotations

import fcntl
import logging
import os
import resource
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from agentd.confine import _shim

log = logging.getLogger("agentd.confine")

SOURCE = Path(__file__).with_name("_launcher.c")
_UNBUILT = -2
_fd = _UNBUILT
_lock = threading.Lock()
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_LIMITS = (
    (resource.RLIMIT_AS, "memory_mb", 1024 * 1024),
    (resource.RLIMIT_CPU, "cpu_s", 1),
    (resource.RLIMIT_NOFILE, "open_files", 1),
    (resource.RLIMIT_NPROC, "processes", 1),
    (resource.RLIMIT_FSIZE, "file_size_mb", 1024 * 1024),
)


def launcher_fd() -> int | None:
    """The memfd holding the compiled launcher (built on the first call; it blocks
    for the compile), or None: no compiler, or the build failed."""
    global _fd
    with _lock:
        if _fd == _UNBUILT:
            _fd = _build()
    return None if _fd < 0 else _fd


@contextmanager
def python_shim() -> Iterator[None]:
    """Spawns inside take the Python shim, as on a machine without a compiler (so
    the tests run every confinement check through both)."""
    global _fd
    with _lock:
        if _fd == _UNBUILT:
            _fd = _build()
        kept, _fd = _fd, -1
    try:
        yield
    finally:
        _fd = kept


def _build() -> int:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("confine: no C compiler (cc); confined children start through the "
                    "Python shim, about 10-40 ms each")
        return -1
    with tempfile.TemporaryDirectory(prefix="agentd-launcher-") as tmp:
        out = os.path.join(tmp, "launcher")
        # Static where the C library allows it: no dynamic loader at each start.
        for static in (["-static"], []):
            done = subprocess.run([cc, "-O2", *static, "-o", out, str(SOURCE)],
                                  capture_output=True, timeout=120, check=False,
                                  env={"PATH": os.defpath})
            if done.returncode == 0:
                break
        if done.returncode != 0:
            log.warning("confine: building the launcher failed (%s); confined children "
                        "start through the Python shim",
                        done.stderr.decode(errors="replace").strip()[:300])
            return -1
        data = Path(out).read_bytes()
    fd = os.memfd_create("agentd-confine-launcher", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    # It must run from the memfd here (a `vm.memfd_noexec` sysctl or a security
    # module may refuse): without arguments it says so and exits 125.
    try:
        tried = subprocess.run([f"/proc/self/fd/{fd}"], pass_fds=(fd,), capture_output=True,
                               timeout=60, check=False, env={})
        why = "" if (tried.returncode == _shim.SHIM_FAILED
                     and tried.stderr.startswith(b"confine:")) else f"exit {tried.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    if why:
        os.close(fd)
        log.warning("confine: the launcher cannot run from a memfd here (%s); confined "
                    "children start through the Python shim", why)
        return -1
    return fd


def _str(value: str) -> bytes:
    data = value.encode("utf-8", "surrogateescape")
    if b"\0" in data:
        raise ValueError("a confined child's argv, environment or paths cannot hold NUL")
    return struct.pack("<I", len(data)) + data


def _strings(values: list[str]) -> bytes:
    return struct.pack("<I", len(values)) + b"".join(_str(v) for v in values)


def request(policy: dict[str, Any], executable: str, argv: list[str],
            env: dict[str, str], abi: int) -> bytes:
    """What the launcher reads: `policy` (the dict form `_shim.apply` takes) decided
    for a kernel of Landlock ABI `abi`, and the target."""
    deny_network = not policy.get("network", False)
    landlock = abi >= 1 and bool(policy.get("filesystem", True))
    seccomp = bool(policy.get("seccomp", True)) and _shim.seccomp_available()
    flags = (deny_network * 1 | bool(policy.get("netns", True)) * 2 | landlock * 4
             | (landlock and deny_network and abi >= 4) * 8
             | bool(policy.get("require_filesystem")) * 16 | seccomp * 32)
    limits = [(which, int(policy[key]) * unit) for which, key, unit in _LIMITS
              if policy.get(key) is not None]
    attr, rules = (_shim.landlock_plan(
        abi, list(policy.get("read_paths", ())), list(policy.get("write_paths", ())),
        list(policy.get("list_paths", ())), deny_network) if landlock else (b"", []))
    gid, uid = policy.get("gid"), policy.get("uid")
    program = _shim.seccomp_program() if seccomp else b""
    return b"".join([
        b"AGL1", _str(executable), _strings(list(argv)),
        _strings([f"{k}={v}" for k, v in env.items()]),
        _str(policy.get("cgroup_procs") or ""),
        struct.pack("<Iqq", flags, -1 if gid is None else int(gid),
                    -1 if uid is None else int(uid)),
        struct.pack("<I", len(limits)),
        b"".join(struct.pack("<IQ", which, value) for which, value in limits),
        _str(policy.get("cwd") or ""),
        struct.pack("<I", len(attr)), attr, struct.pack("<I", len(rules)),
        b"".join(_str(path) + struct.pack("<QQ", on_dir, on_file)
                 for path, on_dir, on_file in rules),
        struct.pack("<I", len(program)), program,
    ])
