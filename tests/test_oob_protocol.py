"""The out-of-band protocol without sockets: framing, keys, signing, verification."""

from __future__ import annotations

import base64
import os
import struct
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lxml import etree

from agentd._schemas import NS_PRIV
from agentd.oob import (
    AuthorizedKeysError,
    ErrorCode,
    FrameDecoder,
    KeyFileError,
    NonceCache,
    Refusal,
    Verifier,
    authorized_keys_line,
    build_response,
    element_to_json,
    encode_frame,
    load_authorized_keys,
    load_private_key,
    parse_authorized_keys,
    parse_response,
    result_element,
    result_to_json,
    sign_request,
    write_private_key,
)
from agentd.oob._keys import private_key_to_openssh
from agentd.oob._protocol import FrameTooLarge, NonceCacheFull, format_time

KEY = Ed25519PrivateKey.generate()
OTHER = Ed25519PrivateKey.generate()
NOW = 1_800_000_000.0


def verifier(**kw: object) -> Verifier:
    return Verifier({"ops-1": KEY.public_key(), "ops-2": OTHER.public_key()}, **kw)  # type: ignore[arg-type]


def signed(command: str = "status", args: dict[str, str] | None = None, *,
           key: Ed25519PrivateKey = KEY, key_id: str = "ops-1", at: float = NOW,
           nonce: str | None = None) -> bytes:
    return sign_request(key, key_id, command, args, issued_at=at, nonce=nonce)


def refusal(v: Verifier, frame: bytes, now: float = NOW) -> Refusal:
    with pytest.raises(Refusal) as info:
        v.verify(frame, now)
    return info.value


# --- framing -------------------------------------------------------------------------


def test_frames_split_and_joined_across_reads_are_decoded() -> None:
    data = encode_frame(b"one") + encode_frame(b"") + encode_frame(b"three")
    dec = FrameDecoder()
    out: list[bytes] = []
    for i in range(len(data)):
        out += dec.receive_data(data[i:i + 1])
    assert out == [b"one", b"", b"three"]
    assert dec.pending == 0


def test_oversize_length_prefix_is_refused_before_buffering() -> None:
    dec = FrameDecoder(max_frame_bytes=1 << 20)
    with pytest.raises(FrameTooLarge) as info:
        dec.receive_data(struct.pack(">I", (1 << 20) + 1))
    assert info.value.close and info.value.code is ErrorCode.INVALID
    assert dec.pending == 0
    assert dec.receive_data(encode_frame(b"x" * (1 << 20))) == [b"x" * (1 << 20)]


# --- signing and verification --------------------------------------------------------


def test_signed_request_verifies_and_carries_its_command() -> None:
    frame = signed("introspect", {"what": "schema", "name": "a&b <c>"})
    cmd = verifier().verify(frame, NOW)
    assert (cmd.key_id, cmd.name, dict(cmd.args)) == (
        "ops-1", "introspect", {"what": "schema", "name": "a&b <c>"})
    assert cmd.issued_at == datetime.fromtimestamp(NOW, UTC)


def test_request_validates_against_privileged_xsd() -> None:
    from agentd._schemas import schema

    assert schema(NS_PRIV).validate(etree.fromstring(signed("journal", {"limit": "5"})))


def test_tampered_command_is_bad_signature() -> None:
    frame = signed("reload", {"dry-run": "true"}).replace(b">true<", b">fals<")
    assert refusal(verifier(), frame).code is ErrorCode.BAD_SIGNATURE


def test_wrong_key_is_bad_signature() -> None:
    frame = signed(key=OTHER, key_id="ops-1")
    assert refusal(verifier(), frame).code is ErrorCode.BAD_SIGNATURE


def test_unknown_key_id_is_refused() -> None:
    ref = refusal(verifier(), signed(key_id="nobody"))
    assert ref.code is ErrorCode.UNKNOWN_KEY and ref.fields["key_id"] == "nobody"


