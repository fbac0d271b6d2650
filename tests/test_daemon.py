"""End to end against a real `agentd run` child process: the TLS bus with TOTP, the
metrics listener, SIGTERM, kill -9 and restart, and every privileged command
through the real `agentctl` over the real Unix socket."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pyotp
import pytest
import yaml
from websockets.exceptions import ConnectionClosed

from agentd._envelope import parse_envelope
from agentd.client import AuthenticationFailed, BusClient, BusError, frame_kind
from agentd.kernel import verify_journal_main
from agentd.platform.demo import MathQuestion
from agentd.tools.calculator import Add
from agentd.tools.relay import Relay
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.organisms.listeners import Hold


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


def kinds(frames: list[bytes]) -> list[tuple[str, str]]:
    return [frame_kind(f)[:2] for f in frames]


async def test_daemon_answers_over_the_tls_bus_and_serves_metrics(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(Add(a=2, b=40))
            assert kinds(frames) == [("core", "accepted"), ("calculator.add", "sum")]
            assert b"<value>42</value>" in frames[-1]
            relayed = await bus.exchange(Relay(a=1, b=2))
            assert kinds(relayed)[-1] == ("relay", "sum")
        body = await asyncio.to_thread(_get, d.metrics_url + "/metrics")
        assert "agentd_envelopes_received_total 2.0" in body
        assert 'agentd_dispatch_total{listener="calculator.add",outcome="ok"}' in body
        assert "agentd_journal_commit_seconds_bucket" in body
        assert "agentd_kernel_healthy 1.0" in body  # read at scrape time, from the start
        assert "agentd_kernel_writer_restarts 0.0" in body
        assert "agentd_kernel_in_flight 0.0" in body  # all committed
        assert await asyncio.to_thread(_get, d.metrics_url + "/healthz")
        assert await asyncio.to_thread(_get, d.metrics_url + "/readyz")
    finally:
        assert await d.stop() == 0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


async def test_sigterm_closes_connections_with_1001_and_exits_cleanly(home: Path) -> None:
    d = await DaemonProcess(home).start()
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        await bus.exchange(Add(a=1, b=1))
        code = await d.stop(signal.SIGTERM)
        with pytest.raises(ConnectionClosed):
            await bus.connection.recv()
        assert bus.connection.close_code == 1001
    assert code == 0
    assert any("stopping mode=graceful" in line for line in d.log)


async def test_accepted_messages_survive_kill_9_and_reach_the_client_after_restart(
    home: Path,
) -> None:
    d = await DaemonProcess(home, env={"AGENTD_TEST_HOLD": "block"}).start()
    threads: dict[str, int] = {}
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        for n in range(20):
            threads[await bus.send(Hold(n=n))] = n
        accepted = set()
        while len(accepted) < 20:
            sender, kind, thread = frame_kind(await bus.recv(timeout=30))
            assert (sender, kind) == ("core", "accepted")
            accepted.add(thread)
        session = bus.session
    assert accepted == set(threads)
    await d.stop(signal.SIGKILL)

    # Restarted with handlers that answer: the journal redelivers every accepted
    # request; the answers wait in the outbox until alice is back (same session).
    d2 = await DaemonProcess(home, env={"AGENTD_TEST_HOLD": "pass"}).start()
    try:
        answers: dict[str, bytes] = {}
        async with BusClient(d2.url, "alice", session=session, cafile=d2.cafile) as bus:
            while len(answers) < 20:
                frame = await bus.recv(timeout=30)
                sender, kind, thread = frame_kind(frame)
                assert (sender, kind) == ("hold", "done")
                answers[thread] = frame
        assert set(answers) == set(threads)
        for thread, frame in answers.items():
            env = parse_envelope(frame)
            assert env.to == "alice"
            assert f"<seq>{threads[thread]}</seq>".encode() in frame
            assert b"<by>redelivered</by>" in frame
    finally:
        assert await d2.stop() == 0


async def test_the_daemon_replaces_a_killed_journal_writer_by_itself(home: Path) -> None:
    d = await DaemonProcess(home).start()

    async def status() -> dict[str, Any]:
        code, doc = await asyncio.to_thread(d.agentctl, "status")
        assert code == 0 and doc["ok"], doc
        return doc["result"]["status"]  # values as text, as the wire carries them

    try:
        before = await status()
        assert before["kernel_writer_restarts"] == 0
        os.kill(int(before["kernel_writer_pid"]), signal.SIGKILL)
        for _ in range(200):  # the daemon notices at once and starts another, bounded
            now = await status()
            if now["kernel_writer_restarts"] == 1 and now["kernel_healthy"] is True:
                break
            await asyncio.sleep(0.05)
        assert now["kernel_writer_restarts"] == 1 and now["kernel_healthy"] is True
        assert now["kernel_writer_pid"] != before["kernel_writer_pid"]
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(Add(a=2, b=40))
            assert kinds(frames) == [("core", "accepted"), ("calculator.add", "sum")]
        body = await asyncio.to_thread(_get, d.metrics_url + "/metrics")
        assert "agentd_kernel_writer_restarts 1.0" in body
    finally:
        assert await d.stop() == 0
    assert verify_journal_main(home / "state") == 0


# ---- the out-of-band channel through the real agentctl ---------------------------


async def test_every_privileged_command_against_a_real_daemon(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(Add(a=1, b=2))
        thread = frame_kind(frames[0])[2]

        code, doc = await asyncio.to_thread(d.agentctl, "status")
        assert code == 0 and doc["ok"]
        assert "calculator.add" in str(doc["result"])

        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "capabilities")
        assert code == 0 and "relay" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "schema", "calculator.add")
        assert code == 0 and "xs:schema" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "example", "calculator.add")
        assert code == 0 and "<add" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "prompt", "calculator.add")
        assert code == 0 and "Adds two integers" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "threads")
        assert code == 0 and thread in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "thread", thread)
        assert code == 0 and "alice" in str(doc["result"])  # the private path, here only

        code, doc = await asyncio.to_thread(
            d.agentctl, "introspect", "route", "public", "add two integers"
        )
        route = doc["result"]
        assert code == 0 and route["profile"] == "public", doc
        assert route["selected"] == "calculator.add"
        assert route["ranking"][0]["listener"] == "calculator.add"
        assert 0.2 <= route["ranking"][0]["score"] <= 1.0
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "route", "nope", "x")
        assert code == 1 and not doc["ok"]

        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--thread", thread)
        assert code == 0 and "calculator.add" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "schema", "nope")
        assert code == 1 and not doc["ok"]

        # Every command above is in the journal as an audit event.
        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--limit", "50")
        assert code == 0 and str(doc["result"]).count("oob-command") >= 10

        code, doc = await asyncio.to_thread(d.agentctl, "shutdown")
        assert code == 0
        assert await d.wait() == 0
    finally:
        if d.proc is not None and d.proc.returncode is None:
            await d.stop()


async def test_a_replay_miss_is_final_and_its_log_names_the_thread_introspection_finds(
    home: Path,
) -> None:
    d = await DaemonProcess(home).start()
    try:
        frames = await ask_once(d, MathQuestion(text="What is the capital of France?"))
        assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
        assert b"<code>internal</code>" in frames[-1]
        assert b"<retry-allowed>false</retry-allowed>" in frames[-1]
        assert b"recorded" not in frames[-1]  # generic to the client
        thread = frame_kind(frames[0])[2]
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "thread", thread)
        assert code == 0 and "alice" in str(doc["result"])
        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--thread", thread)
        assert code == 0 and "llm-call" in str(doc["result"])
    finally:
        assert await d.stop() == 0
    # The daemon's own account of the failure names that same thread (and the
    # agent's frame beside it), precisely.
    (line,) = [line for line in d.log if "no completion" in line]
    assert f"thread={thread} frame=" in line and "no recorded exchange" in line


async def ask_once(d: DaemonProcess, payload: Any) -> list[bytes]:
    """alice's one exchange with the daemon `d`, on a connection of its own."""
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        return await bus.exchange(payload)


