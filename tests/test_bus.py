"""The main bus over real TLS WebSockets on 127.0.0.1: first-
frame TOTP authentication, sessions, lockout, transport limits, backpressure, rate
limits, routing of answers and the outbox. The server side is the real BusServer,
ClientAuth and Pump (on a real Kernel for the outbox); only the clock of ClientAuth
is moved by the tests. The session's decisions alone are in test_bus_session.py."""

from __future__ import annotations

import asyncio
import base64
import ssl
import uuid
from pathlib import Path

import pyotp
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

from agentd import _metrics
from agentd._delivery import ack_frame, resume_frame, seq_of
from agentd._envelope import build_envelope, parse_envelope
from agentd._schemas import NS_DELIVERY
from agentd._streams import StreamHub
from agentd._xmlify import spec_of
from agentd.bus import (
    AuthFileError,
    BusSession,
    ClientAuth,
    auth_frame,
    current_totp,
    parse_auth_ok,
    totp_code,
)
from agentd.bus._auth import DUMMY_TOTP_SECRET
from agentd.client import AuthenticationFailed, BusError, frame_kind
from agentd.kernel import Kernel
from agentd.tools.calculator import Add
from agentd.tools.echo import Echo
from agentd.tools.relay import Relay
from tests.test_bus_support import GATE, Gate, Rig, gate_entered, start_rig, stop_rig


@pytest.fixture
async def rig(tmp_path: Path):
    r = await start_rig(tmp_path, auth={"lockout_s": 5.0})
    yield r
    await stop_rig(r)


@pytest.fixture
async def outbox_rig(tmp_path: Path):
    """A rig with a kernel: the delivery tests' outbox is durable."""
    r = await start_rig(tmp_path, kernel=True)
    yield r
    await stop_rig(r)


@pytest.fixture(autouse=True)
def _gate():
    GATE.update(event=None, entered=0, watch=None, times=[])
    yield
    event = GATE["event"]
    if event is not None:
        event.set()


def kinds(frames: list[bytes]) -> list[tuple[str, str]]:
    return [frame_kind(f)[:2] for f in frames]


def value(frame: bytes, name: str) -> str:
    for child in parse_envelope(frame).payload:
        if child.tag.split("}")[1] == name:
            return child.text or ""
    raise KeyError(name)


async def refused(rig: Rig, client: str, **kw) -> AuthenticationFailed:
    with pytest.raises(AuthenticationFailed) as info:
        await rig.client(client, **kw).connect()
    return info.value


# ---- authentication ------------------------------------------------------------------


async def test_totp_login_gets_auth_ok_with_a_session_token(rig: Rig) -> None:
    async with rig.client("alice") as c:
        assert c.session is not None and len(c.session) >= 22  # >= 128 bits, url-safe
        frames = await c.exchange(Add(a=2, b=3), timeout=30)
    assert kinds(frames) == [("core", "accepted"), ("calculator.add", "sum")]
    assert value(frames[1], "value") == "5"


async def test_auth_ok_frame_names_client_and_session(rig: Rig) -> None:
    async with connect(rig.url, ssl=_trusting(rig)) as ws:
        await ws.send(auth_frame("alice", totp=rig.code("alice")))
        ok = parse_auth_ok(await ws.recv(decode=False))
    assert ok is not None and ok[0] == "alice"


async def test_wrong_code_is_refused_with_4401(rig: Rig) -> None:
    good = rig.code("alice")
    wrong = f"{(int(good) + 1) % 1_000_000:06d}"
    err = await refused(rig, "alice", totp=wrong)
    assert (err.code, err.reason) == (4401, "authentication failed")


async def test_reused_code_is_refused_with_4401(rig: Rig) -> None:
    code = rig.code("alice")
    async with rig.client("alice", totp=code):
        pass
    err = await refused(rig, "alice", totp=code)
    assert (err.code, err.reason) == (4401, "authentication failed")


async def test_code_of_an_earlier_step_is_refused_after_a_later_one(rig: Rig) -> None:
    async with rig.client("alice", totp=rig.code("alice", +1)):
        pass
    err = await refused(rig, "alice", totp=rig.code("alice", 0))
    assert err.code == 4401


async def test_adjacent_steps_are_accepted(rig: Rig) -> None:
    async with rig.client("alice", totp=rig.code("alice", -1)):
        pass
    async with rig.client("alice", totp=rig.code("alice", +1)):
        pass
    err = await refused(rig, "alice", totp=rig.code("alice", +2))
    assert err.code == 4401


async def test_unknown_client_gets_the_same_close_as_a_wrong_code(rig: Rig) -> None:
    unknown = await refused(rig, "mallory", totp="123456")
    wrong = await refused(rig, "bob", totp="000000" if rig.code("bob") != "000000" else "111111")
    assert (unknown.code, unknown.reason) == (wrong.code, wrong.reason) == (
        4401, "authentication failed",
    )


