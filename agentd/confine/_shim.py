"""Child-side confinement: apply a policy to the current process, then exec.

This file is two things. Imported, it is the code that confines the *current*
process (`apply`): rlimits, a network namespace, another uid, Landlock, a seccomp
filter. Run as a script (``python -I -S _shim.py FD``), it is the exec shim the
parent spawns instead of the target: it reads the policy from descriptor FD,
confines itself and `execve`s the target, so every restriction is in place before
the first instruction of the untrusted program runs, without `preexec_fn` in a
threaded parent.

Invariants: it imports only the standard library (it runs with ``-I -S``, no
site-packages, and must start fast: the request is `marshal` data, not JSON, because
importing `json` pulls in `re` and `enum` and doubled the shim's start-up; marshal is
safe here since the only writer is the daemon, on a pipe it created); any failure
to apply a required restriction ends the process with exit code `SHIM_FAILED` and a
one-line reason on stderr, never a target that runs less confined than asked. Only
what the policy marks as best-effort (filesystem rules on a kernel without Landlock)
may be skipped, and the skip is reported in the returned `Applied` value.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import struct
import sys

SHIM_FAILED = 125

_SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_ADD_RULE = 445
_SYS_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
_CAPABILITY_VERSION_3 = 0x20080522
_SECCOMP_MODE_FILTER = 2
_CLONE_NEWNET = 0x40000000

# Landlock filesystem rights, by the ABI that introduced them. ABI 1 has bits 0-12:
# execute, write file, read file, read dir, remove dir, remove file, make char,
# dir, regular, socket, fifo, block device, symlink.
_FS_ABI1 = (1 << 13) - 1
FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_MAKE_CHAR = 1 << 6
FS_MAKE_BLOCK = 1 << 11
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6

# Rights that make sense on a regular file (the kernel refuses directory rights there).
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
_READ_RIGHTS = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


def fs_rights_for_abi(abi: int) -> int:
    """Every filesystem right the kernel's Landlock ABI can restrict."""
    if abi < 1:
        return 0
    rights = _FS_ABI1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    return _libc


def _raise_errno(what: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{what}: {os.strerror(err)}")


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return 0
    r = _c().syscall(_SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                     ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION))
    return int(r) if r > 0 else 0


