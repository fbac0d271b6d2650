"""The client library (`Client` and the `BusClient` connection under it) and the
bus-side commands (`agentd init`, `totp`, `send`), against a real TLS bus on
127.0.0.1 (docs/user-guide.md, docs/commands.md). A real `agentd run` with an
approval gate is in test_client_daemon.py."""

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
from agentd._wiring import pump_options
from agentd.bus import BusServer, ClientAuth, TlsSetupError, client_context, server_context
from agentd.client import (
    Accepted,
    Answer,
    AuthenticationFailed,
    BusClient,
    BusError,
    Client,
    Huh,
    Other,
    frame_kind,
)
from agentd.config import load_config
from agentd.pump import Pump
from agentd.tools.calculator import Add, Sum
from tests.test_bus_support import GATE, Gate, Gated, Rig, gate_entered, start_rig, stop_rig

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


# ---- Client ----------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _gate():
    GATE.update(event=None, entered=0, watch=None, times=[])
    yield
    event = GATE["event"]
    if event is not None:
        event.set()


def _client(rig: Rig, urls: str | list[str] | None = None, **kw) -> Client:
    kw.setdefault("secret", rig.secrets["alice"])
    return Client.connect(urls or rig.url, "alice", cafile=rig.cafile, **kw)


async def test_call_returns_the_answer_as_its_xmlify_class(rig: Rig) -> None:
    async with _client(rig) as c:
        assert await c.call(Add(a=2, b=3)) == Sum(value=5)
        as_bytes = await c.call(ADD, to="calculator.add")
        events = [e async for e in c.stream(Add(a=1, b=1))]
    assert as_bytes == Sum(value=5)
    assert [type(e) for e in events] == [Accepted, Answer]
    assert events[-1].payload == Sum(value=2) and events[-1].sender == "calculator.add"
    assert events[-1].xml == b'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1">' \
        b"<value>2</value></sum>"


async def test_a_refusal_raises_huh_with_its_code_message_and_retry_flag(rig: Rig) -> None:
    async with _client(rig) as c:
        with pytest.raises(Huh) as bad:
            await c.call(ADD.replace(b">2<", b">x<"))
        with pytest.raises(Huh) as narrowed:  # `to` narrows to a listener that does not take it
            await c.call(Add(a=1, b=1), to="echo")
        assert await c.call(Add(a=1, b=1)) == Sum(value=2)  # the client goes on
    assert (bad.value.code, bad.value.retry_allowed) == ("invalid-payload", True)
    assert bad.value.message.startswith("The payload does not match its schema: <a>:")
    assert narrowed.value.code == "unroutable"


async def test_concurrent_calls_each_get_their_own_answer(rig: Rig) -> None:
    async with _client(rig) as c:
        sums = await asyncio.gather(*(c.call(Add(a=i, b=i)) for i in range(20)))
    assert sums == [Sum(value=2 * i) for i in range(20)]


async def test_frames_of_threads_it_did_not_start_go_to_on_other(tmp_path: Path) -> None:
    """An answer an earlier connection left in the outbox is not taken for this
    client's own answer: it goes to `on_other` (and `others`)."""
    rig = await start_rig(tmp_path, kernel=True)
    try:
        GATE["event"] = asyncio.Event()
        earlier = await rig.login("alice")
        left = await earlier.send(Gate(n=7))
        await gate_entered(1)
        await earlier.close()
        GATE["event"].set()
        seen: list[Other] = []
        replayed = asyncio.Event()

        def other(event: Other) -> None:
            seen.append(event)
            if event.tag.endswith("}gated"):
                replayed.set()

        async with _client(rig, session=earlier.session, secret=None, on_other=other) as c:
            assert await c.call(Add(a=1, b=2)) == Sum(value=3)
            await asyncio.wait_for(replayed.wait(), 30)  # the replay runs beside the call
        gated = [o for o in seen if o.tag.endswith("}gated")]
        assert [o.thread for o in gated] == [left] and list(c.others) == seen
    finally:
        await stop_rig(rig)