async def test_reload_adds_removes_and_changes_listeners_while_threads_keep_their_table(
    home: Path,
) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            before = await bus.exchange(Add(a=1, b=1))
            old_thread = frame_kind(before[0])[2]

            def change(doc: dict) -> None:  # type: ignore[type-arg]
                doc["listeners"] = [lst for lst in doc["listeners"] if lst["name"] != "echo"]
                for lst in doc["listeners"]:
                    if lst["name"] == "relay":
                        lst["description"] = "Relays, now with a new description."
                doc["listeners"].append(
                    {
                        "name": "echo2",
                        "payload_class": "agentd.tools.echo:Echo",
                        "response_class": "agentd.tools.echo:EchoReply",
                        "handler": "agentd.tools.echo:echo",
                        "description": "A second echo.",
                    }
                )
                doc["profiles"]["public"]["listeners"] = [
                    n
                    for n in doc["profiles"]["public"]["listeners"]
                    if n not in ("echo", "calculator.add")
                ] + ["echo2"]

            edit_config(home, change)
            code, doc = await asyncio.to_thread(d.agentctl, "reload", "--dry-run")
            assert code == 0, doc
            code, doc = await asyncio.to_thread(d.agentctl, "reload")
            assert code == 0, doc
            result = str(doc["result"])
            assert "echo2" in result and "'echo'" in result and "relay" in result

            # The thread created before the reload still routes under its original
            # table: calculator.add left the public profile, but not for this thread.
            again = await bus.exchange(Add(a=2, b=2), thread=old_thread)
            assert kinds(again)[-1] == ("calculator.add", "sum")
            # A new thread gets the new table.
            fresh = await bus.exchange(Add(a=2, b=2))
            assert b"<code>unroutable</code>" in fresh[-1]

            # An invalid file changes nothing, and the error names the location.
            edit_config(home, lambda doc: doc.update(bogus_key=1))
            code, doc = await asyncio.to_thread(d.agentctl, "reload")
            assert code == 1 and "bogus_key" in str(doc["error"])
            code, doc = await asyncio.to_thread(d.agentctl, "status")
            listeners = doc["result"]["status"]["listeners"]
            assert "echo2" in listeners and "echo" not in listeners
            code, doc = await asyncio.to_thread(d.agentctl, "journal", "--limit", "20")
            assert "reload" in str(doc["result"])
    finally:
        await d.stop()