def test_replayed_nonce_is_refused() -> None:
    v = verifier()
    frame = signed(nonce="c" * 32)
    assert v.verify(frame, NOW).nonce == "c" * 32  # accepted the first time
    assert refusal(v, frame, NOW + 1).code is ErrorCode.REPLAY


@pytest.mark.parametrize("offset", [-61, 61, -3600, 86400])
def test_stale_and_future_issued_at_are_refused(offset: float) -> None:
    ref = refusal(verifier(), signed(at=NOW + offset))
    assert ref.code is ErrorCode.STALE
    assert ("future" in ref.message) == (offset > 0)


@pytest.mark.parametrize("offset", [-59.5, 0, 59.5])
def test_issued_at_within_the_window_is_accepted(offset: float) -> None:
    cmd = verifier().verify(signed(at=NOW + offset, nonce="d" * 32), NOW)
    assert (cmd.key_id, cmd.name, cmd.nonce) == ("ops-1", "status", "d" * 32)
    assert abs(cmd.issued_at.timestamp() - (NOW + offset)) < 1


def test_stale_request_does_not_consume_its_nonce() -> None:
    v = verifier()
    assert v.verify(signed(at=NOW, nonce="a" * 32), NOW).nonce == "a" * 32
    assert refusal(v, signed(at=NOW - 100, nonce="b" * 32)).code is ErrorCode.STALE
    assert "b" * 32 not in v.nonces


def test_bad_signature_does_not_consume_its_nonce() -> None:
    v = verifier()
    refusal(v, signed(key=OTHER, nonce="c" * 32))
    assert "c" * 32 not in v.nonces
    v.verify(signed(nonce="c" * 32), NOW)


def test_issued_at_with_offset_is_understood() -> None:
    at = datetime.fromtimestamp(NOW, UTC).astimezone(
        __import__("datetime").timezone(timedelta(hours=5, minutes=30)))
    frame = sign_request(KEY, "ops-1", "status", issued_at=at)
    assert b"Z</issued-at>" in frame  # written in UTC
    verifier().verify(frame, NOW)


def _resign(root: etree._Element, key: Ed25519PrivateKey = KEY) -> bytes:
    """Sign an arbitrary `privileged` tree (without signature) and return its bytes."""
    from agentd._xml import c14n

    sig = base64.b64encode(key.sign(c14n(root))).decode()
    etree.SubElement(root, f"{{{NS_PRIV}}}signature").text = sig
    return etree.tostring(root)


def test_issued_at_without_timezone_is_invalid() -> None:
    root = etree.fromstring(signed())
    root.remove(root[-1])
    root[2].text = "2027-01-15T08:00:00"
    assert refusal(verifier(), _resign(root)).code is ErrorCode.INVALID


def test_pretty_printed_request_verifies_whichever_way_signature_was_removed() -> None:
    """The contract's own example is pretty-printed; a DOM signer keeps the whitespace
    that followed `signature`, an ElementTree signer drops it. Both verify."""
    from agentd._xml import c14n

    def text(nonce: str, sig: str) -> str:
        return (
            f'<privileged xmlns="{NS_PRIV}">\n  <key-id>ops-1</key-id>\n'
            f"  <nonce>{nonce}</nonce>\n  <issued-at>{format_time(NOW)}</issued-at>\n"
            f'  <command name="status"/>\n  {sig}\n</privileged>'
        )

    tree_form = c14n(etree.fromstring(text("0" * 32, "").replace("  \n<", "  <").encode()))
    dom_form = c14n(etree.fromstring(text("1" * 32, "").encode()))
    assert tree_form.endswith(b"</command>\n  </privileged>")
    assert dom_form.endswith(b"</command>\n  \n</privileged>")
    for nonce, form in (("0" * 32, tree_form), ("1" * 32, dom_form)):
        sig = base64.b64encode(KEY.sign(form)).decode()
        frame = text(nonce, f"<signature>{sig}</signature>").encode()
        assert verifier().verify(frame, NOW).nonce == nonce


