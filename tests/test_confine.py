"""Confinement primitives, attacked for real: real children, real sockets, SIGKILL."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest

from agentd.confine import (
    SHIM_FAILED,
    SYSTEM_READ_PATHS,
    ConfinementUnavailable,
    LandlockStatus,
    Policy,
    check_enforceable,
    kill_group,
    landlock_status,
    spawn,
)
from agentd.confine._launcher import launcher_fd, python_shim
from tests.isolated.watch import alive, gone, recording_server

pytestmark = pytest.mark.both_loops  # the daemon spawns on uvloop


@pytest.fixture(autouse=True, params=["launcher", "python-shim"])
def shim(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every check runs through the compiled launcher and through the Python shim
    (what a machine without a C compiler uses)."""
    if request.param == "launcher":
        assert launcher_fd() is not None, "no C compiler: the launcher could not be built"
        yield request.param
    else:
        with python_shim():
            yield request.param
needs_landlock = pytest.mark.skipif(not landlock_status().filesystem,
                                    reason="kernel without Landlock")
PYTHON_READ = (*SYSTEM_READ_PATHS, sys.base_prefix, sys.prefix, sys.exec_prefix,
               os.path.dirname(os.path.realpath(sys.executable)))


def python_policy(**kw: object) -> Policy:
    kw.setdefault("read_paths", PYTHON_READ)
    return Policy(**kw)  # type: ignore[arg-type]


async def run_python(code: str, policy: Policy, timeout: float = 30) -> tuple[int, str, str]:
    proc = await spawn([sys.executable, "-I", "-S", "-c", textwrap.dedent(code)], policy)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_environment_is_empty_except_the_policy_env() -> None:
    os.environ["AGENTD_TEST_SECRET"] = "leak"
    try:
        proc = await spawn(["/usr/bin/env"], Policy(env={"ONLY": "this"}))
        out, _ = await proc.communicate()
    finally:
        del os.environ["AGENTD_TEST_SECRET"]
    assert out.decode().splitlines() == ["ONLY=this"]


async def test_inherited_descriptor_is_not_usable_by_the_child(tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)  # opened without CLOEXEC, as a careless parent might
    try:
        code, out, _ = await run_python(f"""
            import os
            try:
                print(os.read({fd}, 100))
            except OSError as e:
                print("EBADF" if e.errno == 9 else e)
            print(sorted(os.listdir("/proc/self/fd")))
        """, python_policy(read_paths=(*PYTHON_READ, "/proc/self")))
    finally:
        os.close(fd)
    assert code == 0
    assert out.splitlines()[0] == "EBADF"
    assert "s3cret" not in out


async def test_grandchild_that_leaves_the_group_cannot_outlive_kill_group() -> None:
    proc = await spawn([sys.executable, "-I", "-S", "-c", textwrap.dedent("""
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                print("setsid-ok", flush=True)
            except OSError:
                print("setsid-refused", flush=True)
            time.sleep(600)
        print(pid, flush=True)
        time.sleep(600)
    """)], python_policy())
    assert proc.stdout is not None
    lines = {(await proc.stdout.readline()).decode().strip() for _ in range(2)}
    assert "setsid-refused" in lines
    grandchild = int(next(x for x in lines if x.isdigit()))
    assert alive(grandchild)
    rc = await kill_group(proc)
    assert rc == -signal.SIGKILL
    assert await gone(grandchild)


async def test_a_child_cannot_make_the_daemon_its_grandchilds_parent() -> None:
    """clone(CLONE_PARENT) made the new process a child of the confined process's
    parent (the daemon): killed with the group, it stayed a zombie of the daemon for
    ever, and 200 of them exhausted the service's TasksMax. Refused; clone3, whose
    flags a filter cannot read, says ENOSYS so the C library uses clone; threads,
    fork and subprocesses still work."""
    code, out, err = await run_python("""
        import ctypes, os, subprocess, sys, threading
        libc = ctypes.CDLL(None, use_errno=True)
        SIGCHLD, CLONE_PARENT = 17, 0x8000
        pid = libc.syscall(56, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0)
        if pid == 0:
            os._exit(0)
        print("clone-parent", pid, ctypes.get_errno())
        print("clone3", libc.syscall(435, 0, 0), ctypes.get_errno())
        t = threading.Thread(target=lambda: print("thread-ran"))
        t.start(); t.join()
        child = os.fork()
        if child == 0:
            os._exit(7)
        print("fork", os.waitpid(child, 0)[1] >> 8)
        print("spawn", subprocess.run([sys.executable, "-c", "print(1)"],
                                      capture_output=True).stdout.strip().decode())
    """, python_policy())
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "clone-parent -1 1"  # EPERM
    assert lines[1] == "clone3 -1 38"  # ENOSYS
    assert lines[2:] == ["thread-ran", "fork 7", "spawn 1"]


