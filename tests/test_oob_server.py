"""The OOB server on a real Unix socket: permissions, stale sockets, peers, framing,
every refusal answered, counted and audited."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentd import _metrics
from agentd.confine import SYSTEM_READ_PATHS, Policy, cgroups, kill_group, spawn
from agentd.oob import (
    SECURITY_KINDS,
    ErrorCode,
    OobClient,
    OobProtocolError,
    OobServer,
    OobSocketError,
    ServerState,
    encode_frame,
    parse_response,
    sign_request,
)
from agentd.oob._server import Peer, peer_allowed
from tests.test_oob_fixtures import FakeCommands, ServerThread, make_key


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.key, self.key_path, line = make_key(tmp, "ops-1")
        self.other, _, other_line = make_key(tmp, "ops-2")
        self.authorized = tmp / "authorized_keys"
        self.authorized.write_text(line + "\n" + other_line + "\n")
        self.socket = tmp / "oob.sock"

    def sign(self, command: str = "status", args: dict[str, str] | None = None,
             **kw: object) -> bytes:
        return sign_request(self.key, "ops-1", command, args, **kw)  # type: ignore[arg-type]


@pytest.fixture
def setup(tmp_path: Path) -> Setup:
    return Setup(tmp_path)


@pytest.fixture
def server(setup: Setup) -> Iterator[ServerThread]:
    with ServerThread(setup.socket, setup.authorized) as srv:
        yield srv


def client(setup: Setup) -> OobClient:
    return OobClient(setup.socket, timeout=10)


def counter(name: str, **labels: str) -> float:
    return _metrics.REGISTRY.get_sample_value(name, labels) or 0.0


# --- the socket file ---------------------------------------------------------------------


async def test_socket_is_mode_0600_as_soon_as_it_accepts(setup: Setup) -> None:
    srv = OobServer(setup.socket, setup.authorized, FakeCommands())
    await srv.start()
    try:
        st = os.lstat(setup.socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        # nothing left of the private directory it was bound in
        assert [p.name for p in setup.dir.iterdir() if p.name.startswith(".oob")] == []
        reader, writer = await asyncio.open_unix_connection(str(setup.socket))
        writer.write(encode_frame(setup.sign()))
        size = struct.unpack(">I", await reader.readexactly(4))[0]
        assert parse_response(await reader.readexactly(size)).ok
        writer.close()
    finally:
        await srv.close()
    assert not setup.socket.exists()
    assert srv.state is ServerState.CLOSED


async def test_socket_never_appears_with_a_wider_mode(setup: Setup) -> None:
    """Watch the directory while the server starts: every time the final name exists
    it is already a 0600 socket."""
    seen: list[int] = []
    stop = False

    def watch() -> None:
        while not stop:
            with contextlib.suppress(FileNotFoundError):
                seen.append(stat.S_IMODE(os.lstat(setup.socket).st_mode))

    t = threading.Thread(target=watch)
    t.start()
    try:
        for _ in range(20):
            srv = OobServer(setup.socket, setup.authorized, FakeCommands())
            await srv.start()
            await srv.close()
    finally:
        stop = True
        t.join()
    assert seen and set(seen) == {0o600}


async def test_stale_socket_from_a_crash_is_replaced(setup: Setup) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(setup.socket))
    dead.close()  # the file stays; nobody listens: what a crash leaves
    assert stat.S_ISSOCK(os.lstat(setup.socket).st_mode)
    srv = OobServer(setup.socket, setup.authorized, FakeCommands())
    await srv.start()
    try:
        with client(setup) as c:
            assert (await asyncio.to_thread(c.request, setup.sign())).ok
    finally:
        await srv.close()


async def test_live_socket_of_another_daemon_is_refused(setup: Setup) -> None:
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(setup.socket))
    live.listen(1)
    try:
        before = os.lstat(setup.socket).st_ino
        srv = OobServer(setup.socket, setup.authorized, FakeCommands())
        with pytest.raises(OobSocketError, match="already running"):
            await srv.start()
        assert os.lstat(setup.socket).st_ino == before
    finally:
        live.close()


@pytest.mark.parametrize("kind", ["file", "symlink", "directory"])
async def test_a_non_socket_at_the_path_is_left_alone(setup: Setup, kind: str) -> None:
    if kind == "file":
        setup.socket.write_text("precious")
    elif kind == "symlink":
        setup.socket.symlink_to(setup.dir / "elsewhere")
    else:
        setup.socket.mkdir()
    srv = OobServer(setup.socket, setup.authorized, FakeCommands())
    with pytest.raises(OobSocketError, match="not a socket"):
        await srv.start()
    assert os.path.lexists(setup.socket)
    if kind == "file":
        assert setup.socket.read_text() == "precious"


async def test_close_does_not_unlink_a_socket_that_is_no_longer_ours(setup: Setup) -> None:
    srv = OobServer(setup.socket, setup.authorized, FakeCommands())
    await srv.start()
    os.unlink(setup.socket)
    setup.socket.write_text("someone else's")
    await srv.close()
    assert setup.socket.read_text() == "someone else's"


async def test_bad_authorized_keys_fails_start_without_a_socket(setup: Setup) -> None:
    setup.authorized.write_text("ssh-rsa AAAAB3NzaC1yc2E ops\n")
    srv = OobServer(setup.socket, setup.authorized, FakeCommands())
    with pytest.raises(Exception, match="not supported"):
        await srv.start()
    assert not os.path.lexists(setup.socket)


# --- peers -------------------------------------------------------------------------------


def test_peer_policy() -> None:
    assert peer_allowed(0, 1000, ())
    assert peer_allowed(1000, 1000, ())
    assert peer_allowed(1001, 1000, (1001,))
    assert not peer_allowed(1002, 1000, (1001,))


_AS_NOBODY = r"""
import os, socket, struct, sys
path, frame = sys.argv[1], bytes.fromhex(sys.argv[2])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(path)
except PermissionError:
    print("EACCES"); sys.exit(0)