def test_non_canonical_base64_signature_is_refused() -> None:
    frame = signed()
    start = frame.index(b"<signature>") + len(b"<signature>")
    sig = frame[start:frame.index(b"</signature>")]
    # The last data character carries 2 padding bits; flipping one keeps the bytes.
    last = sig[-3:-2]
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    twin = alphabet[alphabet.index(last) ^ 1:][:1]
    assert base64.b64decode(sig[:-3] + twin + b"==") == base64.b64decode(sig)
    forged = frame[:start] + sig[:-3] + twin + b"==" + frame[start + len(sig):]
    # libxml2's base64Binary check already refuses it; the verifier would too.
    assert refusal(verifier(), forged).code in (ErrorCode.INVALID, ErrorCode.BAD_SIGNATURE)


@pytest.mark.parametrize("frame", [
    b"", b"garbage", b"<privileged", b"\xff\xfe<x/>",
    b'<!DOCTYPE x [<!ENTITY a "b">]><x>&a;</x>',
])
def test_garbage_is_invalid(frame: bytes) -> None:
    assert refusal(verifier(), frame).code is ErrorCode.INVALID


def test_malformed_xml_asks_to_close_but_schema_errors_do_not() -> None:
    assert refusal(verifier(), b"<x").close
    wrong = signed().replace(b"<key-id>", b"<keyid>").replace(b"</key-id>", b"</keyid>")
    ref = refusal(verifier(), wrong)
    assert ref.code is ErrorCode.INVALID and not ref.close


def test_a_response_is_not_a_request() -> None:
    assert refusal(verifier(), build_response("hi")).code is ErrorCode.INVALID


def test_duplicate_argument_is_invalid() -> None:
    root = etree.fromstring(signed("journal", {"limit": "1"}))
    root.remove(root[-1])
    root[3].append(etree.fromstring(f'<arg xmlns="{NS_PRIV}" name="limit">2</arg>'))
    assert refusal(verifier(), _resign(root)).code is ErrorCode.INVALID


def test_mutated_request_bytes_at_every_position_are_refused() -> None:
    frame = signed("reload", {"dry-run": "true"})
    for i in range(len(frame)):
        for xor in (0x01, 0x20):
            mutated = frame[:i] + bytes([frame[i] ^ xor]) + frame[i + 1:]
            with pytest.raises(Refusal):
                verifier().verify(mutated, NOW)


FRAME = signed("journal", {"thread": "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f", "limit": "10"})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(position=st.integers(0, len(FRAME) - 1), value=st.integers(0, 255))
def test_any_single_byte_mutation_is_refused(position: int, value: int) -> None:
    if FRAME[position] == value:
        return
    mutated = FRAME[:position] + bytes([value]) + FRAME[position + 1:]
    if _canonical(mutated) == _canonical(FRAME):
        # The same document (a tab for a space between attributes): the signature
        # covers its canonical form, so the request stands, unchanged in meaning.
        verifier().verify(mutated, NOW)
        return
    with pytest.raises(Refusal):
        verifier().verify(mutated, NOW)


def _canonical(frame: bytes) -> bytes | None:
    try:
        return etree.tostring(etree.fromstring(frame), method="c14n", exclusive=True)
    except (etree.XMLSyntaxError, etree.C14NError):  # not XML, or a broken namespace
        return None


# --- the nonce cache -------------------------------------------------------------------


def test_nonces_expire_after_the_window() -> None:
    cache = NonceCache(ttl_s=120, max_entries=10)
    assert cache.add("n1", 0)
    assert not cache.add("n1", 119)
    assert cache.add("n1", 121)


def test_full_nonce_cache_refuses_rather_than_forgets() -> None:
    cache = NonceCache(ttl_s=120, max_entries=3)
    for i in range(3):
        cache.add(f"n{i}", i)
    with pytest.raises(NonceCacheFull):
        cache.add("n3", 10)
    assert not cache.add("n0", 10)  # still remembered
    assert cache.add("n3", 120.5)  # n0 expired, room again
    assert len(cache) <= 3