async def test_an_orphaned_grandchild_stays_the_confined_processs_child() -> None:
    """The confined process is a subreaper it cannot stop being: a grandchild whose
    parent exits is re-parented to it (not to init), so whoever watches the confined
    process sees every process it left behind among its children."""
    code, out, err = await run_python("""
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(flag), 0, 0, 0)
        print("subreaper", flag.value)
        print("unset", libc.prctl(36, 0, 0, 0, 0), ctypes.get_errno())
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            grandchild = os.fork()
            if grandchild == 0:
                time.sleep(600)
            os.write(w, str(grandchild).encode())
            os._exit(0)
        os.waitpid(child, 0)
        grandchild = int(os.read(r, 32))
        with open(f"/proc/{grandchild}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        print("parent", "self" if parent == os.getpid() else parent)
        os.kill(grandchild, 9)
        os.waitpid(grandchild, 0)
    """, python_policy(read_paths=(*PYTHON_READ, "/proc")))
    assert code == 0, err
    assert out.splitlines() == ["subreaper 1", "unset -1 1", "parent self"]


@needs_landlock
async def test_reading_outside_read_paths_is_denied(tmp_path) -> None:
    secret = tmp_path / "clients.yaml"
    secret.write_text("token: s3cret")
    code, out, err = await run_python(f"print(open({str(secret)!r}).read())", python_policy())
    assert code != 0 and "PermissionError" in err and "s3cret" not in out
    # the same read with the path granted works: the denial above is the policy's
    code, out, _ = await run_python(f"print(open({str(secret)!r}).read())",
                                    python_policy(read_paths=(*PYTHON_READ, str(tmp_path))))
    assert code == 0 and "s3cret" in out


@needs_landlock
async def test_writing_outside_write_paths_is_denied(tmp_path) -> None:
    target = tmp_path / "out.txt"
    code, _, err = await run_python(f"open({str(target)!r}, 'w').write('x')",
                                    python_policy(read_paths=(*PYTHON_READ, str(tmp_path))))
    assert code != 0 and "PermissionError" in err and not target.exists()
    code, _, _ = await run_python(f"open({str(target)!r}, 'w').write('x')",
                                  python_policy(write_paths=(str(tmp_path),)))
    assert code == 0 and target.read_text() == "x"


as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the daemon is not root here")


