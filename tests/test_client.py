"""The importable BusClient and the bus-side commands (`agentd init`, `totp`, `send`),
against a real TLS bus on 127.0.0.1 (docs/commands.md)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pyotp
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agentd._cli_bus import init_cmd, totp_cmd
from agentd._routing import Routing
from agentd.bus import BusServer, ClientAuth, TlsSetupError, client_context, server_context
from agentd.client import AuthenticationFailed, BusClient, BusError, frame_kind
from agentd.config import load_config
from agentd.pump import Pump
from agentd.tools.calculator import Add
from tests.test_bus_support import Rig, start_rig, stop_rig

ROOT = Path(__file__).resolve().parent.parent
ADD = b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>2</a><b>3</b></add>'


@pytest.fixture
async def rig(tmp_path: Path):
    r = await start_rig(tmp_path)
    yield r
    await stop_rig(r)


# ---- BusClient ------------------------------------------------------------------------


async def test_client_sends_objects_payload_bytes_and_envelopes(rig: Rig) -> None:
    async with rig.client("alice") as c:
        assert c.session
        by_object = await c.exchange(Add(a=1, b=2), timeout=30)
        by_payload = await c.exchange(ADD, timeout=30)
        thread = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"
        envelope = (
            '<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta>'
            f"<from>alice</from><thread>{thread}</thread></meta>"
            '<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>5</a><b>5</b></add>'
            "</message>"
        )
        by_envelope = await c.exchange(envelope, timeout=30)
    assert [frame_kind(f[-1])[1] for f in (by_object, by_payload, by_envelope)] == ["sum"] * 3
    assert frame_kind(by_envelope[-1])[2] == thread


async def test_client_iterates_frames_and_keeps_other_threads_for_recv(rig: Rig) -> None:
    async with rig.client("alice") as c:
        t1 = await c.send(Add(a=1, b=1))
        frames = await c.exchange(Add(a=2, b=2), timeout=30)
        assert frame_kind(frames[-1])[1] == "sum"
        seen = []
        async for frame in c:
            seen.append(frame_kind(frame))
            if len(seen) == 2:
                break
    assert [(s[1], s[2]) for s in seen] == [("accepted", t1), ("sum", t1)]


async def test_client_reports_refused_authentication(rig: Rig) -> None:
    with pytest.raises(AuthenticationFailed) as info:
        await rig.client("alice", totp="000000" if rig.code("alice") != "000000" else "1").connect()
    assert info.value.code == 4401


async def test_client_reports_connect_failures(rig: Rig) -> None:
    c = BusClient(f"wss://127.0.0.1:{rig.bus.port}/nope", "alice", totp="123456",
                  cafile=rig.cafile)
    with pytest.raises(BusError, match="404"):
        await c.connect()
    c = BusClient(f"wss://127.0.0.1:{rig.bus.port}/bus", "alice", totp="123456")  # untrusted
    with pytest.raises(BusError, match="cannot connect"):
        await c.connect()


async def test_client_refuses_non_xml_payloads(rig: Rig) -> None:
    async with rig.client("alice") as c:
        with pytest.raises(ValueError):
            await c.send(b"not xml")
        with pytest.raises(TypeError):
            await c.send(object())


# ---- agentd init --------------------------------------------------------------------------


def test_init_writes_a_working_setup_with_private_modes(tmp_path: Path) -> None:
    home = tmp_path / "agentd-home"
    result = CliRunner().invoke(init_cmd, ["--dir", str(home)])
    assert result.exit_code == 0, result.output
    assert "otpauth://totp/agentd:alice?secret=" in result.output
    assert f"agentd run --config {home / 'organism.yaml'}" in result.output
    modes = {
        "organism.yaml": 0o644, "clients.yaml": 0o600, "alice.totp": 0o600,
        "tls/cert.pem": 0o644, "tls/key.pem": 0o600, "operator.key": 0o600,
        "authorized_keys": 0o644,
    }
    for name, mode in modes.items():
        assert stat.S_IMODE((home / name).stat().st_mode) == mode, name
    assert stat.S_IMODE((home / "state").stat().st_mode) == 0o700

    config = load_config(home / "organism.yaml")
    assert (config.bus.host, config.bus.port) == ("127.0.0.1", 8765)
    assert config.bus.tls is not None and config.bus.tls.cert == home / "tls" / "cert.pem"
    assert config.metrics.listen == "127.0.0.1:9464"
    assert config.auth.clients_file == home / "clients.yaml"
    assert {lst.name for lst in config.listeners} >= {"calculator.add", "echo", "relay"}
    auth = ClientAuth.load(home / "clients.yaml", config.state_dir, config.auth)
    assert auth.profiles() == {"alice": "public"}
    server_context(config.bus.tls)  # the pair loads

    line = (home / "authorized_keys").read_text().strip().split()
    assert line[0] == "ssh-ed25519" and line[2] == "ops-1"
    key = serialization.load_ssh_private_key((home / "operator.key").read_bytes(), None)
    assert isinstance(key, Ed25519PrivateKey)
    assert key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode().split()[1] == line[1]
    assert (home / "operator.key").read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY")


def test_init_under_a_permissive_umask_leaves_nothing_others_may_write(tmp_path: Path) -> None:
    """Under umask 000 the folders came out 0777: another user could replace
    organism.yaml (and the daemon would run what it names)."""
    home = tmp_path / "agentd-home"
    old = os.umask(0)
    try:
        assert CliRunner().invoke(init_cmd, ["--dir", str(home)]).exit_code == 0
    finally:
        os.umask(old)
    for path in [home, *home.rglob("*")]:
        assert not stat.S_IMODE(path.stat().st_mode) & 0o022, path
    assert load_config(home / "organism.yaml").name  # and it loads


def test_next_steps_name_the_files_init_wrote_by_absolute_path(tmp_path: Path) -> None:
    from agentd._cli_bus import executable, init_home, next_steps

    home = tmp_path / "agentd-home"
    init_home(home)
    env, status, send, read = next_steps(home)
    assert env == (f"export AGENTCTL_SOCKET={home / 'state' / 'oob.sock'} "
                   f"AGENTCTL_KEY={home / 'operator.key'}")
    assert status == f"{executable('agentctl')} status"
    assert Path(executable("agentd")).is_absolute()
    assert f"{executable('agentd')} send --url wss://127.0.0.1:8765/bus --client alice " in send
    assert f"--secret-file {home / 'alice.totp'}" in send
    assert f"--cafile {home / 'tls' / 'cert.pem'}" in send
    assert send.startswith("echo '<mathquestion ")
    assert read.startswith("echo '<read-file ") and read.endswith(send.split(" | ")[1])


def test_next_steps_of_a_home_on_port_0_say_where_the_port_comes_from(tmp_path: Path) -> None:
    """`init --port 0` printed a URL with port 0, which no client can reach: the
    daemon takes a free port at each start and logs it."""
    from agentd._cli_bus import init_home, next_steps

    home = tmp_path / "agentd-home"
    init_home(home, port=0)
    _, _, send, read, note = next_steps(home)
    assert "--url wss://127.0.0.1:PORT/bus " in send and ":PORT/bus " in read
    assert note.startswith("# PORT: the port the daemon logs at start")


def test_init_home_is_self_contained_and_movable(tmp_path: Path) -> None:
    from agentd._cli_bus import init_home

    home = tmp_path / "agentd-home"
    init_home(home)
    text = (home / "organism.yaml").read_text()
    assert str(tmp_path) not in text and "file:/" not in text
    moved = tmp_path / "elsewhere" / "etc-agentd"
    moved.parent.mkdir()
    home.rename(moved)
    config = load_config(moved / "organism.yaml")
    assert config.state_dir == moved / "state"
    assert config.llm.backends[0].cassette == moved / "cassettes" / "agent-demo.jsonl"
    assert "tutor" in {lst.name for lst in config.listeners}


def test_init_refuses_a_metrics_port_equal_to_the_bus_port(tmp_path: Path) -> None:
    result = CliRunner().invoke(init_cmd, ["--dir", str(tmp_path / "h"), "--port", "9000",
                                           "--metrics-port", "9000"])
    assert result.exit_code == 1 and "cannot share port 9000" in result.output
    assert not (tmp_path / "h" / "clients.yaml").exists()


def test_init_writes_the_metrics_port_it_was_given(tmp_path: Path) -> None:
    home = tmp_path / "h"
    result = CliRunner().invoke(init_cmd, ["--dir", str(home), "--port", "9765",
                                           "--metrics-port", "9565"])
    assert result.exit_code == 0, result.output
    config = load_config(home / "organism.yaml")
    assert (config.bus.port, config.metrics.listen) == (9765, "127.0.0.1:9565")
    assert "Ports: bus 127.0.0.1:9765 (wss), metrics 127.0.0.1:9565 (http)." in result.output


def test_init_refuses_to_overwrite(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert CliRunner().invoke(init_cmd, ["--dir", str(home)]).exit_code == 0
    before = (home / "clients.yaml").read_bytes()
    result = CliRunner().invoke(init_cmd, ["--dir", str(home)])
    assert result.exit_code == 1 and "never overwrites" in result.output
    assert (home / "clients.yaml").read_bytes() == before


# ---- agentd totp ----------------------------------------------------------------------------


def test_totp_prints_the_current_code(tmp_path: Path) -> None:
    secret = pyotp.random_base32()
    path = tmp_path / "bob.totp"
    path.write_text(secret + "\n")
    result = CliRunner().invoke(totp_cmd, ["--client", "bob", "--secret-file", str(path)])
    assert result.exit_code == 0
    totp = pyotp.TOTP(secret)
    assert result.output.strip() in {totp.now(), totp.at(totp.timecode(_now()) * 30 - 30)}


def test_totp_reads_a_clients_file_and_rejects_unknown_clients(tmp_path: Path) -> None:
    home = tmp_path / "h"
    CliRunner().invoke(init_cmd, ["--dir", str(home)])
    ok = CliRunner().invoke(
        totp_cmd, ["--client", "alice", "--clients-file", str(home / "clients.yaml")]
    )
    assert ok.exit_code == 0 and len(ok.output.strip()) == 6
    bad = CliRunner().invoke(
        totp_cmd, ["--client", "zed", "--clients-file", str(home / "clients.yaml")]
    )
    assert bad.exit_code == 1 and "not in" in bad.output


def _now():
    import datetime as dt

    return dt.datetime.now()


def test_a_session_file_is_a_cache_for_one_url_or_a_bare_token(tmp_path: Path) -> None:
    from agentd._cli_bus import read_session_file

    cache = tmp_path / "alice.session"
    cache.write_text("wss://127.0.0.1:8765/bus\ntok-1\n")  # what agentd send writes
    assert read_session_file(cache) == ("wss://127.0.0.1:8765/bus", "tok-1")
    cache.write_text("tok-2\n")  # written by hand (agentd mcp-serve --session-file)
    assert read_session_file(cache) == (None, "tok-2")
    assert read_session_file(tmp_path / "absent") == (None, None)


def test_a_plain_ws_url_is_refused_before_any_credential_leaves() -> None:
    with pytest.raises(ValueError, match="TLS only"):
        BusClient("ws://127.0.0.1:8765/bus", "alice", session="token")


# ---- agentd send, end to end -----------------------------------------------------------------


async def _agentd(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "from agentd._cli_bus import send_cmd; send_cmd()", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_init_then_serve_then_send(tmp_path: Path) -> None:
    """`agentd init`, the bus built from the organism.yaml it wrote, then `agentd send`
    with the files it wrote (the bus port is 0 here instead of 8765)."""
    home = tmp_path / "agentd-home"
    assert CliRunner().invoke(init_cmd, ["--dir", str(home)]).exit_code == 0
    config = load_config(home / "organism.yaml")
    assert config.auth.clients_file is not None
    auth = ClientAuth.load(config.auth.clients_file, config.state_dir, config.auth)
    holder: dict[str, BusServer] = {}
    from agentd.platform import make_agent_handlers

    agents = make_agent_handlers(config)  # the init'd demo has the tutor agent
    pump = Pump(
        Routing.build(config, agent_handlers=agents), auth.profiles(),
        lambda c, t, d, o=None: holder["bus"].deliver(c, t, d, o), config.pump,
    )
    await pump.start()
    bus = holder["bus"] = BusServer(replace(config.bus, port=0), auth, pump.submit,
                                         submit_nowait=pump.submit_nowait)
    await bus.start()
    url = f"wss://127.0.0.1:{bus.port}/bus"
    common = ["--url", url, "--client", "alice", "--secret-file", str(home / "alice.totp"),
              "--cafile", str(home / "tls" / "cert.pem"), "--timeout", "10"]
    try:
        payload = tmp_path / "payload.xml"
        payload.write_bytes(b'<?xml version="1.0"?>\n' + ADD)
        code, out, err = await _agentd(*common, str(payload))
        assert code == 0, err
        assert "accepted from core" in out and "sum from calculator.add" in out
        assert "<value>5</value>" in out
        assert (home / "alice.session").exists()  # the session token is cached, 0600
        assert stat.S_IMODE((home / "alice.session").stat().st_mode) == 0o600
        # ... for this bus only: a token is never sent to another URL.
        assert (home / "alice.session").read_text().split("\n")[0] == url

        # A plain ws:// URL: refused before a byte leaves (the first frame is a credential).
        heard: list[bytes] = []

        async def listen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            heard.append(await reader.read(65536))
            writer.close()

        plain = await asyncio.start_server(listen, "127.0.0.1", 0)
        port = plain.sockets[0].getsockname()[1]
        code, out, err = await _agentd(*common[:0], "--url", f"ws://127.0.0.1:{port}/bus",
                                       *common[2:], str(payload))
        plain.close()
        assert code == 3 and "TLS only" in err and heard == []

        # Again within the same 30 s step: the cached session logs in (no code reuse).
        two = ADD + b'<echo xmlns="https://xml-pipeline.org/ns/echo/v1"><text>hi</text></echo>'
        code, out, err = await _agentd(*common, "--json", "-", stdin=two)
        assert code == 0, err
        report = json.loads(out)
        assert report["complete"] and len(report["sent"]) == 2
        assert {f["kind"] for f in report["frames"]} == {"accepted", "sum", "echoreply"}

        # A rejected envelope: the huh is printed and the exit code is 1.
        forged = (
            b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>bob</from>'
            b"<thread>6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f</thread></meta>" + ADD + b"</message>"
        )
        code, out, err = await _agentd(*common, "-", stdin=forged)
        assert code == 1 and "huh from core" in out and "invalid-envelope" in out

        code, out, err = await _agentd(*common, "-", stdin=b"not xml at all")
        assert code == 2 and "no XML element" in err

        # Wrong secret and no session: refused, exit 4.
        bad = tmp_path / "bad.totp"
        bad.write_text(pyotp.random_base32())
        code, out, err = await _agentd(
            "--url", url, "--client", "alice", "--secret-file", str(bad),
            "--cafile", str(home / "tls" / "cert.pem"), str(payload),
        )
        assert code == 4 and "authentication failed" in err

        code, out, err = await _agentd(
            *common[:1], f"wss://127.0.0.1:{_free_port()}/bus", *common[2:], str(payload)
        )
        assert code == 3 and "cannot connect" in err
    finally:
        await bus.close()
        await pump.stop()
        await agents.platform.aclose()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ordinary_mistakes_get_one_line_not_a_traceback(tmp_path: Path) -> None:
    """A state_dir that is a file or cannot be made, an unknown log level, a
    mistyped CA file: each is one line and a non-zero exit (each was a traceback)."""
    from agentd.cli import main

    home = tmp_path / "home"
    assert CliRunner().invoke(init_cmd, ["--dir", str(home)]).exit_code == 0
    config = home / "organism.yaml"
    (tmp_path / "a-file").write_text("")
    text = config.read_text()
    config.write_text(text.replace("state_dir: state", "state_dir: ../a-file"))
    runner = CliRunner()
    for args, words in [
        (["run", "--config", str(config)], "File exists"),
        (["run", "--config", str(config), "--state-dir", "/proc/nope/x"], "/proc/nope"),
        (["run", "--config", str(config), "--log-level", "verbose"], "--log-level"),
    ]:
        result = runner.invoke(main, args)
        assert result.exit_code != 0 and words in result.output, (args, result.output)
        assert not isinstance(result.exception, OSError | ValueError), result.exception
    with pytest.raises(TlsSetupError, match=r"CA file /nope/ca\.pem"):
        client_context("/nope/ca.pem")


def test_send_refuses_a_thread_that_is_not_a_uuid(tmp_path: Path) -> None:
    """It sent the envelope anyway and the daemon answered `invalid-envelope`; an
    unusable option is exit 2, before anything is sent."""
    from agentd._cli_bus import send_cmd

    result = CliRunner().invoke(send_cmd, ["--secret-file", str(tmp_path / "s"),
                                           "--thread", "notauuid", "-"], input="<x/>")
    assert result.exit_code == 2 and "'notauuid' is not a valid UUID" in result.output