async def test_a_dry_run_leaves_nothing_a_later_reload_could_lean_on(home: Path) -> None:
    """A dry run loads the new file (its python_path folders go on sys.path, its
    modules are imported) and changes nothing: a later reload of a file that names
    the module without the folder fails, as a fresh start would (it succeeded, and
    the next restart then failed)."""
    plug = home / "plug"
    plug.mkdir()
    (plug / "trial.py").write_text("from agentd.tools.echo import echo  # noqa: F401\n")
    d = await DaemonProcess(home).start()
    try:
        def use_trial(doc: dict) -> None:  # type: ignore[type-arg]
            for lst in doc["listeners"]:
                if lst["name"] == "echo":
                    lst["handler"] = "trial:echo"

        edit_config(home, lambda doc: (use_trial(doc), doc.update(python_path=["plug"])))
        code, doc = await asyncio.to_thread(d.agentctl, "reload", "--dry-run")
        assert code == 0, doc
        edit_config(home, lambda doc: doc.pop("python_path"))
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 1 and "trial" in str(doc["error"]), doc
    finally:
        await d.stop()


def write_clients(home: Path, edit: Any) -> None:
    path = home / "clients.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc["clients"])
    path.write_text(yaml.safe_dump(doc))  # keeps the file's mode 0600