def landlock_plan(abi: int, read: list[str], write: list[str], listing: list[str],
                  deny_network: bool) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The ruleset attribute and the rules: (path, rights on a directory, rights on a
    file). Pure; `_landlock_restrict` and the compiled launcher apply it."""
    handled_fs = fs_rights_for_abi(abi)
    handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if deny_network and abi >= 4 else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    if abi >= 6:
        attr = struct.pack("=QQQ", handled_fs, handled_net, scoped)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled_fs, handled_net)
    else:
        attr = struct.pack("=Q", handled_fs)
    grants = [(p, _READ_RIGHTS) for p in read]
    # Device nodes are never granted, even beneath a write path: a node made there
    # would open any device (a disk, the kernel log) past the rules on /dev.
    grants += [(p, handled_fs & ~(FS_MAKE_CHAR | FS_MAKE_BLOCK)) for p in write]
    grants += [(p, FS_READ_DIR) for p in listing]
    return attr, [(p, r & handled_fs, r & _FILE_RIGHTS & handled_fs) for p, r in grants]


def _landlock_restrict(abi: int, read: list[str], write: list[str], listing: list[str],
                       deny_network: bool) -> None:
    attr, rules = landlock_plan(abi, read, write, listing, deny_network)
    buf = ctypes.create_string_buffer(attr, len(attr))
    libc = _c()
    ruleset = libc.syscall(_SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        _raise_errno("landlock_create_ruleset")
    try:
        for path, on_dir, on_file in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # a path that does not exist grants nothing
            try:
                rights = on_dir if os.path.isdir(path) else on_file
                if not rights:
                    continue
                rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
                if libc.syscall(_SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset),
                                ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH), rule,
                                ctypes.c_uint32(0)) < 0:
                    _raise_errno(f"landlock_add_rule {path!r}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            _raise_errno("prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.syscall(_SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset),
                        ctypes.c_uint32(0)) < 0:
            _raise_errno("landlock_restrict_self")
    finally:
        os.close(ruleset)


# A classic-BPF seccomp filter (x86_64) that keeps everything the child starts in
# its process group and below it, so kill_group kills it all and the daemon is never
# left a child of its own to reap: setsid(2) and setpgid(2) are refused with EPERM,
# clone(2) with CLONE_PARENT too (the new process would be the daemon's child, a
# zombie of the daemon for ever once killed), and clone3(2), whose flags a filter
# cannot read, with ENOSYS (the C library then falls back to clone). So is
# prctl(PR_SET_CHILD_SUBREAPER): the shim makes the child a subreaper (`apply`), so
# a descendant whose parent exits is re-parented to the child, not to init, and the
# daemon sees every process the child left behind among its children; the child may
# not undo that. Every non-x86_64 syscall ABI (i386 via int 0x80, x32) is refused.
#
# It also keeps the child off every Unix socket it was not handed: socket(2) with
# AF_UNIX is refused with EACCES. Landlock (to ABI 7) scopes abstract names only, and
# a pathname socket (the operator's, say) checks no more than the connecting uid,
# which a child shares with the daemon unless isolation.user is set. socketpair(2)
# stays: a pair is private to the process that makes it (asyncio's self-pipe, a
# subprocess's pipes). io_uring_setup(2) says ENOSYS (libuv and the others fall back
# to plain system calls): a ring's operations, sockets among them, pass no filter.
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
_NR_SOCKET = 41
_NR_CLONE = 56
_NR_SETPGID = 109
_NR_SETSID = 112
_NR_PRCTL = 157
_NR_IO_URING_SETUP = 425
_NR_CLONE3 = 435
_AF_UNIX = 1
_CLONE_PARENT = 0x00008000
_PR_SET_CHILD_SUBREAPER = 36
_ARG0_LOW = 16  # offsetof(struct seccomp_data, args[0]), its low 32 bits (little-endian)
_RET_ALLOW = 0x7FFF0000
_RET_EPERM = 0x00050000 | 1
_RET_EACCES = 0x00050000 | 13
_RET_ENOSYS = 0x00050000 | 38


def _bpf(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program() -> bytes:
    """The filter, assembled: a jump names its targets by label (None: the next
    instruction), and each label becomes the count of instructions skipped."""
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06
    code: list[tuple[str | None, int, str | None, str | None, int]] = [
        ("", ld_w_abs, None, None, 4),                         # A = arch
        ("", jeq_k, None, "eperm", _AUDIT_ARCH_X86_64),
        ("", ld_w_abs, None, None, 0),                         # A = syscall number
        ("", jge_k, "eperm", None, _X32_BIT),
        ("", jeq_k, "eperm", None, _NR_SETSID),
        ("", jeq_k, "eperm", None, _NR_SETPGID),
        ("", jeq_k, "enosys", None, _NR_CLONE3),
        ("", jeq_k, "enosys", None, _NR_IO_URING_SETUP),
        ("", jeq_k, "prctl", None, _NR_PRCTL),
        ("", jeq_k, "socket", None, _NR_SOCKET),
        ("", jeq_k, None, "allow", _NR_CLONE),
        ("", ld_w_abs, None, None, _ARG0_LOW),                 # A = clone's flags
        ("", jset_k, "eperm", "allow", _CLONE_PARENT),
        ("prctl", ld_w_abs, None, None, _ARG0_LOW),            # A = prctl's option
        ("", jeq_k, "eperm", "allow", _PR_SET_CHILD_SUBREAPER),
        ("socket", ld_w_abs, None, None, _ARG0_LOW),           # A = socket's domain
        ("", jeq_k, "eacces", "allow", _AF_UNIX),
        ("allow", ret_k, None, None, _RET_ALLOW),
        ("eperm", ret_k, None, None, _RET_EPERM),
        ("enosys", ret_k, None, None, _RET_ENOSYS),
        ("eacces", ret_k, None, None, _RET_EACCES),
    ]
    where = {label: i for i, (label, *_rest) in enumerate(code) if label}

    def skip(i: int, target: str | None) -> int:
        return 0 if target is None else where[target] - i - 1

    return b"".join(_bpf(op, skip(i, jt), skip(i, jf), k)
                    for i, (_label, op, jt, jf, k) in enumerate(code))


def _install_seccomp() -> None:
    prog = seccomp_program()
    filt = ctypes.create_string_buffer(prog, len(prog))

    class _SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _SockFprog(len(prog) // 8, ctypes.cast(filt, ctypes.c_void_p))
    libc = _c()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _raise_errno("prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        _raise_errno("prctl(PR_SET_SECCOMP)")


def _drop_capabilities() -> None:
    """A root child keeps no capability, now or after its execve: the bounding set is
    emptied (so exec grants root nothing), then the ambient, effective, permitted and
    inheritable sets."""
    libc = _c()
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 63  # PR_CAPBSET_DROP refuses caps the kernel does not know: EINVAL
    for cap in range(last + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            _raise_errno("prctl(PR_CAPBSET_DROP)")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3
    number = _SYS_CAPSET.get(os.uname().machine)
    if number is None:
        return  # the empty bounding set alone keeps exec from granting any
    header = ctypes.create_string_buffer(struct.pack("=Ii", _CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(24)  # two (effective, permitted, inheritable)
    if libc.syscall(number, header, data) != 0:
        _raise_errno("capset")


def seccomp_available() -> bool:
    return sys.platform == "linux" and os.uname().machine == "x86_64"


def _unshare_network() -> bool:
    return _c().unshare(_CLONE_NEWNET) == 0


def apply(policy: dict) -> dict:
    """Confine the current process by `policy` (the dict form of `Policy`).

    Returns what was applied: ``{"landlock_abi", "filesystem", "network", "seccomp"}``;
    raises OSError or RuntimeError when a required restriction cannot be applied.
    """
    # First of all: into its own pids cgroup (see _cgroup), while it may still write
    # there (before it drops its uid and capabilities, and before Landlock).
    if policy.get("cgroup_procs"):
        fd = os.open(policy["cgroup_procs"], os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
    deny_network = not policy.get("network", False)
    net_by: list[str] = []
    if deny_network and policy.get("netns", True) and _unshare_network():
        net_by.append("netns")
    if policy.get("gid") is not None:
        os.setgroups([])
        os.setgid(int(policy["gid"]))
    if policy.get("uid") is not None:
        os.setuid(int(policy["uid"]))
    limits = (
        (resource.RLIMIT_AS, policy.get("memory_mb"), 1024 * 1024),
        (resource.RLIMIT_CPU, policy.get("cpu_s"), 1),
        (resource.RLIMIT_NOFILE, policy.get("open_files"), 1),
        (resource.RLIMIT_NPROC, policy.get("processes"), 1),
        (resource.RLIMIT_FSIZE, policy.get("file_size_mb"), 1024 * 1024),
    )
    for which, value, unit in limits:
        if value is not None:
            resource.setrlimit(which, (int(value) * unit, int(value) * unit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file holding its memory
    if policy.get("cwd"):
        os.chdir(policy["cwd"])
    abi = landlock_abi()
    fs = False
    if abi >= 1 and policy.get("filesystem", True):
        _landlock_restrict(abi, list(policy.get("read_paths", ())),
                           list(policy.get("write_paths", ())),
                           list(policy.get("list_paths", ())), deny_network)
        fs = True
        if deny_network and abi >= 4:
            net_by.append("landlock-tcp")
    elif policy.get("require_filesystem"):
        raise RuntimeError("filesystem confinement required but Landlock is unavailable")
    if deny_network and not net_by:
        raise RuntimeError("network denial required but neither a network namespace "
                           "nor Landlock TCP rules are available")
    if os.geteuid() == 0 or os.getuid() == 0:
        _drop_capabilities()
    # A subreaper: what the child starts stays among its descendants even when a
    # parent in between exits (see the seccomp filter above).
    if _c().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        _raise_errno("prctl(PR_SET_CHILD_SUBREAPER)")
    sec = False
    if policy.get("seccomp", True) and seccomp_available():
        _install_seccomp()
        sec = True
    return {"landlock_abi": abi, "filesystem": fs, "network": net_by, "seccomp": sec}


_MAX_FD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
if _MAX_FD == resource.RLIM_INFINITY or _MAX_FD > 1 << 20:
    _MAX_FD = 1 << 20  # os.closerange uses close_range(2): one call whatever the bound


def _main(argv: list[str]) -> int:
    try:
        fd = int(argv[1])
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        os.close(fd)
        # Nothing of the daemon's beyond 0-2 reaches the target, whatever spawned the
        # shim: uvloop's spawn leaves copies of the child's own pipes (and /dev/null)
        # open above 2, which `close_fds` does not see.
        os.closerange(3, _MAX_FD)
        request = marshal.loads(b"".join(chunks))
        apply(request["policy"])
        os.execve(request["executable"], request["argv"], request["env"])
    except BaseException as exc:
        os.write(2, f"confine: {type(exc).__name__}: {exc}\n".encode(errors="replace"))
    return SHIM_FAILED


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