class Cutter:
    """A TCP relay on 127.0.0.1 whose connections the test can cut (TLS passes
    through it end to end): a dropped network, as the client sees it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None
        # While set, what the bus writes is read off its socket and never reaches
        # the client (a link going down under frames in flight); `lost` is set then.
        self.swallow = False
        self.lost = asyncio.Event()

    async def start(self) -> str:
        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                       from_bus: bool) -> None:
            try:
                while data := await r.read(65536):
                    if from_bus and self.swallow:
                        self.lost.set()
                        continue
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
            self.writers += [w, uw]
            await asyncio.gather(pipe(r, uw, False), pipe(ur, w, True))

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"wss://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/bus"

    def cut(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def test_a_dropped_connection_is_resumed_and_the_answer_still_arrives(
    tmp_path: Path,
) -> None:
    rig = await start_rig(tmp_path, kernel=True)
    cutter = Cutter(rig.bus.port)
    try:
        url = await cutter.start()
        GATE["event"] = asyncio.Event()
        async with _client(rig, url) as c:
            call = asyncio.create_task(c.call(Gate(n=5), timeout=30))
            await gate_entered(1)
            token = c.session
            gone = asyncio.Event()
            rig.bus.on_session_closed = lambda _session: gone.set()
            cutter.cut()
            await asyncio.wait_for(gone.wait(), 30)
            GATE["event"].set()  # answered while the client is away: kept in the outbox
            assert await call == Gated(n=5)
            assert c.session == token  # resumed with its session, no new TOTP code
            assert await c.call(Add(a=2, b=2)) == Sum(value=4)
    finally:
        cutter.close()
        await stop_rig(rig)


async def test_a_frame_written_to_a_socket_that_dies_is_resent_after_resume(
    tmp_path: Path,
) -> None:
    """The answer is written to the client's socket, the link goes down before a
    byte of it arrives: it stays in the outbox until acknowledged, the resumed
    session gets it, and the client's acknowledgement then removes it."""
    rig = await start_rig(tmp_path, kernel=True)
    kernel = rig.kernel
    assert kernel is not None
    cutter = Cutter(rig.bus.port)
    try:
        url = await cutter.start()
        GATE["event"] = asyncio.Event()
        async with _client(rig, url) as c:
            exchange = await c.start(Gate(n=7), timeout=30)
            events = exchange.events()
            assert isinstance(await anext(events), Accepted)
            await gate_entered(1)
            cutter.swallow = True
            GATE["event"].set()
            await asyncio.wait_for(cutter.lost.wait(), 30)  # the answer left the bus
            await rig.pump.join()
            await kernel.flush()
            kept = await kernel.outbox("alice")
            assert [frame_kind(f)[1] for _, _, f in kept] == ["gated"]
            cutter.swallow = False
            cutter.cut()
            answer = await anext(events)
            assert isinstance(answer, Answer) and answer.payload == Gated(n=7)
            assert await c.call(Add(a=2, b=2)) == Sum(value=4)
        async with asyncio.timeout(30):  # acknowledged: removed from the outbox
            while await kernel.outbox("alice"):
                await kernel.flush()
                await asyncio.sleep(0.01)
    finally:
        cutter.close()
        await stop_rig(rig)


async def test_urls_are_tried_in_order_until_one_answers(rig: Rig) -> None:
    dead = f"wss://127.0.0.1:{_free_port()}/bus"
    async with _client(rig, [dead, rig.url]) as c:
        assert c.url == rig.url and await c.call(Add(a=1, b=1)) == Sum(value=2)
    with pytest.raises(BusError, match="cannot connect to any of 2 URLs") as info:
        await _client(rig, [dead, f"wss://127.0.0.1:{_free_port()}/bus"]).open()
    assert dead in str(info.value)
    with pytest.raises(ValueError, match="TLS only"):
        _client(rig, [rig.url, "ws://127.0.0.1:1/bus"])


async def test_a_session_file_spares_a_second_process_the_used_code(
    rig: Rig, tmp_path: Path
) -> None:
    """Two logins within one 30 s step: the second reuses the code and is refused,
    unless both keep the session token in one file."""
    session = tmp_path / "alice.session"
    async with _client(rig, session_file=session) as first:
        assert session.read_text().split() == [rig.url, first.session]
        assert stat.S_IMODE(session.stat().st_mode) == 0o600
    async with _client(rig, session_file=session) as second:  # same step: the token
        assert second.session == first.session
    with pytest.raises(AuthenticationFailed):  # without it: a reused code
        await _client(rig).open()
    session.write_text("wss://elsewhere.example:8765/bus\nstolen\n")
    with pytest.raises(ValueError, match="TOTP secret"):  # never sent to another bus
        Client.connect(rig.url, "alice", session_file=session)