async def closed_with(bus: BusClient) -> int | None:
    """Wait for the server to close `bus`; its close code."""
    with pytest.raises(BusError):
        while True:
            await bus.recv(timeout=10)
    return bus.close_code


async def test_reload_takes_the_clients_file_and_withdraws_removed_and_rekeyed_clients(
    home: Path,
) -> None:
    d = await DaemonProcess(home).start()
    bob_secret, alice_new = pyotp.random_base32(), pyotp.random_base32()
    try:
        alice = BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile)
        await alice.connect()
        assert kinds(await alice.exchange(Add(a=1, b=1)))[-1] == ("calculator.add", "sum")
        with pytest.raises(AuthenticationFailed):  # not a client yet
            await BusClient(d.url, "bob", secret=bob_secret, cafile=d.cafile).connect()

        write_clients(home, lambda c: c.update(bob={"totp_secret": bob_secret,
                                                    "profile": "public"}))
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 0, doc
        assert "bob" in str(doc["result"]["reload"]["clients_added"])
        bob = BusClient(d.url, "bob", secret=bob_secret, cafile=d.cafile)
        await bob.connect()
        assert kinds(await bob.exchange(Add(a=2, b=2)))[-1] == ("calculator.add", "sum")
        # alice was not touched: same connection, still served.
        assert kinds(await alice.exchange(Add(a=3, b=3)))[-1] == ("calculator.add", "sum")

        # Refused files change nothing: readable by others, or an unknown profile.
        path = home / "clients.yaml"
        path.chmod(0o644)
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 1 and "clients file" in str(doc["error"])
        path.chmod(0o600)
        write_clients(home, lambda c: c["bob"].update(profile="nope"))
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 1 and "nope" in str(doc["error"])
        assert kinds(await bob.exchange(Add(a=4, b=4)))[-1] == ("calculator.add", "sum")

        # bob removed, alice given a new secret: both lose their connections (4401,
        # the one generic reason) and their sessions; alice's new secret works at once.
        def withdraw(c: dict) -> None:  # type: ignore[type-arg]
            del c["bob"]
            c["alice"]["totp_secret"] = alice_new

        write_clients(home, withdraw)
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 0, doc
        result = doc["result"]["reload"]
        assert "bob" in str(result["clients_removed"]) and "alice" in str(result["clients_changed"])
        assert await closed_with(alice) == 4401 and await closed_with(bob) == 4401
        for who, session in (("alice", alice.session), ("bob", bob.session)):
            with pytest.raises(AuthenticationFailed) as refused:
                await BusClient(d.url, who, session=session, cafile=d.cafile).connect()
            assert refused.value.code == 4401
        with pytest.raises(AuthenticationFailed):
            await BusClient(d.url, "bob", secret=bob_secret, cafile=d.cafile).connect()
        with pytest.raises(AuthenticationFailed):  # the old secret
            await BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile).connect()
        async with BusClient(d.url, "alice", secret=alice_new, cafile=d.cafile) as again:
            assert kinds(await again.exchange(Add(a=5, b=5)))[-1] == ("calculator.add", "sum")
        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--limit", "1000")
        assert str(doc["result"]).count("'kind': 'reload'") == 2  # audited; refusals not
    finally:
        await d.stop()