def test_verifier_with_full_cache_answers_failed() -> None:
    v = verifier(max_nonces=1)
    v.verify(signed(), NOW)
    assert refusal(v, signed()).code is ErrorCode.FAILED


# --- responses ---------------------------------------------------------------------------


def test_response_round_trip() -> None:
    el = etree.Element("status", up="1")
    resp = parse_response(build_response(el))
    assert resp.ok and resp.result is not None and resp.result[0].get("up") == "1"
    assert el.getparent() is None  # the caller's element was copied, not moved
    err = parse_response(build_response(error=("stale", "too old")))
    assert (err.ok, err.error_code, err.error_message) == (False, "stale", "too old")


# --- authorized_keys ---------------------------------------------------------------------


def test_authorized_keys_comment_is_the_key_id(tmp_path: Path) -> None:
    path = tmp_path / "authorized_keys"
    path.write_text("# operators\n\n" + authorized_keys_line(KEY.public_key(), "ops-1") + "\n"
                    + authorized_keys_line(OTHER.public_key(), "backup@host") + "\n")
    keys = load_authorized_keys(path)
    assert sorted(keys) == ["backup@host", "ops-1"]
    assert keys["ops-1"] == KEY.public_key()


@pytest.mark.parametrize(("line", "message"), [
    ("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ ops", "ssh-rsa is not supported"),
    ("ecdsa-sha2-nistp256 AAAAE2VjZHNh ops", "not supported"),
    ('from="10.0.0.1" ssh-ed25519 AAAA ops', "options"),
    ("ssh-ed25519 !!!notbase64 ops", "base64"),
    ("ssh-ed25519 AAAAC3NzaC1yc2EAAAADAQAB ops", "not an ssh-ed25519"),
    ("ssh-ed25519", "missing"),
    ("hello world", "not a key line"),
])
def test_bad_authorized_keys_lines_are_reported_with_their_line(line: str, message: str) -> None:
    with pytest.raises(AuthorizedKeysError) as info:
        parse_authorized_keys("# c\n" + line + "\n", source="ak")
    assert info.value.issues[0].startswith("ak:2: ")
    assert message in info.value.issues[0]


def test_missing_bad_and_duplicate_key_ids_are_errors() -> None:
    good = authorized_keys_line(KEY.public_key(), "x").rsplit(" ", 1)[0]
    with pytest.raises(AuthorizedKeysError) as info:
        parse_authorized_keys(f"{good}\n{good} two words\n{good} a\n{good} a\n")
    issues = info.value.issues
    assert len(issues) == 3
    assert "no key-id" in issues[0] and "must match" in issues[1] and "duplicate" in issues[2]


def test_authorized_keys_writable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "authorized_keys"
    path.write_text(authorized_keys_line(KEY.public_key(), "ops-1") + "\n")
    os.chmod(path, 0o666)
    with pytest.raises(AuthorizedKeysError, match="writable by group or others"):
        load_authorized_keys(path)
    with pytest.raises(AuthorizedKeysError, match="cannot read"):
        load_authorized_keys(tmp_path / "missing")


# --- private keys -------------------------------------------------------------------------


def test_private_key_round_trip_keeps_the_key_id(tmp_path: Path) -> None:
    path = tmp_path / "k"
    write_private_key(path, KEY, "ops-1")
    assert (path.stat().st_mode & 0o777) == 0o600
    key, key_id = load_private_key(path)
    assert key_id == "ops-1" and key.public_key() == KEY.public_key()
    with pytest.raises(FileExistsError):
        write_private_key(path, KEY, "ops-1")


def test_private_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_bytes(private_key_to_openssh(KEY, "ops-1"))
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_private_key(path)