async def test_the_log_says_which_cause_refused_a_login(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads one `authentication failed` for every cause; the daemon's log
    tells a wrong code, a reused code, an unknown session and a lockout apart (a
    wrong and a reused code were both `wrong-or-reused-code`)."""
    caplog.set_level("INFO", logger="agentd.auth")
    code = rig.code("alice")
    async with rig.client("alice", totp=code):
        pass
    await refused(rig, "alice", totp=code)
    await refused(rig, "alice", totp=f"{(int(code) + 1) % 1_000_000:06d}")
    await refused(rig, "alice", session="x" * 43)
    await refused(rig, "alice", totp="000000" if code != "000000" else "111111")
    await refused(rig, "alice", totp="000000" if code != "000000" else "111111")
    await refused(rig, "alice", totp=rig.code("alice", +1))  # locked out by now
    reasons = [r.getMessage().rsplit("reason=", 1)[1] for r in caplog.records
               if "auth failed" in r.getMessage()]
    assert reasons == ["reused-code", "wrong-code", "unknown-session", "wrong-code",
                       "wrong-code", "locked-out"]


@pytest.mark.parametrize("first", [
    b"hello",
    b"<auth/>",
    b'<!DOCTYPE x [<!ENTITY a "b">]><auth xmlns="https://xml-pipeline.org/ns/auth/v1"/>',
    b'<auth xmlns="https://xml-pipeline.org/ns/auth/v1"><client>alice</client>'
    b"<totp>12345</totp></auth>",
])
async def test_garbage_first_frame_is_refused_with_4401(rig: Rig, first: bytes) -> None:
    async with connect(rig.url, ssl=_trusting(rig)) as ws:
        await ws.send(first)
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (4401, "authentication failed")


def sample(name: str) -> float:
    """A metric's value as a scrape shows it (0 before its first sample)."""
    return _metrics.REGISTRY.get_sample_value(name) or 0.0


async def test_lockout_after_five_failures_and_its_expiry(rig: Rig) -> None:
    locked: list[str] = []
    rig.auth.on_lockout = locked.append
    failures_before = sample("agentd_auth_failures_total")
    for _ in range(5):
        await refused(rig, "alice", totp="000000" if rig.code("alice") != "000000" else "111111")
    assert locked == ["alice"]
    assert sample("agentd_auth_failures_total") - failures_before == 5
    err = await refused(rig, "alice", totp=rig.code("alice"))  # correct, but locked
    assert (err.code, err.reason) == (4401, "authentication failed")
    async with rig.client("bob"):  # other clients are not affected
        pass
    rig.clock.advance(5.1)  # lockout_s = 5 in this rig
    rig.next_step()
    async with rig.client("alice"):
        pass


async def test_failures_spread_beyond_the_window_do_not_lock(rig: Rig) -> None:
    for _ in range(8):
        await refused(rig, "alice", session="x" * 43)
        rig.clock.advance(15)  # 4 failures per 60 s window at most
    async with rig.client("alice"):
        pass


async def test_auth_timeout_closes_with_4408(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"auth_timeout_s": 0.3})
    try:
        async with connect(r.url, ssl=_trusting(r)) as ws:
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
        assert info.value.rcvd.code == 4408
    finally:
        await stop_rig(r)


async def test_session_token_reconnects_without_a_code(rig: Rig) -> None:
    first = await rig.login("alice")
    token = first.session
    await first.close()
    async with rig.client("alice", session=token) as again:
        assert again.session == token
        frames = await again.exchange(Add(a=1, b=1), timeout=30)
    assert value(frames[-1], "value") == "2"


async def test_session_of_one_client_does_not_open_another(rig: Rig) -> None:
    alice = await rig.login("alice")
    await alice.close()
    err = await refused(rig, "bob", session=alice.session)
    assert err.code == 4401


async def test_sessions_expire_after_their_ttl(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, auth={"session_ttl_s": 60.0})
    try:
        c = await r.login("alice")
        await c.close()
        r.clock.advance(61)
        err = await refused(r, "alice", session=c.session)
        assert err.code == 4401
    finally:
        await stop_rig(r)


async def test_lockout_revokes_every_session(rig: Rig) -> None:
    tokens = []
    for _ in range(2):
        c = await rig.login("alice")
        tokens.append(c.session)
        await c.close()
    for _ in range(5):
        await refused(rig, "alice", totp="000000" if rig.code("alice") != "000000" else "111111")
    rig.clock.advance(6)  # the lockout is over, the sessions stay revoked
    for token in tokens:
        err = await refused(rig, "alice", session=token)
        assert err.code == 4401


async def test_sessions_and_used_steps_survive_reloading_from_disk(rig: Rig) -> None:
    code = rig.code("alice")
    c = await rig.login("alice", totp=code)
    await c.close()
    state = rig.home / "state" / "auth-state.json"
    assert state.stat().st_mode & 0o777 == 0o600
    assert c.session is not None and c.session not in state.read_text()  # only hashes
    reloaded = ClientAuth.load(rig.home / "clients.yaml", rig.home / "state", rig.auth_cfg,
                               clock=rig.clock)
    assert reloaded.authenticate(auth_frame("alice", session=c.session)) == ("alice", c.session)
    rig.clock.advance(-30)  # back at the step of `code`: used before the "restart"
    assert reloaded.authenticate(auth_frame("alice", totp=code)) is None