async def test_reload_serves_a_new_certificate_to_new_connections(home: Path) -> None:
    from agentd.bus import make_self_signed

    d = await DaemonProcess(home).start()
    try:
        old_ca = d.cafile
        new_cert, new_key = home / "tls2" / "cert.pem", home / "tls2" / "key.pem"
        make_self_signed(new_cert, new_key)
        async with BusClient(d.url, "alice", secret=d.secret, cafile=old_ca) as before:
            # A pair that does not match (new certificate, old key) is refused whole.
            edit_config(home, lambda doc: doc["bus"]["tls"].update(cert=str(new_cert)))
            code, doc = await asyncio.to_thread(d.agentctl, "reload")
            assert code == 1 and "bus.tls" in str(doc["error"])
            async with BusClient(d.url, "alice", session=before.session, cafile=old_ca) as c:
                assert kinds(await c.exchange(Add(a=1, b=1)))[-1] == ("calculator.add", "sum")

            edit_config(home, lambda doc: doc["bus"]["tls"].update(key=str(new_key)))
            code, doc = await asyncio.to_thread(d.agentctl, "reload")
            assert code == 0 and doc["result"]["reload"]["tls_cert"] == str(new_cert)
            with pytest.raises(BusError):  # new connections get the new certificate
                await BusClient(d.url, "alice", session=before.session, cafile=old_ca).connect()
            async with BusClient(d.url, "alice", session=before.session,
                                 cafile=str(new_cert)) as c:
                assert kinds(await c.exchange(Add(a=2, b=2)))[-1] == ("calculator.add", "sum")
            # The connection opened before the reload is untouched.
            assert kinds(await before.exchange(Add(a=3, b=3)))[-1] == ("calculator.add", "sum")
    finally:
        await d.stop()


async def test_systemd_notifications_reach_a_real_notify_socket(home: Path, tmp_path: Path) -> None:
    import socket

    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000"}
    d = await DaemonProcess(home, env=env).start()
    try:
        seen: list[str] = []
        async with asyncio.timeout(30):
            while not {"READY=1", "WATCHDOG=1"} <= set(seen):
                seen.extend((await loop.sock_recv(sock, 4096)).decode().splitlines())
        # READY=1 comes once the bus listens and the kernel is open.
        assert d.url and seen.index("READY=1") >= 0
        assert await d.stop() == 0
        async with asyncio.timeout(30):
            while "STOPPING=1" not in seen:
                seen.extend((await loop.sock_recv(sock, 4096)).decode().splitlines())
    finally:
        sock.close()
        if d.proc is not None and d.proc.returncode is None:
            await d.stop()


async def test_oob_attacks_against_a_real_daemon_are_refused_and_journaled(home: Path) -> None:
    import socket
    import struct
    import time as _time

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agentd.oob import OobClient, load_private_key, parse_response, sign_request

    d = await DaemonProcess(home).start()
    key, key_id = load_private_key(home / "operator.key")
    assert key_id == "ops-1"

    def ask(frame: bytes) -> tuple[bool, str]:
        with OobClient(d.socket, timeout=10) as c:
            r = parse_response(c.exchange(frame))
            return r.ok, (r.error_code or "")

    def code_of(frame: bytes) -> str:
        return ask(frame)[1]

    try:
        good = sign_request(key, key_id, "status")
        assert await asyncio.to_thread(ask, good) == (True, "")
        # The very same bytes again: a replay.
        assert await asyncio.to_thread(code_of, good) == "replay"
        # One byte of the command changed after signing.
        tampered = sign_request(key, key_id, "status").replace(b'name="status"', b'name="statuz"')
        assert await asyncio.to_thread(code_of, tampered) == "bad-signature"
        # A key the daemon does not know, under a known key-id, and an unknown key-id.
        other = Ed25519PrivateKey.generate()
        assert await asyncio.to_thread(code_of, sign_request(other, key_id, "status")) in (
            "bad-signature",
            "unknown-key",
        )
        assert (
            await asyncio.to_thread(code_of, sign_request(key, "nobody", "status")) == "unknown-key"
        )
        # Stale and future issued-at.
        stale = sign_request(key, key_id, "status", issued_at=_time.time() - 3600)
        future = sign_request(key, key_id, "status", issued_at=_time.time() + 3600)
        assert await asyncio.to_thread(code_of, stale) == "stale"
        assert await asyncio.to_thread(code_of, future) == "stale"
        # Garbage, and a length prefix over the cap: refused, and the daemon lives on.
        assert await asyncio.to_thread(code_of, b"<not-privileged/>") == "invalid"

        def huge() -> bytes:
            """A 64 MiB length prefix, and everything the daemon sends back until it
            closes the connection."""
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(10)
                raw.connect(str(d.socket))
                raw.sendall(struct.pack(">I", 64 * 1024 * 1024))
                received = b""
                while chunk := raw.recv(65536):
                    received += chunk
                return received

        reply = await asyncio.to_thread(huge)
        (size,) = struct.unpack(">I", reply[:4])
        assert len(reply) == 4 + size  # one frame, then the daemon closed
        refused = parse_response(reply[4:])
        assert (refused.ok, refused.error_code) == (False, "invalid")
        assert f"frame of {64 * 1024 * 1024} bytes exceeds" in refused.error_message
        assert await asyncio.to_thread(ask, sign_request(key, key_id, "status")) == (True, "")

        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--limit", "100")
        assert code == 0
        kinds_seen = {e["kind"] for e in doc["result"]["journal"]}
        assert {"replay", "bad-signature", "unknown-key", "stale", "invalid"} <= kinds_seen
        directions = {e["kind"]: e["direction"] for e in doc["result"]["journal"]}
        assert directions["replay"] == "security" and directions["oob-command"] == "audit"
    finally:
        await d.stop()