async def test_an_untrusted_certificate_is_a_certificate_error(rig: Rig) -> None:
    with pytest.raises(BusError, match="self-signed certificate") as info:
        await Client.connect(rig.url, "alice", secret=rig.secrets["alice"]).open()
    assert info.value.certificate


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
        lambda c, t, d, o=None: holder["bus"].deliver(c, t, d, o), pump_options(config),
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


# ---- agentd send: what to do next -------------------------------------------------------------


def _secret_file(rig: Rig, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "alice.totp"
    path.write_text(rig.secrets["alice"] + "\n")
    path.chmod(0o600)
    return path


async def test_send_says_what_to_check_when_its_login_is_refused(rig: Rig, tmp_path: Path) -> None:
    """Every cause reads `authentication failed (close code 4401)`; the user is told
    what to check (the daemon's log says which it was)."""
    secret = _secret_file(rig, tmp_path / "wrong")
    secret.write_text(pyotp.random_base32())
    code, _out, err = await _agentd("--url", rig.url, "--secret-file", str(secret),
                                   "--cafile", str(rig.cafile), "-", stdin=ADD)
    assert code == 4 and "authentication failed (close code 4401" in err
    for what in ("clock", "--secret-file holds alice's secret", "--session-file",
                 "lock the client out", "daemon's log"):
        assert what in err, (what, err)


async def test_send_names_cafile_when_the_certificate_is_not_trusted(
    rig: Rig, tmp_path: Path
) -> None:
    secret = _secret_file(rig, tmp_path / "elsewhere")  # no tls/cert.pem beside it
    code, _out, err = await _agentd("--url", rig.url, "--secret-file", str(secret), "-",
                                   stdin=ADD)
    assert code == 3 and "self-signed certificate" in err
    assert "--cafile" in err and "tls/cert.pem" in err


async def test_send_tells_what_its_own_payload_got_wrong(rig: Rig) -> None:
    """A wrong root tag is `unroutable` and nothing more: send suggests where a valid
    payload comes from. A payload without xmlns and one that fails its schema say so."""
    secret = _secret_file(rig, rig.home)
    common = ["--url", rig.url, "--secret-file", str(secret)]
    wrong_tag = b'<count-words xmlns="https://xml-pipeline.org/ns/echo/v1"><text>a</text>' \
        b"</count-words>"
    code, out, err = await _agentd(*common, "-", stdin=wrong_tag)
    assert code == 1 and "<code>unroutable</code>" in out
    assert "agentctl introspect example" in err and "request-example" in err
    code, out, err = await _agentd(*common, "-", stdin=b"<add><a>1</a><b>2</b></add>")
    assert code == 1 and "its payload &lt;add&gt; has no namespace of its own" in out
    code, out, err = await _agentd(*common, "-", stdin=ADD.replace(b">2<", b">two<"))
    assert code == 1 and "<a>: 'two' is not a valid value" in out.replace("&lt;", "<").replace(
        "&gt;", ">")
    assert "introspect" not in err  # the hint is for unroutable only


async def test_send_to_addresses_one_listener(rig: Rig) -> None:
    secret = _secret_file(rig, rig.home)
    common = ["--url", rig.url, "--secret-file", str(secret)]
    code, out, err = await _agentd(*common, "--to", "calculator.add", "-", stdin=ADD)
    assert code == 0 and "<- sum from calculator.add" in out, err
    code, out, err = await _agentd(*common, "--to", "echo", "-", stdin=ADD)
    assert code == 1 and "<code>unroutable</code>" in out  # `to` narrows, never widens


async def test_send_tries_every_url_in_order(rig: Rig) -> None:
    """Only the last --url was used, silently."""
    secret = _secret_file(rig, rig.home)
    dead = f"wss://127.0.0.1:{_free_port()}/bus"
    for urls in ([dead, rig.url], [rig.url, dead]):
        args = [a for url in urls for a in ("--url", url)]
        code, out, err = await _agentd(*args, "--secret-file", str(secret), "--json", "-",
                                       stdin=ADD)
        assert code == 0, err
        assert json.loads(out)["url"] == rig.url
    code, out, err = await _agentd("--url", dead, "--url", dead.replace("/bus", "/x"),
                                   "--secret-file", str(secret), "-", stdin=ADD)
    assert code == 3 and "cannot connect to any of 2 URLs" in err