def test_clients_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "clients.yaml"
    path.write_text("clients:\n  alice: {totp_secret: JBSWY3DPEHPK3PXP, profile: public}\n")
    path.chmod(0o644)
    with pytest.raises(AuthFileError, match="chmod 600"):
        ClientAuth.load(path, tmp_path, rig_auth_cfg(path))
    path.chmod(0o600)
    assert ClientAuth.load(path, tmp_path, rig_auth_cfg(path)).profiles() == {"alice": "public"}


@pytest.mark.parametrize("body, message", [
    ("alice: {}\n", "top-level key `clients`"),
    ("clients:\n  alice: {totp_secret: 'not base32!', profile: public}\n", "base32"),
    ("clients:\n  alice: {totp_secret: JBSWY3DP, profile: public}\n", "80 bits"),
    ("clients:\n  alice: {totp_secret: JBSWY3DPEHPK3PXP}\n", "profile: required"),
    ("clients:\n  'bad id': {totp_secret: JBSWY3DPEHPK3PXP, profile: p}\n", "client id"),
    ("clients:\n  alice: {totp_secret: JBSWY3DPEHPK3PXP, profile: p, x: 1}\n", "unknown key"),
])
def test_clients_file_shape_is_checked(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "clients.yaml"
    path.write_text(body)
    path.chmod(0o600)
    with pytest.raises(AuthFileError, match=message):
        ClientAuth.load(path, tmp_path, rig_auth_cfg(path))


ALICE_SECRET = "MF5NSPACLFKJPRIA27QQ6J6ZKN6CTV7M"


def _counting_auth(tmp_path: Path) -> tuple[ClientAuth, list[str]]:
    """A `ClientAuth` whose TOTP computations are recorded (secret per call)."""
    from agentd.config import ClientEntry

    secrets_used: list[str] = []

    def code_at(secret: str, step: int) -> str:
        secrets_used.append(secret)
        return totp_code(secret, step)

    entries = {"alice": ClientEntry("alice", ALICE_SECRET, "public")}
    auth = ClientAuth(
        entries, tmp_path / "state.json", rig_auth_cfg(tmp_path / "c.yaml"),
        clock=lambda: 1_000_000.0, code_at=code_at,
    )
    return auth, secrets_used


def test_an_unknown_client_id_costs_the_same_totp_work_as_a_wrong_code(
    tmp_path: Path,
) -> None:
    auth, used = _counting_auth(tmp_path)
    assert auth.authenticate(auth_frame("alice", totp="000000")) is None
    known = list(used)
    used.clear()
    assert auth.authenticate(auth_frame("mallory", totp="000000")) is None
    unknown = list(used)
    # Three steps each (previous, current, next), against a real-length secret.
    assert len(known) == len(unknown) == 3
    assert set(unknown) == {DUMMY_TOTP_SECRET} and set(known) == {ALICE_SECRET}


def test_a_locked_out_client_still_costs_the_totp_work(tmp_path: Path) -> None:
    auth, used = _counting_auth(tmp_path)
    locked: list[str] = []
    auth.on_lockout = locked.append
    for _ in range(5):
        auth.authenticate(auth_frame("alice", totp="000000"))
    assert locked == ["alice"]
    used.clear()
    right = totp_code(ALICE_SECRET, 1_000_000 // 30)
    assert auth.authenticate(auth_frame("alice", totp=right)) is None
    assert len(used) == 3


def test_totp_codes_are_rfc_6238_and_an_80_bit_secret_logs_in(tmp_path: Path) -> None:
    """RFC 6238's SHA-1 vectors (its 8-digit codes, last 6 digits), and a client whose
    secret has 80 bits (the configuration's minimum, the usual authenticator example):
    pyotp 2.10 and later refuse it, and with pyotp the daemon's TLS handler raised on
    such a client's right code (the connection dropped without a close frame)."""
    from agentd.config import ClientEntry

    rfc = base64.b32encode(b"12345678901234567890").decode()
    vectors = {59: "287082", 1111111109: "081804", 1234567890: "005924",
               2000000000: "279037", 20000000000: "353130"}
    assert {t: totp_code(rfc, t // 30) for t in vectors} == vectors
    short = "JBSWY3DPEHPK3PXP"  # 80 bits
    entries = {"alice": ClientEntry("alice", short, "public")}
    auth = ClientAuth(entries, tmp_path / "state.json", rig_auth_cfg(tmp_path / "c.yaml"),
                      clock=lambda: 1_000_000.0)
    code = totp_code(short, 1_000_000 // 30)
    assert current_totp(short, clock=lambda: 1_000_000.0) == code
    assert auth.authenticate(auth_frame("alice", totp=code)) is not None


def test_the_dummy_code_of_an_unknown_client_never_authenticates(tmp_path: Path) -> None:
    auth, _ = _counting_auth(tmp_path)
    dummy = totp_code(DUMMY_TOTP_SECRET, 1_000_000 // 30)
    assert auth.authenticate(auth_frame("mallory", totp=dummy)) is None


def test_a_new_clients_file_withdraws_removed_and_rekeyed_clients(rig: Rig) -> None:
    """`ClientAuth.replace` (what `agentctl reload` applies): added clients log in,
    removed ones and ones with a new secret lose their sessions; a new secret's code
    works at once, and a removed client added back cannot reuse a code."""
    from agentd.config import ClientEntry

    auth = rig.auth
    steps = {}
    sessions = {}
    for who in ("alice", "bob"):
        code = rig.code(who)
        ok = auth.authenticate(auth_frame(who, totp=code))
        assert ok is not None
        steps[who], sessions[who] = code, ok[1]
    entries = {c: ClientEntry(c, rig.secrets[c], "public") for c in ("alice", "bob")}
    carol = pyotp.random_base32()
    new_alice = pyotp.random_base32()
    wanted = {
        "alice": ClientEntry("alice", new_alice, "public"),  # rekeyed
        "carol": ClientEntry("carol", carol, "public"),  # added
    }  # bob removed
    diff = auth.diff(wanted)
    assert (diff.added, diff.removed, diff.changed, diff.rekeyed) == (
        ("carol",), ("bob",), ("alice",), ("alice",))
    assert auth.profiles().keys() == {"alice", "bob"}  # diff changes nothing
    assert auth.replace(wanted) == diff and diff.withdrawn == ("alice", "bob")
    assert auth.profiles() == {"alice": "public", "carol": "public"}
    for who in ("alice", "bob"):
        assert auth.authenticate(auth_frame(who, session=sessions[who])) is None
    now = int(rig.clock() // 30)
    assert auth.authenticate(auth_frame("alice", totp=totp_code(new_alice, now))) is not None
    assert auth.authenticate(auth_frame("carol", totp=totp_code(carol, now))) is not None
    assert auth.authenticate(auth_frame("bob", totp=rig.code("bob"))) is None  # unknown now
    auth.replace({**wanted, "bob": entries["bob"]})  # bob back, same secret
    assert auth.authenticate(auth_frame("bob", totp=steps["bob"])) is None  # used before


def rig_auth_cfg(path: Path):
    from agentd.config import AuthConfig

    return AuthConfig(clients_file=path)


# ---- transport ---------------------------------------------------------------------


async def test_plain_ws_is_refused(rig: Rig) -> None:
    with pytest.raises((InvalidMessage, ConnectionError, OSError, EOFError, TimeoutError)):
        async with connect(f"ws://127.0.0.1:{rig.bus.port}/bus", open_timeout=3):
            pass


async def test_tls_below_1_2_is_refused(rig: Rig) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        ctx.minimum_version = ssl.TLSVersion.TLSv1
        ctx.maximum_version = ssl.TLSVersion.TLSv1_1
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    except (ValueError, ssl.SSLError):  # pragma: no cover - the local OpenSSL has no 1.1
        pytest.skip("this OpenSSL cannot even offer TLS 1.1")
    assert rig.bus.ssl_context.minimum_version is ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        async with connect(rig.url, ssl=ctx, open_timeout=3):
            pass


async def test_tls_1_3_is_negotiated(rig: Rig) -> None:
    async with rig.client("alice") as c:
        ssl_obj = c.connection.transport.get_extra_info("ssl_object")
        assert ssl_obj.version() == "TLSv1.3"


def _tls12_client(cipher: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(cipher)
    return ctx


@pytest.mark.parametrize(
    "cipher", ["ECDHE-ECDSA-AES128-SHA", "ECDHE-ECDSA-AES256-SHA384", "AES128-GCM-SHA256"]
)
async def test_tls_1_2_refuses_cbc_and_non_ecdhe_suites(rig: Rig, cipher: str) -> None:
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        async with connect(rig.url, ssl=_tls12_client(cipher), open_timeout=3):
            pass


@pytest.mark.parametrize(
    "cipher", ["ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-CHACHA20-POLY1305"]
)
async def test_tls_1_2_accepts_ecdhe_with_aead(rig: Rig, cipher: str) -> None:
    async with connect(rig.url, ssl=_tls12_client(cipher), open_timeout=3) as ws:
        ssl_obj = ws.transport.get_extra_info("ssl_object")
        assert (ssl_obj.version(), ssl_obj.cipher()[0]) == ("TLSv1.2", cipher)


async def test_other_paths_are_404(rig: Rig) -> None:
    for path in ("/", "/bus/x", "/metrics"):
        with pytest.raises(InvalidStatus) as info:
            async with connect(f"wss://127.0.0.1:{rig.bus.port}{path}", ssl=_trusting(rig)):
                pass
        assert info.value.response.status_code == 404


async def test_oversize_frame_closes_with_1009(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"max_envelope_bytes": 4096})
    try:
        c = await r.login("alice")
        await c.send_raw(b"<x>" + b"a" * 5000 + b"</x>")
        with pytest.raises(BusError):
            await c.recv(timeout=30)
        assert c.close_code == 1009
    finally:
        await stop_rig(r)


async def test_max_connections_refuses_the_next_one(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"max_connections": 2})
    try:
        a = await r.login("alice")
        b = await r.login("bob")
        with pytest.raises(BusError, match="503"):
            await r.client("alice").connect()
        await a.close()
        await b.close()
    finally:
        await stop_rig(r)


async def test_compression_is_off_by_default(rig: Rig) -> None:
    async with connect(rig.url, ssl=_trusting(rig)) as ws:  # offers permessage-deflate
        assert ws.response is not None
        assert "Sec-WebSocket-Extensions" not in ws.response.headers


# ---- envelopes ------------------------------------------------------------------------


async def test_forged_from_is_rejected_with_huh_invalid_envelope(rig: Rig) -> None:
    async with rig.client("alice") as c:
        forged = build_envelope("bob", str(uuid.uuid4()), spec_of(Add).to_bytes(Add(a=1, b=2)))
        frames = await c.exchange(forged, timeout=30)
    assert kinds(frames) == [("core", "huh")]
    assert value(frames[0], "code") == "invalid-envelope"


async def test_garbage_frames_get_huh_and_the_connection_stays_open(rig: Rig) -> None:
    async with rig.client("alice") as c:
        for junk in (b"\xff\xfe garbage", b"<unclosed>", b"<a/>", "<message>text</message>"):
            await c.send_raw(junk)
            frame = await c.recv(timeout=30)
            assert kinds([frame]) == [("core", "huh")]
        frames = await c.exchange(Add(a=20, b=22), timeout=30)
    assert value(frames[-1], "value") == "42"


async def test_privileged_payload_on_the_bus_is_refused(rig: Rig) -> None:
    async with rig.client("alice") as c:
        priv = build_envelope(
            "alice", str(uuid.uuid4()),
            b'<privileged xmlns="https://xml-pipeline.org/ns/privileged/v1"></privileged>',
        )
        frames = await c.exchange(priv, timeout=30)
    assert value(frames[-1], "code") == "unroutable"


async def test_every_ingress_refusal_is_answered_on_the_thread_the_envelope_names(
    rig: Rig,
) -> None:
    """One rule (docs/protocol.md): a refusal comes on the thread the refused bytes
    name, so a client sending several can tell which was refused; the nil thread only
    for bytes that name none. A `priv` element was answered on the nil thread, and so
    was any envelope that failed the envelope schema."""
    add = spec_of(Add).to_bytes(Add(a=1, b=2))
    priv = b'<privileged xmlns="https://xml-pipeline.org/ns/privileged/v1"></privileged>'
    sent = {
        "priv payload": build_envelope("alice", str(uuid.uuid4()), priv),
        "priv in meta": build_envelope("alice", str(uuid.uuid4()), add).replace(
            b"</thread></meta>",
            b'</thread><x xmlns="https://xml-pipeline.org/ns/privileged/v1"/></meta>'),
        "no namespace": build_envelope("alice", str(uuid.uuid4()), b"<add><a>1</a></add>"),
        "forged from": build_envelope("bob", str(uuid.uuid4()), add),
        "unroutable": build_envelope("alice", str(uuid.uuid4()), b'<nope xmlns="urn:x"/>'),
        "bad payload": build_envelope("alice", str(uuid.uuid4()), add.replace(b">1<", b">x<")),
    }
    async with rig.client("alice") as c:
        for data in sent.values():
            await c.send_raw(data)
        answers = [await c.recv(timeout=30) for _ in sent]
        await c.send_raw(b"<message><unclosed>")
        broken = await c.recv(timeout=30)
    threads = {frame_kind(f)[2]: value(f, "code") for f in answers}
    assert threads == {
        parse_thread(sent["priv payload"]): "unroutable",
        parse_thread(sent["priv in meta"]): "unroutable",
        parse_thread(sent["no namespace"]): "invalid-envelope",
        parse_thread(sent["forged from"]): "invalid-envelope",
        parse_thread(sent["unroutable"]): "unroutable",
        parse_thread(sent["bad payload"]): "invalid-payload",
    }
    assert frame_kind(broken)[2] == "00000000-0000-0000-0000-000000000000"


def parse_thread(data: bytes) -> str:
    return data.split(b"<thread>")[1].split(b"</thread>")[0].decode()


async def test_a_payload_that_fails_its_schema_is_told_which_element_of_it_failed(
    rig: Rig,
) -> None:
    """The sender learns what of its own input failed (it was told only "The payload
    does not match its schema."); nothing of the schema beyond that element."""
    async with rig.client("alice") as c:
        bad_value = await c.exchange(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>x</a><b>3</b>'
            b"</add>", timeout=30)
        extra = await c.exchange(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><c>3</c>'
            b"</add>", timeout=30)
        attribute = await c.exchange(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1" k="v"><a>1</a>'
            b"<b>3</b></add>", timeout=30)
    assert value(bad_value[-1], "code") == "invalid-payload"
    assert value(bad_value[-1], "message") == (
        "The payload does not match its schema: <a>: 'x' is not a valid value of the "
        "local atomic type.")
    assert value(extra[-1], "message") == (
        "The payload does not match its schema: <c>: This element is not expected.")
    assert "Expected" not in value(extra[-1], "message")  # the listener's contract is not told
    assert value(attribute[-1], "message") == (
        "The payload does not match its schema: attributes are not allowed in a payload.")


async def test_a_payload_without_a_namespace_is_told_so(rig: Rig) -> None:
    """It read `The envelope is not valid.` (the payload took the envelope's namespace)."""
    async with rig.client("alice") as c:
        frames = await c.exchange(b"<add><a>1</a><b>2</b></add>", timeout=30)
    assert value(frames[-1], "code") == "invalid-envelope"
    assert value(frames[-1], "message") == (
        'The envelope is not valid: its payload <add> has no namespace of its own; give it '
        'the listener\'s (xmlns="...").')


async def test_a_thread_of_another_client_is_unroutable(rig: Rig) -> None:
    async with rig.client("alice") as alice:
        thread = (await alice.exchange(Relay(a=1, b=2), timeout=30))
        alice_thread = frame_kind(thread[0])[2]
    async with rig.client("bob") as bob:
        frames = await bob.exchange(Add(a=1, b=1), thread=alice_thread, timeout=30)
    assert value(frames[-1], "code") == "unroutable"


async def test_rate_limit_answers_huh_rate_limited(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"rate_per_s": 0.5, "rate_burst": 3})
    try:
        async with r.client("alice") as c:
            threads = [await c.send(Add(a=i, b=1)) for i in range(6)]
            got: dict[str, list[str]] = {t: [] for t in threads}
            while sum(1 for v in got.values() if v and v[-1] != "accepted") < 6:
                _sender, kind, thread = frame_kind(await c.recv(timeout=30))
                got[thread].append(kind if kind != "huh" else "huh")
        limited = [t for t in threads if got[t] == ["huh"]]
        assert len(limited) == 3 and limited == threads[3:]
        assert all(got[t] == ["accepted", "sum"] for t in threads[:3])
    finally:
        await stop_rig(r)


async def test_200_concurrent_clients_each_get_their_own_answers(tmp_path: Path) -> None:
    names = tuple(f"c{i:03d}" for i in range(200))
    # All 200 authenticate at once from one address: above the default cap of 16.
    r = await start_rig(tmp_path, clients=names, bus={"max_unauthenticated_per_ip": 200})
    try:
        async def one(i: int, name: str) -> None:
            async with r.client(name) as c:
                for k in range(3):
                    frames = await c.exchange(Relay(a=i, b=k), timeout=30)
                    assert kinds(frames) == [("core", "accepted"), ("relay", "sum")]
                    assert value(frames[-1], "value") == str(i + k)
                    assert parse_envelope(frames[-1]).to == name

        await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))
    finally:
        await stop_rig(r)


async def test_answers_go_to_the_connection_that_asked(rig: Rig) -> None:
    a1 = await rig.login("alice")
    a2 = await rig.login("alice", session=a1.session)
    try:
        f1, f2 = await asyncio.gather(
            a1.exchange(Add(a=1, b=1), timeout=30), a2.exchange(Add(a=2, b=2), timeout=30)
        )
        assert value(f1[-1], "value") == "2" and value(f2[-1], "value") == "4"
    finally:
        await a1.close()
        await a2.close()


async def test_frames_queued_together_arrive_whole_and_in_order(rig: Rig) -> None:
    """Frames for one connection queued in the same loop turn leave in one TLS write;
    the client still reads them as separate messages, in queue order."""
    c = await rig.login("alice")
    try:
        thread = str(uuid.uuid4())
        burst = [build_envelope("echo", thread, spec_of(Echo).to_bytes(Echo(text=f"n{i}")),
                                to="alice") for i in range(50)]
        conn = rig.bus.connections_of("alice")[-1]
        writes_before = conn.writes
        for frame in burst:
            rig.bus.deliver("alice", thread, frame)
        got = [await c.recv(timeout=30) for _ in burst]
        assert got == burst
        assert conn.writes - writes_before == 1  # 50 frames, one transport write
    finally:
        await c.close()


# ---- flow control -------------------------------------------------------------------


async def test_inflight_limit_stops_reading_until_answers_come(tmp_path: Path) -> None:
    r = await start_rig(tmp_path, bus={"max_inflight": 4})
    GATE["event"] = event = asyncio.Event()
    try:
        async with r.client("alice") as c:
            threads = [await c.send(Gate(n=i)) for i in range(20)]
            await gate_entered(4)
            session = r.bus.connections_of("alice")[-1].session
            assert session is not None
            # The server stopped consuming frames: its window is full, reading paused.
            assert session.inflight.full and not session.reading
            assert len(r.submitted) == 4
            event.set()
            answers: dict[str, str] = {}
            while len(answers) < 20:
                _sender, kind, thread = frame_kind(await c.recv(timeout=30))
                if kind != "accepted":
                    answers[thread] = kind
        assert set(answers) == set(threads) and set(answers.values()) == {"gated"}
        assert len(r.submitted) == 20
    finally:
        await stop_rig(r)


async def test_inflight_slots_of_unanswered_threads_expire(tmp_path: Path) -> None:
    ttl = 0.4
    r = await start_rig(tmp_path, bus={"max_inflight": 2}, server_kw={"inflight_ttl_s": ttl})
    GATE["event"] = asyncio.Event()  # never set during the test
    try:
        async with r.client("alice") as c:
            sent_at = asyncio.get_running_loop().time()
            for i in range(3):
                await c.send(Gate(n=i))
            await gate_entered(2)
            session = r.bus.connections_of("alice")[-1].session
            assert session is not None and not session.reading
            assert len(r.submitted) == 2
            await gate_entered(3)  # the first slot expired, the third envelope went in
            assert len(r.submitted) == 3
            assert GATE["times"][2] - sent_at >= ttl
    finally:
        await stop_rig(r)


async def test_a_client_that_never_reads_is_bounded(tmp_path: Path) -> None:
    limit = 64 * 1024
    r = await start_rig(
        tmp_path, bus={"max_envelope_bytes": 16384},
        server_kw={"send_queue_limit": limit, "read_pause_bytes": 16 * 1024},
    )
    closed: list[BusSession] = []
    gone = asyncio.Event()
    r.bus.on_session_closed = lambda session: (closed.append(session), gone.set())
    try:
        c = await r.login("alice")
        text = "x" * 4000

        async def flood() -> None:
            for _ in range(3000):
                await c.send(Echo(text=text))

        flooding = asyncio.create_task(flood())
        await asyncio.wait_for(gone.wait(), 30)
        # The server stopped reading long before the client ran out of things to send,
        # its queue for this client never passed the limit, and it dropped the client.
        assert not flooding.done()
        assert len(r.submitted) < 200
        assert [s.close_code for s in closed] == [1008]
        assert 0 < closed[0].peak_queued_bytes <= limit
        assert r.bus.connections == 0 and not r.bus.connections_of("alice")
        flooding.cancel()
        c.connection.transport.abort()
    finally:
        await stop_rig(r)


# ---- outbox --------------------------------------------------------------------------


async def test_answers_for_a_disconnected_client_arrive_on_reconnect_in_order(
    outbox_rig: Rig,
) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    GATE["event"] = event = asyncio.Event()
    c = await r.login("alice")
    threads = [await c.send(Gate(n=i)) for i in range(5)]
    for _ in threads:
        assert frame_kind(await c.recv(timeout=30))[1] == "accepted"
    await c.close()  # mid-conversation
    event.set()
    await r.pump.join()
    await kernel.flush()
    assert [t for _, t, _ in await kernel.outbox("alice")] == threads
    async with r.client("alice", session=c.session) as again:
        replayed = [await again.recv(timeout=30) for _ in threads]
        assert [frame_kind(f)[2] for f in replayed] == threads
        assert [value(f, "n") for f in replayed] == ["0", "1", "2", "3", "4"]
        # new traffic comes after the replay
        frames = await again.exchange(Add(a=3, b=4), timeout=30)
        assert value(frames[-1], "value") == "7"
    await kernel.flush()
    assert not [f for f in await kernel.outbox("alice") if f[1] in threads]  # delivered


async def test_outbox_frames_are_replayed_before_anything_new(outbox_rig: Rig) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    seeded = [str(uuid.uuid4()) for _ in range(3)]
    tx = kernel.transaction()
    for i, t in enumerate(seeded):
        body = f'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>{i}</value></sum>'
        frame = build_envelope("calculator.add", t, body.encode(), to="alice")
        tx.outbox_put("alice", t, frame)
    await kernel.commit(tx)
    async with r.client("alice") as c:
        assert [frame_kind(await c.recv(timeout=30))[2] for _ in seeded] == seeded
        frames = await c.exchange(Add(a=1, b=2), timeout=30)
        assert value(frames[-1], "value") == "3"
    await kernel.flush()
    assert await kernel.outbox("alice") == []


async def test_a_frame_written_on_one_connection_keeps_anothers_queued_frames(
    tmp_path: Path,
) -> None:
    """Alice holds two connections; A reads nothing (its answers wait in its send
    queue), B does an exchange. B's written answer removes B's outbox row only: every
    frame still queued on A stays in the outbox, so a crash now loses none of them
    (a mark "up to B's id" deleted them, and after kill -9 they were never replayed)."""
    r = await start_rig(tmp_path, kernel=True, bus={"rate_per_s": 100000.0,
                                                    "rate_burst": 100000})
    kernel = r.kernel
    assert kernel is not None
    a = await r.login("alice")
    b = await r.login("alice", session=a.session)
    try:
        first = r.bus.connections_of("alice")[0]
        text = "x" * 4000

        async def flood() -> None:
            while True:
                await a.send(Echo(text=text))

        flooding = asyncio.create_task(flood())
        try:
            for _ in range(600):  # until A's socket is full and answers wait for it
                s = first.session
                if s is not None and not s.writable and any(
                        i is not None for _, i in (s.sendq or ())):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("connection A never filled")
        finally:
            flooding.cancel()
        frames = await b.exchange(Add(a=2, b=3), timeout=30)
        assert value(frames[-1], "value") == "5"
        await asyncio.sleep(0)  # the delivery marks of this loop turn
        await kernel.flush()
        assert first.session is not None and first.session.sendq is not None
        queued = {i for _, i in first.session.sendq if i is not None}
        kept = {oid for oid, _, _ in await kernel.outbox("alice")}
        assert queued and queued <= kept
    finally:
        await a.close()
        await b.close()
        await stop_rig(r)


# ---- acknowledged delivery -------------------------------------------------------------


async def _outbox_ids(kernel: Kernel) -> list[int]:
    await kernel.flush()
    return [oid for oid, _, _ in await kernel.outbox("alice")]


async def _until_outbox(kernel: Kernel, ids: list[int]) -> None:
    async with asyncio.timeout(30):
        while await _outbox_ids(kernel) != ids:
            await asyncio.sleep(0.01)


async def test_an_outbox_frame_stays_until_the_client_acknowledges_its_seq(outbox_rig: Rig) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    async with r.client("alice", delivered=0) as c:
        frames = await c.exchange(Add(a=2, b=3), timeout=30)
        answer = frames[-1]
        seq = seq_of(parse_envelope(answer))
        assert seq is not None and seq_of(parse_envelope(frames[0])) is None  # accepted
        # Meta's first extension, in C14N form.
        assert (f'<thread>{frame_kind(answer)[2]}</thread><d:seq xmlns:d="{NS_DELIVERY}">'
                f"{seq}</d:seq></meta>").encode() in answer
        await r.pump.join()
        assert await _outbox_ids(kernel) == [seq]  # written, not yet acknowledged
        await c.ack(seq)
        await _until_outbox(kernel, [])


async def test_a_resume_resends_only_what_follows_the_seq_in_the_auth_frame(
    outbox_rig: Rig,
) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    tx = kernel.transaction()
    ids = []
    for i in range(3):
        t = str(uuid.uuid4())
        body = f'<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1"><value>{i}</value></sum>'
        ids.append(tx.outbox_put("alice", t, build_envelope("calculator.add", t,
                                                            body.encode(), to="alice")))
    await kernel.commit(tx)
    async with r.client("alice", delivered=ids[1]) as c:
        frame = await c.recv(timeout=30)
        assert seq_of(parse_envelope(frame)) == ids[2] and value(frame, "value") == "2"
        await _until_outbox(kernel, [ids[2]])  # the two it had are gone
        with pytest.raises(TimeoutError):
            await c.recv(timeout=0.3)  # nothing else comes


async def test_an_ack_in_another_clients_name_is_a_forged_from(outbox_rig: Rig) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    async with r.client("alice", delivered=0) as c:
        frames = await c.exchange(Add(a=2, b=3), timeout=30)
        seq = seq_of(parse_envelope(frames[-1]))
        assert seq is not None
        await c.send_raw(ack_frame("bob", seq))
        refusal = await c.recv(timeout=30)
        assert frame_kind(refusal)[1] == "huh" and value(refusal, "code") == "invalid-envelope"
        await r.pump.join()
        assert await _outbox_ids(kernel) == [seq]  # still kept


async def test_a_client_that_does_not_acknowledge_has_frames_removed_once_written(
    outbox_rig: Rig,
) -> None:
    r, kernel = outbox_rig, outbox_rig.kernel
    assert kernel is not None
    async with r.client("alice") as c:
        frames = await c.exchange(Add(a=2, b=3), timeout=30)
        assert seq_of(parse_envelope(frames[-1])) is not None  # stamped all the same
        await r.pump.join()
        await _until_outbox(kernel, [])


# ---- lifecycle and metrics ---------------------------------------------------------


async def test_close_ends_connections_with_1001(tmp_path: Path) -> None:
    r = await start_rig(tmp_path)
    c = await r.login("alice")
    await r.bus.close()
    with pytest.raises(BusError):
        await c.recv(timeout=30)
    assert c.close_code == 1001
    assert not r.bus.listening
    await r.pump.stop()


async def test_connections_gauge_moves(rig: Rig) -> None:
    before = sample("agentd_bus_connections")
    c = await rig.login("alice")
    assert sample("agentd_bus_connections") == before + 1
    assert rig.bus.connections >= 1
    await c.close()  # the server counted the close before it answered it
    assert sample("agentd_bus_connections") == before


def _trusting(rig: Rig) -> ssl.SSLContext:
    from agentd.bus import client_context

    return client_context(rig.cafile)



# ---- previews --------------------------------------------------------------------------


async def test_previews_reach_a_session_that_asked_and_a_resume_sends_them_again(
    rig: Rig,
) -> None:
    hub = rig.bus.streams = StreamHub(rig.bus.deliver, rig.bus.busy)
    thread = str(uuid.uuid4())
    async with rig.client("alice") as plain:
        assert not hub.wanted("alice", thread)
    rig.next_step()
    async with rig.client("alice", stream=True) as c:
        assert hub.wanted("alice", thread)
        writer = hub.writer("alice", thread)
        first = []
        for piece in ("Hello ", "world"):  # each once the one before is written
            writer.piece(piece)
            first.append(await c.recv(timeout=30))
        assert [value(f, "text") for f in first] == ["Hello ", "world"]
        stream = value(first[0], "stream")
        await c.send_raw(resume_frame("alice", stream, 2))
        again = await c.recv(timeout=30)
        assert (value(again, "seq"), value(again, "text")) == ("2", "world")
        writer.close()
        final = await c.recv(timeout=30)
        assert frame_kind(final)[1] == "final" and value(final, "last-seq") == "2"
    assert not hub.wanted("alice", thread)  # the session that asked is gone
    assert plain.session is not None
