"""Secret files are read only if they are what they claim to be: attacks, for real."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from agentd._secrets import (
    SecretFileError,
    checking_as,
    read_secret_file,
    write_private_atomic,
)

SECRET = b"clients:\n  alice: {totp_secret: JBSWY3DPEHPK3PXP, profile: public}\n"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "clients.yaml"
    write_private_atomic(path, SECRET)
    return path


def refused(path: Path, *fragments: str, **kw: object) -> str:
    with pytest.raises(SecretFileError) as info:
        read_secret_file(path, "clients file", **kw)  # type: ignore[arg-type]
    message = str(info.value)
    assert str(path) in message and "clients file" in message
    assert "JBSWY3DP" not in message  # never the content
    for fragment in fragments:
        assert fragment in message
    return message


def test_a_private_file_of_ours_is_read_whole(secret: Path) -> None:
    assert oct(secret.stat().st_mode & 0o777) == oct(0o600)
    assert read_secret_file(secret, "clients file") == SECRET
    assert read_secret_file(str(secret), "clients file", max_bytes=len(SECRET)) == SECRET


def test_a_symlink_to_a_private_file_is_refused(secret: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(secret)
    refused(link, "symbolic link")


def test_a_dangling_symlink_is_refused_as_a_link(tmp_path: Path) -> None:
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "nowhere")
    refused(link, "symbolic link")


def test_a_symlink_swapped_in_after_the_open_cannot_win(
        secret: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker replaces the file by a link to their own (world-readable) one in
    the window between the open and everything after it. There is no second lookup
    of the path: the checks and the read use the descriptor opened first."""
    theirs = tmp_path / "theirs.yaml"
    theirs.write_bytes(b"clients: {mallory: {totp_secret: X, profile: admin}}\n")
    theirs.chmod(0o644)
    real_open: Callable[..., int] = os.open
    swaps = []

    def open_then_swap(path: object, flags: int, *args: object) -> int:
        fd = real_open(path, flags, *args)
        if Path(str(path)) == secret and not swaps:
            staged = tmp_path / "staged-link"
            staged.symlink_to(theirs)
            os.replace(staged, secret)  # atomic: the path now names their file
            swaps.append(True)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    assert read_secret_file(secret, "clients file") == SECRET
    assert swaps and secret.is_symlink()
    monkeypatch.undo()
    refused(secret, "symbolic link")  # and the next read sees the link, and refuses


@pytest.mark.parametrize("mode", [0o640, 0o620, 0o610, 0o604, 0o602, 0o601, 0o660, 0o644])
def test_any_permission_for_group_or_others_is_refused(secret: Path, mode: int) -> None:
    secret.chmod(mode)
    refused(secret, f"{mode:04o}", "chmod 600")


def test_a_file_owned_by_another_user_is_refused(secret: Path) -> None:
    os.chown(secret, 12345, -1)
    refused(secret, "uid 12345", f"uid {os.geteuid()}")


def test_checking_as_the_daemons_user_accepts_its_files_and_no_one_elses(secret: Path) -> None:
    os.chown(secret, 12345, -1)
    with checking_as(12345):
        assert read_secret_file(secret, "clients file") == secret.read_bytes()
    with checking_as(23456):
        refused(secret, "uid 12345", "uid 23456")
    refused(secret, "uid 12345")  # the block's end restores the rule


def test_checking_as_the_daemons_user_refuses_a_private_file_it_cannot_read(
        secret: Path) -> None:
    """check-config --user: a 0600 file owned by root (made by `sudo`) is one the
    daemon's user cannot read; it said ok, and the daemon failed at start."""
    os.chown(secret, 0, -1)
    with checking_as(12345):
        refused(secret, "uid 12345 cannot read it", "chown 12345")
    assert read_secret_file(secret, "clients file") == secret.read_bytes()  # as root


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "clients.yaml"
    os.mkfifo(fifo, 0o600)
    refused(fifo, "not a regular file")


def test_a_directory_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "clients.yaml"
    folder.mkdir(mode=0o700)
    refused(folder, "not a regular file")


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "clients.yaml"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        os.chmod(path, 0o600)
        refused(path, "cannot read", "no such device")  # open() itself fails


def test_an_oversize_file_is_refused_not_truncated(secret: Path) -> None:
    refused(secret, f"larger than {len(SECRET) - 1} bytes", max_bytes=len(SECRET) - 1)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    refused(tmp_path / "absent.yaml", "cannot read", "no such file")