def test_ssh_keygen_interoperates(tmp_path: Path) -> None:
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "from-ssh",
                        "-f", str(tmp_path / "ssh")], check=True, capture_output=True)
    except FileNotFoundError:
        pytest.skip("ssh-keygen is not installed")
    key, key_id = load_private_key(tmp_path / "ssh")
    assert key_id == "from-ssh"
    keys = parse_authorized_keys((tmp_path / "ssh.pub").read_text())
    assert keys["from-ssh"] == key.public_key()
    # and ssh-keygen reads ours
    ours = tmp_path / "ours"
    write_private_key(ours, KEY, "ops-1")
    out = subprocess.run(["ssh-keygen", "-y", "-f", str(ours)], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[:2] == authorized_keys_line(KEY.public_key(), "ops-1").split()[:2]


def test_encrypted_and_foreign_keys_are_refused(tmp_path: Path) -> None:
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "1024", "-N", "",
                        "-f", str(tmp_path / "rsa")], check=True, capture_output=True)
    except FileNotFoundError:
        pytest.skip("ssh-keygen is not installed")
    with pytest.raises(KeyFileError, match="not an Ed25519"):
        load_private_key(tmp_path / "rsa")
    (tmp_path / "junk").write_text("junk")
    os.chmod(tmp_path / "junk", 0o600)
    with pytest.raises(KeyFileError):
        load_private_key(tmp_path / "junk")


def test_format_time_is_utc_with_z() -> None:
    assert format_time(0) == "1970-01-01T00:00:00Z"
    assert format_time(1.5) == "1970-01-01T00:00:01.5Z"
    with pytest.raises(ValueError):
        format_time(datetime(2020, 1, 1))
    assert abs(datetime.fromisoformat(format_time(time.time())).timestamp() - time.time()) < 2


# --- results as JSON ---------------------------------------------------------------------

_names = st.from_regex(r"[a-z][a-z0-9_\-]{0,8}", fullmatch=True)
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=20)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_names, inner, max_size=4),
    max_leaves=12,
)


def _normal(value: object) -> object:
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


@settings(max_examples=300, deadline=None)
@given(value=_values)
def test_result_values_survive_the_wire_as_json(value: object) -> None:
    wire = build_response(result_element("value", value))
    resp = parse_response(wire)
    assert result_to_json(resp.result) == {"value": _normal(value)}


def test_json_shapes_are_stable_for_typed_collections() -> None:
    for items in ([], ["a"], ["a", "b"]):
        got = result_to_json(parse_response(build_response(result_element("x", items))).result)
        assert got == {"x": items}
    assert result_to_json(parse_response(build_response(
        result_element("x", {"item": "only"}))).result) == {"x": {"item": "only"}}


def _xml(text: str) -> object:
    return element_to_json(etree.fromstring(text))


def test_scalars_keep_their_types_in_json() -> None:
    got = result_to_json(parse_response(build_response(result_element(
        "status", {"seq": 18, "uptime_s": 9.5, "kernel_healthy": True, "parent": None,
                   "name": "18"}))).result)
    assert got == {"status": {"seq": 18, "uptime_s": 9.5, "kernel_healthy": True,
                              "parent": None, "name": "18"}}
    assert type(got["status"]["seq"]) is int and type(got["status"]["kernel_healthy"]) is bool


def test_a_scalar_marker_on_foreign_xml_that_does_not_parse_stays_text() -> None:
    assert _xml('<r type="int">twelve</r>') == {"type": "int", "#text": "twelve"}


def test_json_rules_for_untyped_xml() -> None:
    assert _xml("<r>plain</r>") == "plain"
    assert _xml("<r/>") == ""
    assert _xml("<r><item>a</item><item>b</item></r>") == ["a", "b"]
    assert _xml('<r type="list"><e n="1"/></r>') == [{"n": "1"}]
    assert _xml('<r a="1"><a>2</a><b/><b/></r>') == {"@a": "1", "a": "2", "b": ["", ""]}
    assert _xml("<r>hello <b>bold</b> world</r>") == {"b": "bold", "#text": "hello  world"}
    assert _xml('<r x="1">t</r>') == {"x": "1", "#text": "t"}
    assert _xml('<p:r xmlns:p="urn:p" p:k="v"/>') == {"k": "v"}
    assert result_to_json(None) is None