async def test_a_command_captured_before_a_restart_cannot_be_replayed_after_it(
    home: Path,
) -> None:
    from agentd.oob import OobClient, load_private_key, parse_response, sign_request

    key, key_id = load_private_key(home / "operator.key")
    captured = sign_request(key, key_id or "ops-1", "status")

    def send(socket: str) -> tuple[bool, str]:
        with OobClient(socket, timeout=10) as c:
            r = parse_response(c.exchange(captured))
            return r.ok, r.error_code or ""

    d = await DaemonProcess(home).start()
    assert await asyncio.to_thread(send, d.socket) == (True, "")
    assert await d.stop() == 0
    d2 = await DaemonProcess(home).start()
    try:
        assert await asyncio.to_thread(send, d2.socket) == (False, "replay")
    finally:
        await d2.stop()


async def test_bus_attacks_against_a_real_daemon(home: Path) -> None:
    """Authentication failures all look alike, a silent client times out, forged
    `from`, garbage and oversize frames: against the real process."""
    import pyotp
    from websockets.asyncio.client import connect

    from agentd.bus import client_context
    from agentd.client import AuthenticationFailed

    edit_config(home, lambda doc: doc["bus"].update(auth_timeout_s=1))
    d = await DaemonProcess(home).start()
    try:
        failures = []
        for client, secret in (("alice", pyotp.random_base32()), ("mallory", d.secret)):
            with pytest.raises(AuthenticationFailed) as info:
                async with BusClient(d.url, client, secret=secret, cafile=d.cafile):
                    pass
            failures.append((info.value.code, info.value.reason))
        used = pyotp.TOTP(d.secret).now()
        async with BusClient(d.url, "alice", totp=used, cafile=d.cafile) as bus:
            # Forged from, garbage, then an oversize frame (close 1009).
            forged = await bus.exchange(
                b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>bob'
                b"</from><thread>6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f</thread></meta>"
                b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><b>2</b>'
                b"</add></message>"
            )
            assert b"<code>invalid-envelope</code>" in forged[-1]
            await bus.send_raw(b"\x00\x01 not xml")
            assert b"<code>malformed</code>" in await bus.recv(timeout=10)
            await bus.send_raw(b"<a>" + b"x" * (300 * 1024) + b"</a>")
            with pytest.raises(ConnectionClosed):
                await bus.connection.recv()
            assert bus.connection.close_code == 1009
        # The code alice just used is refused now, like any wrong code.
        with pytest.raises(AuthenticationFailed) as info:
            async with BusClient(d.url, "alice", totp=used, cafile=d.cafile):
                pass
        failures.append((info.value.code, info.value.reason))
        assert failures == [(4401, "authentication failed")] * 3
        # A client that never authenticates is closed with 4408.
        async with connect(d.url, ssl=client_context(d.cafile, True)) as ws:
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            assert ws.close_code == 4408
    finally:
        await d.stop()
