"""The federation handshake without sockets: the happy path, then every way a peer
can lie (wrong key, undeclared name, replay, relay, reflection, garbage)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agentd._states import step
from agentd.federation import Handshake, HandshakeFailed, Identity, Role
from agentd.federation._handshake import TRANSITIONS, HsEvent, HsState
from tests.state_tables import walk_table

ALPHA = Identity("alpha", Ed25519PrivateKey.generate())
BETA = Identity("beta", Ed25519PrivateKey.generate())
BINDING = b"\x01" * 32


def pair(
    dialer: Identity = ALPHA, acceptor: Identity = BETA, *,
    dialer_binding: bytes = BINDING, acceptor_binding: bytes = BINDING,
    acceptor_knows: dict | None = None, dialer_knows: dict | None = None,
) -> tuple[Handshake, Handshake]:
    d = Handshake(Role.DIALER, dialer, dialer_binding,
                  dialer_knows or {"beta": BETA.key.public_key()}, expect="beta")
    a = Handshake(Role.ACCEPTOR, acceptor, acceptor_binding,
                  acceptor_knows if acceptor_knows is not None
                  else {"alpha": ALPHA.key.public_key()})
    return d, a


def run(d: Handshake, a: Handshake) -> list[bytes]:
    """Drive both sides to the end; returns every frame the dialer sent."""
    sent = d.start()
    a.start()
    log = list(sent)
    to_acceptor, to_dialer = list(sent), []
    while to_acceptor or to_dialer:
        for frame in to_acceptor:
            to_dialer += a.receive(frame)
        to_acceptor = []
        for frame in to_dialer:
            out = d.receive(frame)
            log += out
            to_acceptor += out
        to_dialer = []
    return log


def test_both_sides_authenticate_each_other() -> None:
    d, a = pair()
    run(d, a)
    assert d.done and a.done
    assert d.peer == "beta" and a.peer == "alpha"


def test_each_side_learns_the_largest_frame_the_other_takes() -> None:
    d = Handshake(Role.DIALER, ALPHA, BINDING, {"beta": BETA.key.public_key()},
                  expect="beta", max_frame=4096)
    a = Handshake(Role.ACCEPTOR, BETA, BINDING, {"alpha": ALPHA.key.public_key()},
                  max_frame=1 << 20)
    run(d, a)
    assert d.peer_max_frame == 1 << 20 and a.peer_max_frame == 4096


NONCE = "A" * 43 + "="  # 32 bytes


@pytest.mark.parametrize("limit", ["", ', "max_frame": 1023', ', "max_frame": true',
                                   ', "max_frame": "4096"', ', "max_frame": 4096.0',
                                   f', "max_frame": {1 << 40}'])
def test_a_hello_without_a_valid_frame_limit_fails(limit: str) -> None:
    _, a = pair()
    a.start()
    hello = '{"t": "hello", "name": "alpha", "nonce": "' + NONCE + '"' + limit + "}"
    with pytest.raises(HandshakeFailed, match="max_frame"):
        a.receive(hello.encode())


def test_wrong_key_fails_at_the_acceptor() -> None:
    impostor = Identity("alpha", Ed25519PrivateKey.generate())
    d, a = pair(dialer=impostor)
    with pytest.raises(HandshakeFailed, match="bad signature"):
        run(d, a)
    assert a.peer is None


def test_wrong_acceptor_key_fails_at_the_dialer() -> None:
    impostor = Identity("beta", Ed25519PrivateKey.generate())
    d, a = pair(acceptor=impostor)
    with pytest.raises(HandshakeFailed, match="bad signature"):
        run(d, a)
    assert d.peer is None


def test_undeclared_name_fails_only_after_the_acceptor_proved_itself() -> None:
    """The acceptor answers an undeclared name like a declared one: the refusal
    comes at the same step as for a wrong key, so names cannot be probed."""
    d, a = pair(acceptor_knows={})
    with pytest.raises(HandshakeFailed, match="undeclared"):
        run(d, a)
    assert d.state is HsState.AWAIT_READY  # the dialer got HELLO + PROOF, as always


def test_relayed_handshake_fails_because_the_channels_differ() -> None:
    """A relay terminating TLS on both sides has two exporter values."""
    d, a = pair(dialer_binding=b"\x01" * 32, acceptor_binding=b"\x02" * 32)
    with pytest.raises(HandshakeFailed, match="another TLS channel"):
        run(d, a)


def test_replayed_dialer_frames_fail_on_a_new_connection() -> None:
    d, a = pair()
    recorded = run(d, a)
    _, fresh = pair(acceptor_binding=b"\x03" * 32)
    fresh.start()
    with pytest.raises(HandshakeFailed):
        for frame in recorded:
            fresh.receive(frame)
    assert fresh.peer is None


def test_replay_with_the_same_binding_still_fails_on_fresh_nonces() -> None:
    d, a = pair()
    recorded = run(d, a)
    _, fresh = pair()
    fresh.start()
    with pytest.raises(HandshakeFailed, match="bad signature"):
        for frame in recorded:
            fresh.receive(frame)


def test_reflected_acceptor_proof_is_not_a_dialer_proof() -> None:
    """Alpha dials beta while both share a binding; echoing beta's own proof back
    must fail: each signature names its role."""
    d, a = pair(dialer=BETA, dialer_knows={"beta": BETA.key.public_key()},
                acceptor_knows={"beta": BETA.key.public_key()})
    hello = d.start()[0]
    a.start()
    _, proof = a.receive(hello)
    with pytest.raises(HandshakeFailed, match="bad signature"):
        a.receive(proof)


def test_dialer_refuses_a_peer_answering_under_another_name() -> None:
    gamma = Identity("gamma", Ed25519PrivateKey.generate())
    d, a = pair(acceptor=gamma)
    with pytest.raises(HandshakeFailed, match="answered by 'gamma'"):
        run(d, a)


@pytest.mark.parametrize("frame", [
    b"", b"not json", b"[]", b'{"t": 1}', b'{"t": "ready"}', b'{"t": "proof", "sig": "AA=="}',
    b'{"t": "hello", "name": "alpha", "nonce": "short"}',
    b'{"t": "hello", "name": "", "nonce": "' + b"A" * 44 + b'"}',
    b'{"t": "hello", "name": "alpha", "nonce": "' + b"A" * 5000 + b'"}',
])
def test_malformed_frames_fail_cleanly(frame: bytes) -> None:
    _, a = pair()
    a.start()
    with pytest.raises(HandshakeFailed):
        a.receive(frame)
    assert a.state is HsState.FAILED
    with pytest.raises(HandshakeFailed):  # and it stays failed
        a.receive(b'{"t": "ready"}')


def test_nothing_is_accepted_after_done() -> None:
    d, a = pair()
    run(d, a)
    with pytest.raises(HandshakeFailed):
        a.receive(b'{"t": "ready"}')


def test_transition_table_walk() -> None:
    walk_table(TRANSITIONS, lambda s, e: step("hs", TRANSITIONS, s, e), HsState, HsEvent)