def test_a_file_of_public_keys_may_be_read_by_others_but_never_written(
        tmp_path: Path) -> None:
    path = tmp_path / "authorized_keys"
    write_private_atomic(path, b"ssh-ed25519 AAAA ops-1\n")
    path.chmod(0o644)
    assert read_secret_file(path, "authorized keys file", readable_by_others=True)
    for mode in (0o664, 0o646):
        path.chmod(mode)
        with pytest.raises(SecretFileError, match="writable by group or others"):
            read_secret_file(path, "authorized keys file", readable_by_others=True)
    path.chmod(0o644)
    os.chown(path, 12345, -1)
    with pytest.raises(SecretFileError, match="uid 12345"):
        read_secret_file(path, "authorized keys file", readable_by_others=True)


def test_the_writer_makes_files_the_reader_accepts(tmp_path: Path) -> None:
    path = tmp_path / "new" / "state.json"
    write_private_atomic(path, b"{}")
    write_private_atomic(path, b'{"version": 1}')  # replaces
    assert read_secret_file(path, "auth state file") == b'{"version": 1}'
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no tmp left


def test_the_writer_can_refuse_to_replace_anything(tmp_path: Path) -> None:
    path = tmp_path / "operator.key"
    write_private_atomic(path, b"first", replace=False)
    with pytest.raises(FileExistsError):
        write_private_atomic(path, b"second", replace=False)
    link = tmp_path / "link.key"
    link.symlink_to(tmp_path / "nowhere")  # a dangling link is not followed either
    with pytest.raises(FileExistsError):
        write_private_atomic(link, b"second", replace=False)
    assert not (tmp_path / "nowhere").exists()
    assert read_secret_file(path, "key") == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.key", "operator.key"]


# ---- every secret file goes through it -------------------------------------------------


def test_the_clients_and_auth_state_files_go_through_the_reader(
        secret: Path, tmp_path: Path) -> None:
    from agentd.bus import AuthFileError, ClientAuth
    from agentd.config import AuthConfig

    state_dir = tmp_path / "state"
    assert ClientAuth.load(secret, state_dir, AuthConfig()).profiles() == {"alice": "public"}
    link = tmp_path / "link.yaml"
    link.symlink_to(secret)
    with pytest.raises(AuthFileError, match="symbolic link"):
        ClientAuth.load(link, state_dir, AuthConfig())
    state = state_dir / "auth-state.json"
    write_private_atomic(state, b'{"version": 1, "clients": {}}')
    assert ClientAuth.load(secret, state_dir, AuthConfig()).profiles() == {"alice": "public"}
    os.chown(state, 12345, -1)
    with pytest.raises(AuthFileError, match=r"auth state file .* uid 12345"):
        ClientAuth.load(secret, state_dir, AuthConfig())


def test_the_operator_key_and_authorized_keys_go_through_the_reader(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agentd.oob import (
        AuthorizedKeysError,
        KeyFileError,
        authorized_keys_line,
        load_authorized_keys,
        load_private_key,
        write_private_key,
    )

    key = Ed25519PrivateKey.generate()
    key_path = tmp_path / "operator.key"
    write_private_key(key_path, key, "ops-1")
    assert load_private_key(key_path)[1] == "ops-1"
    link = tmp_path / "key-link"
    link.symlink_to(key_path)
    with pytest.raises(KeyFileError, match="symbolic link"):
        load_private_key(link)
    os.chown(key_path, 12345, -1)
    with pytest.raises(KeyFileError, match="uid 12345"):
        load_private_key(key_path)

    keys = tmp_path / "authorized_keys"
    write_private_atomic(keys, (authorized_keys_line(key.public_key(), "ops-1") + "\n").encode())
    keys.chmod(0o644)
    assert set(load_authorized_keys(keys)) == {"ops-1"}
    keys_link = tmp_path / "keys-link"
    keys_link.symlink_to(keys)
    with pytest.raises(AuthorizedKeysError, match="symbolic link"):
        load_authorized_keys(keys_link)


def test_the_tls_key_goes_through_the_reader(tmp_path: Path) -> None:
    from agentd.bus import TlsSetupError, make_self_signed, server_context
    from agentd.config import TlsConfig

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make_self_signed(cert, key)
    assert server_context(TlsConfig(cert=cert, key=key)) is not None
    link = tmp_path / "key-link.pem"
    link.symlink_to(key)
    with pytest.raises(TlsSetupError, match="symbolic link"):
        server_context(TlsConfig(cert=cert, key=link))
    key.chmod(0o640)
    with pytest.raises(TlsSetupError, match="chmod 600"):
        server_context(TlsConfig(cert=cert, key=key))