try:
    s.sendall(struct.pack(">I", len(frame)) + frame)
    head = s.recv(4)
except (BrokenPipeError, ConnectionResetError):
    head = b""
if not head:
    print("CLOSED"); sys.exit(0)
(n,) = struct.unpack(">I", head)
data = b""
while len(data) < n:
    data += s.recv(n - len(data))
print("ANSWER", data.decode())
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other uids may traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="oob-", dir="/tmp"))
    os.chmod(d, 0o711)
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _as_nobody(path: Path, frame: bytes) -> str:
    out = subprocess.run([sys.executable, "-c", _AS_NOBODY, str(path), frame.hex()],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_uid_that_is_not_allowed_is_refused(setup: Setup, shared_dir: Path) -> None:
    path = shared_dir / "oob.sock"
    with ServerThread(path, setup.authorized) as srv:
        # The socket's mode alone keeps uid 65534 out …
        assert _as_nobody(path, setup.sign()) == "EACCES"
        # … and if the mode were ever loosened, SO_PEERCRED still does.
        os.chmod(path, 0o666)
        before = counter("agentd_security_events_total", kind="peer-refused")
        assert _as_nobody(path, setup.sign()) == "CLOSED"
        assert counter("agentd_security_events_total", kind="peer-refused") == before + 1
        kind, fields = srv.audit[-1]
        assert kind == "peer-refused" and fields["uid"] == "65534"
        assert srv.commands.calls == []
        # root is still served
        with OobClient(path, timeout=10) as c:
            assert c.request(setup.sign()).ok


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_allowed_uid_is_served(setup: Setup, shared_dir: Path) -> None:
    path = shared_dir / "oob.sock"
    with ServerThread(path, setup.authorized, allowed_uids=[65534]) as srv:
        os.chmod(path, 0o666)  # the operator's choice: e.g. a group-shared socket
        answer = _as_nobody(path, setup.sign())
        assert answer.startswith("ANSWER") and 'ok="true"' in answer
        assert srv.audit[-1][1]["uid"] == "65534"


# --- commands and refusals over the socket ---------------------------------------------


def test_several_requests_on_one_connection(setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        for name, args in [("status", {}), ("reload", {"dry-run": "true"}),
                           ("introspect", {"what": "capabilities"}),
                           ("journal", {"limit": "3"}), ("shutdown", {"mode": "graceful"})]:
            resp = c.request(setup.sign(name, args))
            assert resp.ok, resp.error_message
    assert [n for n, _ in server.commands.calls] == [
        "status", "reload", "introspect", "journal", "shutdown"]
    assert server.commands.calls[1][1] == {"dry-run": "true"}


def test_pipelined_requests_are_answered_in_order(setup: Setup, server: ServerThread) -> None:
    frames = [setup.sign("journal", {"limit": str(i)}) for i in range(1, 6)]
    with client(setup) as c:
        c.send_bytes(b"".join(encode_frame(f) for f in frames))
        for i in range(1, 6):
            resp = parse_response(c.recv_frame())
            assert resp.result is not None and len(resp.result[0]) == i


def test_command_errors_are_answered_with_their_codes(setup: Setup,
                                                      server: ServerThread) -> None:
    with client(setup) as c:
        unknown = c.request(setup.sign("format-disk"))
        assert (unknown.ok, unknown.error_code) == (False, "unknown-command")
        invalid = c.request(setup.sign("introspect", {"what": "schema", "name": "nope"}))
        assert invalid.error_code == "invalid" and "nope" in invalid.error_message
        bug = c.request(setup.sign("explode"))
        assert bug.error_code == "failed" and "a bug" not in bug.error_message
        huge = c.request(setup.sign("huge"))
        assert huge.error_code == "failed" and "frame limit" in huge.error_message
        ctl = c.request(setup.sign("control-char"))
        assert ctl.error_code == "failed"
        assert c.request(setup.sign()).ok  # the connection survived all of it
    outcomes = [f["outcome"] for k, f in server.audit if k == "oob-command"]
    assert outcomes == ["unknown-command", "invalid", "failed", "failed", "failed", "ok"]


def _code(c: OobClient, frame: bytes) -> str:
    resp = c.request(frame)
    return "ok" if resp.ok else resp.error_code


def _code_once(setup: Setup, frame: bytes) -> str:
    """The answer's code on a connection of its own (a refusal closes it)."""
    with client(setup) as c:
        return _code(c, frame)


def test_every_refusal_is_answered_counted_and_audited(setup: Setup,
                                                       server: ServerThread) -> None:
    before = {code: counter("agentd_oob_commands_total", command="status", outcome=code)
              for code in ("bad-signature", "unknown-key", "replay", "stale")}
    good = setup.sign()
    tampered = setup.sign("reload", {"dry-run": "true"}).replace(b">true<", b">fals<")
    wrong_key = sign_request(setup.other, "ops-1", "status")
    unknown = sign_request(setup.key, "ghost", "status")
    stale = setup.sign(issued_at=time.time() - 61)
    future = setup.sign(issued_at=time.time() + 61)
    assert _code_once(setup, good) == "ok"
    assert _code_once(setup, tampered) == "bad-signature"
    assert _code_once(setup, wrong_key) == "bad-signature"
    assert _code_once(setup, unknown) == "unknown-key"
    assert _code_once(setup, stale) == "stale"
    assert _code_once(setup, future) == "stale"
    assert _code_once(setup, good) == "replay"  # a captured frame, on a new connection
    assert server.kinds() == [
        "oob-command", "bad-signature", "bad-signature", "unknown-key", "stale", "stale",
        "replay",
    ]
    assert [n for n, _ in server.commands.calls] == ["status"]
    after = {code: counter("agentd_oob_commands_total", command="status", outcome=code)
             for code in before}
    assert {k: after[k] - before[k] for k in before} == {
        "bad-signature": 1, "unknown-key": 1, "replay": 1, "stale": 2}
    _, fields = server.audit[3]
    assert fields["key_id"] == "ghost" and fields["uid"] == str(os.geteuid())
    assert fields["code"] == "unknown-key" and fields["channel"] == "oob"
    assert set(server.kinds()[1:]) <= SECURITY_KINDS


def test_accepted_command_audit_fields(setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        assert c.request(setup.sign("journal", {"limit": "2"}, nonce="e" * 32)).ok
    kind, fields = server.audit[-1]
    assert kind == "oob-command"
    assert fields["key_id"] == "ops-1" and fields["command"] == "journal"
    assert fields["args"] == '{"limit": "2"}' and fields["outcome"] == "ok"
    assert fields["nonce"] == "e" * 32 and fields["pid"] == str(os.getpid())


def test_the_audit_entry_of_introspect_names_what_it_looked_at(
        setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        assert c.request(setup.sign("introspect", {"what": "capabilities"})).ok
    kind, fields = server.audit[-1]
    assert (kind, fields["command"]) == ("oob-command", "introspect capabilities")


def test_huge_length_prefix_closes_the_connection_and_the_server_keeps_serving(
        setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        c.send_bytes(struct.pack(">I", 0xFFFFFFFF) + b"<privileged")
        resp = parse_response(c.recv_frame())
        assert resp.error_code == "invalid" and "exceeds" in resp.error_message
        with pytest.raises(OobProtocolError, match="closed"):
            c.recv_frame()
    kind, fields = server.audit[-1]
    assert kind == "invalid" and "exceeds" in fields["detail"]
    with client(setup) as c:
        assert c.request(setup.sign()).ok


def test_frame_of_exactly_the_limit_is_read(setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        c.send_frame(b" " * (1 << 20))  # whitespace: not XML, but not oversize
        assert parse_response(c.recv_frame()).error_code == "invalid"


def test_garbage_is_invalid_and_closes(setup: Setup, server: ServerThread) -> None:
    with client(setup) as c:
        assert _code(c, b"\x00\x01garbage\xff") == "invalid"
        with pytest.raises(OobProtocolError):
            c.request(setup.sign())
    assert server.kinds() == ["invalid"]
    assert set(server.kinds()) <= SECURITY_KINDS


def test_schema_invalid_request_is_answered_and_closes(
        setup: Setup, server: ServerThread) -> None:
    for frame in (b"", b'<privileged xmlns="https://xml-pipeline.org/ns/privileged/v1"/>'):
        with client(setup) as c:
            assert _code(c, frame) == "invalid"
            with pytest.raises(OobProtocolError, match="closed"):
                c.recv_frame()
    assert _code_once(setup, setup.sign()) == "ok"


def test_a_peer_sending_unsigned_frames_is_disconnected_after_the_first(
        setup: Setup, server: ServerThread) -> None:
    """Unsigned frames on one held connection were each answered and journaled while
    the connection stayed open (about 7,000 security rows a second). The first one
    is answered and the connection closed: the rest are never read."""
    with client(setup) as c:
        c.send_bytes(b"".join(encode_frame(b"<x/>") for _ in range(200)))
        assert parse_response(c.recv_frame()).error_code == "invalid"
        with pytest.raises(OobProtocolError, match="closed"):
            c.recv_frame()
    assert server.kinds() == ["invalid"]
    assert _code_once(setup, setup.sign()) == "ok"


def test_a_flood_of_refusals_is_journaled_as_a_bounded_count(setup: Setup) -> None:
    """One peer refused 300 times: the first few refusals are journaled whole, the
    rest as one counted `repeated-refusals` row (the metrics still count each)."""
    before = counter("agentd_security_events_total", kind="invalid")
    with ServerThread(setup.socket, setup.authorized) as srv:
        for _ in range(300):
            assert _code_once(setup, b"<x/>") == "invalid"
        assert _code_once(setup, setup.sign()) == "ok"  # the operator is still served
        during = srv.kinds()
    rows = srv.audit  # after close(): the count still open is journaled
    assert during.count("invalid") == len(during) - 1 <= 10
    security = [(k, f) for k, f in rows if k != "oob-command"]
    assert len(security) == len(during)
    kind, fields = security[-1]
    assert kind == "repeated-refusals" and kind in SECURITY_KINDS
    assert fields["count"] == str(300 - (len(security) - 1))
    assert fields["kinds"] == f"invalid:{fields['count']}"
    assert fields["peer"] == f"uid={os.geteuid()} pid={os.getpid()}"
    assert counter("agentd_security_events_total", kind="invalid") == before + 300


async def test_a_confined_child_is_refused_at_connect(tmp_path: Path) -> None:
    """A handler worker, exec tool or MCP server runs as the daemon's uid: its uid
    passes. A child of the daemon's own confinement is refused before a byte is read,
    here through a Unix socket handed to it (it may not create one)."""
    setup = Setup(tmp_path)
    audit: list[tuple[str, dict[str, str]]] = []
    srv = OobServer(setup.socket, setup.authorized, FakeCommands(),
                    audit=lambda kind, fields: audit.append((kind, dict(fields))))
    await srv.start()
    handed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = await spawn([sys.executable, "-I", "-S", "-c", (
            "import socket, struct\n"
            "s = socket.socket(fileno=0)\n"
            f"s.connect({str(setup.socket)!r})\n"
            "s.settimeout(5)\n"
            "try:\n"
            f"    s.sendall(struct.pack('>I', len({setup.sign()!r})) + {setup.sign()!r})\n"
            "    print('closed' if s.recv(4) == b'' else 'answered')\n"
            "except (BrokenPipeError, ConnectionResetError):\n"
            "    print('closed')\n")],
            Policy(read_paths=(*SYSTEM_READ_PATHS, sys.base_prefix, sys.prefix,
                               str(tmp_path))), stdin=handed.fileno())
        handed.close()
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        handed.close()
        await srv.close()
    assert out.decode().strip() == "closed", err
    kind, fields = audit[-1]
    assert kind == "peer-refused" and "confined child" in fields["detail"]
    assert fields["pid"] == str(proc.pid)


def test_half_a_frame_then_disconnect_does_not_hurt(setup: Setup,
                                                    server: ServerThread) -> None:
    with client(setup) as c:
        c.send_bytes(struct.pack(">I", 100) + b"<priv")
    with client(setup) as c:
        assert c.request(setup.sign()).ok


def test_idle_connection_is_closed(setup: Setup) -> None:
    with ServerThread(setup.socket, setup.authorized, idle_timeout_s=0.3) as srv:
        with client(setup) as c:
            c.send_bytes(struct.pack(">I", 100) + b"<priv")  # and never the rest
            with pytest.raises(OobProtocolError, match="closed"):
                c.recv_frame()
        assert srv.server.state is ServerState.SERVING


@pytest.mark.skipif(not cgroups().available, reason="no pids cgroup to make here")
async def test_a_process_in_a_confined_childs_cgroup_is_refused(tmp_path: Path) -> None:
    """What a confined child started stays in its cgroup even where it could leave its
    process group: a process there is refused too (here one moved in from outside,
    which can create its own socket)."""
    setup = Setup(tmp_path)
    audit: list[tuple[str, dict[str, str]]] = []
    srv = OobServer(setup.socket, setup.authorized, FakeCommands(),
                    audit=lambda kind, fields: audit.append((kind, dict(fields))))
    await srv.start()
    child = await spawn(["/bin/sleep", "30"], Policy(max_tasks=8))
    try:
        name = ""
        for _ in range(1000):  # until the shim has moved itself into its cgroup
            with open(f"/proc/{child.pid}/cgroup") as f:
                name = next((line.rpartition("/")[2] for line in f.read().splitlines()
                             if "/agentd-" in line), "")
            if name:
                break
            await asyncio.sleep(0.01)
        hierarchy = cgroups().hierarchy
        assert hierarchy is not None
        procs = hierarchy.base / name / "cgroup.procs"
        frame = setup.sign()
        helper = await asyncio.create_subprocess_exec(
            sys.executable, "-c",
            "import os, socket, struct\n"
            f"open({str(procs)!r}, 'w').write(str(os.getpid()))\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"s.connect({str(setup.socket)!r}); s.settimeout(5)\n"
            "try:\n"
            f"    s.sendall(struct.pack('>I', {len(frame)}) + {frame!r})\n"
            "    print('closed' if s.recv(4) == b'' else 'answered')\n"
            "except (BrokenPipeError, ConnectionResetError):\n"
            "    print('closed')\n",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(helper.communicate(), 30)
    finally:
        await kill_group(child)
        await srv.close()
    assert out.decode().strip() == "closed", err
    kind, fields = audit[-1]
    assert kind == "peer-refused" and fields["pid"] == str(helper.pid)


def test_reload_keys_adds_and_removes_keys(setup: Setup, server: ServerThread) -> None:
    new, _, line = make_key(setup.dir, "ops-3")
    frame = sign_request(new, "ops-3", "status")
    assert _code_once(setup, frame) == "unknown-key"
    setup.authorized.write_text(line + "\n")
    server.server.reload_keys()
    assert _code_once(setup, sign_request(new, "ops-3", "status")) == "ok"
    assert _code_once(setup, setup.sign()) == "unknown-key"
    setup.authorized.write_text("garbage\n")
    with pytest.raises(Exception, match="not a key line"):
        server.server.reload_keys()
    assert _code_once(setup, sign_request(new, "ops-3", "status")) == "ok"  # kept
    server.server.reload_keys({"ops-1": setup.key.public_key()})  # pre-validated
    assert _code_once(setup, setup.sign()) == "ok"
    assert _code_once(setup, sign_request(new, "ops-3", "status")) == "unknown-key"


def test_connection_limit(setup: Setup) -> None:
    with ServerThread(setup.socket, setup.authorized, max_connections=2) as srv:
        with client(setup) as a, client(setup) as b:
            assert a.request(setup.sign()).ok and b.request(setup.sign()).ok
            with client(setup) as c, pytest.raises(OobProtocolError):
                c.request(setup.sign())

        async def closed() -> int:  # loop turns until the server has seen them go
            for _ in range(10_000):
                if not srv.server.connections:
                    break
                await asyncio.sleep(0)
            return srv.server.connections

        assert srv.run(closed()) == 0
        with client(setup) as c:
            assert c.request(setup.sign()).ok


def test_a_failing_audit_sink_does_not_break_commands(setup: Setup) -> None:
    def broken(kind: str, fields: object) -> None:
        raise RuntimeError("journal down")

    async def go() -> None:
        srv = OobServer(setup.socket, setup.authorized, FakeCommands(), audit=broken)
        srv.reload_keys()  # what start() does first; no socket needed here
        response, close = await srv.handle_frame(setup.sign(), Peer(1, 0, 0))
        assert parse_response(response).ok and not close

    asyncio.run(go())


# --- closing -----------------------------------------------------------------------------


async def test_close_cancels_idle_connections_and_lets_running_ones_answer(
        setup: Setup) -> None:
    release, running = asyncio.Event(), asyncio.Event()

    class Slow(FakeCommands):
        async def run(self, name: str, args: object) -> str:
            running.set()
            await release.wait()
            return "done"

    srv = OobServer(setup.socket, setup.authorized, Slow())
    await srv.start()
    idle_r, idle_w = await asyncio.open_unix_connection(str(setup.socket))
    busy_r, busy_w = await asyncio.open_unix_connection(str(setup.socket))
    busy_w.write(encode_frame(setup.sign()))
    await running.wait()
    closing = asyncio.create_task(srv.close(grace_s=5))
    # The idle one is gone at once (not after its 60 s idle timeout).
    assert await asyncio.wait_for(idle_r.read(), 5) == b""
    assert not closing.done()
    release.set()
    size = struct.unpack(">I", await busy_r.readexactly(4))[0]
    assert parse_response(await busy_r.readexactly(size)).ok
    await closing
    assert not setup.socket.exists()
    idle_w.close()
    busy_w.close()


async def test_shutdown_command_may_close_the_server_from_its_own_connection(
        setup: Setup) -> None:
    class ClosingCommands(FakeCommands):
        server: OobServer | None = None

        async def run(self, name: str, args: object) -> str:
            assert self.server is not None
            await self.server.close()  # the anti-pattern: it must not deadlock
            return "bye"

    commands = ClosingCommands()
    srv = commands.server = OobServer(setup.socket, setup.authorized, commands)
    await srv.start()
    reader, writer = await asyncio.open_unix_connection(str(setup.socket))
    writer.write(encode_frame(setup.sign("shutdown", {"mode": "now"})))
    size = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), 5))[0]
    assert parse_response(await reader.readexactly(size)).ok
    assert srv.state is ServerState.CLOSED
    writer.close()


def test_error_codes_are_the_contract_codes() -> None:
    assert {c.value for c in ErrorCode} == {
        "bad-signature", "replay", "stale", "unknown-key", "unknown-command", "invalid",
        "failed"}