@as_root
async def test_a_root_child_keeps_no_capability_now_or_after_exec() -> None:
    """A daemon run as root (as it must be for network namespaces) starts children
    as root: they hold no capability, and exec (of a setuid-free program, as root)
    grants them none."""
    code, out, err = await run_python("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()  # (effective, permitted, inheritable) twice
        assert libc.capget(header, data) == 0
        bounding = [c for c in range(64) if libc.prctl(23, c, 0, 0, 0) == 1]  # CAPBSET_READ
        print(os.getuid(), sum(data), len(bounding))
        """, python_policy(network=True))
    assert code == 0, err
    assert out.split() == ["0", "0", "0"]  # uid 0, no capability in any set


@as_root
@needs_landlock
async def test_a_root_child_cannot_make_a_device_node_beneath_its_write_path(tmp_path) -> None:
    """Not /dev/kmsg's node, not a disk's: a node made beneath a writable folder would
    open any device past the rules on /dev."""
    code, out, err = await run_python(f"""
        import os, stat
        for name, kind, dev in (("kmsg", stat.S_IFCHR, (1, 11)), ("disk", stat.S_IFBLK, (8, 0))):
            try:
                os.mknod({str(tmp_path)!r} + "/" + name, 0o600 | kind, os.makedev(*dev))
                print(name, "made")
            except OSError as exc:
                print(name, "refused", exc.errno)
        """, python_policy(network=True, write_paths=(str(tmp_path),)))
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines()] == ["refused", "refused"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
async def test_another_user_cannot_read_what_the_policy_grants() -> None:
    # Landlock grants the folder (one any user may enter); the uid switch still keeps
    # a 0600 file in it out of reach.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        os.chmod(folder, 0o755)
        secret = os.path.join(folder, "secret")
        with open(secret, "w") as f:
            f.write("s3cret")
        os.chmod(secret, 0o600)
        policy = Policy(read_paths=(*SYSTEM_READ_PATHS, folder))
        seen = {}
        for uid in (None, 65534):
            proc = await spawn(["/bin/sh", "-c", f"id -u; id -G; cat {secret}"],
                               dataclasses.replace(policy, uid=uid, gid=uid))
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
            seen[uid] = out.decode().split()
    assert seen[None] == ["0", "0", "s3cret"]
    assert seen[65534] == ["65534", "65534"]  # no supplementary groups, nothing read


@needs_landlock
async def test_reading_the_parent_proc_environ_is_denied() -> None:
    code, out, err = await run_python(
        f"print(open('/proc/{os.getpid()}/environ', 'rb').read())", python_policy())
    assert code != 0 and "PermissionError" in err and out == ""


@pytest.mark.skipif(not landlock_status().scopes, reason="Landlock ABI < 6")
async def test_signalling_the_parent_is_denied() -> None:
    _code, out, _ = await run_python(f"""
        import os, signal
        try:
            os.kill({os.getpid()}, signal.SIGTERM)
            print("sent")
        except PermissionError:
            print("denied")
    """, python_policy())
    assert out.strip() == "denied"


async def test_connect_to_loopback_with_network_off_is_refused() -> None:
    async with recording_server() as (port, accepted):
        probe = f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
                print("connected")
            except OSError as e:
                print("refused", e.errno)
        """
        _code, out, _ = await run_python(probe, python_policy(network=False))
        assert out.startswith("refused") and accepted == []
        _code, out, _ = await run_python(probe, python_policy(network=True))
        assert out.strip() == "connected"
    assert len(accepted) == 1


async def test_a_child_cannot_open_a_unix_socket_it_was_not_handed(tmp_path) -> None:
    """A confined child ran as the daemon's uid and connected to its operator socket
    by path: Landlock scopes abstract names only and the socket checks only the uid.
    socket(AF_UNIX) is refused (pathname, abstract, datagram alike) and io_uring, whose
    operations no filter sees, is absent; socketpair, asyncio, subprocesses, IP
    sockets and a Unix socket handed to it all still work."""
    path = str(tmp_path / "operator.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(8)
    listener.setblocking(False)
    handed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await spawn([sys.executable, "-I", "-S", "-c", textwrap.dedent(f"""
            import asyncio, ctypes, os, socket, subprocess, sys
            for how in ("stream", "dgram", "abstract"):
                try:
                    kind = socket.SOCK_DGRAM if how == "dgram" else socket.SOCK_STREAM
                    s = socket.socket(socket.AF_UNIX, kind)
                    s.connect("\\0agentd-test" if how == "abstract" else {path!r})
                    print(how, "connected")
                except OSError as e:
                    print(how, "refused", e.errno)
            libc = ctypes.CDLL(None, use_errno=True)
            print("io_uring", libc.syscall(425, 8, ctypes.create_string_buffer(120)),
                  ctypes.get_errno())
            a, b = socket.socketpair()
            a.sendall(b"pair"); print(b.recv(4).decode())
            async def main():
                await asyncio.sleep(0)
                return "asyncio"
            print(asyncio.run(main()))
            print(subprocess.run([sys.executable, "-c", "print('spawn')"],
                                 capture_output=True).stdout.decode().strip())
            socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(); print("inet")
            given = socket.socket(fileno=0)
            given.connect({path!r}); print("handed connected")
        """)], python_policy(read_paths=(*PYTHON_READ, str(tmp_path))),
            stdin=handed.fileno())
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        handed.close()
    try:
        accepted, _ = listener.accept()  # the handed socket's connection, and only it
        accepted.close()
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert proc.returncode == 0, err
    assert out.decode().splitlines() == [
        "stream refused 13", "dgram refused 13", "abstract refused 13",
        "io_uring -1 38", "pair", "asyncio", "spawn", "inet", "handed connected"]


async def test_memory_cap_stops_a_large_allocation() -> None:
    code, _, err = await run_python("b = bytearray(512 * 1024 * 1024)",
                                    python_policy(memory_mb=128))
    assert code != 0 and "MemoryError" in err


async def test_cpu_cap_kills_a_busy_loop() -> None:
    code, _, _ = await run_python("while True: pass", python_policy(cpu_s=1), timeout=120)
    assert code in (-signal.SIGXCPU, -signal.SIGKILL)


async def test_open_files_cap_stops_descriptor_hoarding() -> None:
    code, out, _ = await run_python("""
        import os
        fds = []
        try:
            while True:
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            print(len(fds), e.errno)
    """, python_policy(open_files=16))
    count, errno_ = out.split()
    assert code == 0 and int(count) < 16 and int(errno_) == 24  # EMFILE


async def test_confinement_failure_never_runs_the_target(tmp_path) -> None:
    marker = tmp_path / "ran"
    proc = await spawn(["/usr/bin/touch", str(marker)],
                       Policy(cwd=str(tmp_path / "missing"), write_paths=(str(tmp_path),)))
    _, err = await proc.communicate()
    assert proc.returncode == SHIM_FAILED and err.startswith(b"confine:")
    assert not marker.exists()


def test_network_false_without_any_mechanism_is_refused() -> None:
    bare = LandlockStatus(abi=3, filesystem=True, network_tcp=False, scopes=False,
                          network_namespace=False, seccomp=True)
    with pytest.raises(ConfinementUnavailable, match="network: false"):
        check_enforceable(Policy(network=False), bare)
    check_enforceable(Policy(network=True), bare)  # nothing to enforce: fine


def test_required_filesystem_confinement_without_landlock_is_refused() -> None:
    none = LandlockStatus(abi=0, filesystem=False, network_tcp=False, scopes=False,
                          network_namespace=True, seccomp=True)
    with pytest.raises(ConfinementUnavailable, match="Landlock"):
        check_enforceable(Policy(require_filesystem=True), none)
    check_enforceable(Policy(), none)  # degrades with a warning


def test_status_reports_what_the_kernel_enforces() -> None:
    st = landlock_status().as_dict()
    assert set(st) >= {"landlock_abi", "filesystem", "network_tcp", "network_denial"}


