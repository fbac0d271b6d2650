"""Operator keys for the out-of-band channel.

Two file formats, both OpenSSH's so that operators can use the tools they know:

- the daemon's `authorized_keys`: one `ssh-ed25519 AAAA… KEY-ID` a line, the comment
  is the key-id. Only Ed25519 is accepted; options before the
  key type, a missing or malformed key-id and duplicate key-ids are errors, each
  reported with its line. Like sshd's StrictModes, a file that group or others may
  write, or that belongs to someone other than root or the daemon's user, is
  refused (agentd._secrets reads it): whoever can write it can run privileged
  commands.
- the operator's private key: `openssh-key-v1` (what `ssh-keygen -t ed25519`
  writes), unencrypted, with the key-id as its comment so that `agentctl` can find
  the key-id without being told. PEM PKCS#8 Ed25519 keys are read too. Like ssh,
  a key file that group or others can read is refused.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import struct
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from agentd._errors import AgentdError, ConfigError
from agentd._secrets import SecretFileError, read_secret_file, write_private_atomic

KEY_TYPE = "ssh-ed25519"
KEY_ID_PATTERN = r"[A-Za-z0-9_.@\-]{1,128}"  # as privileged.xsd's key-id
_KEY_ID = re.compile(KEY_ID_PATTERN + r"\Z")
_OTHER_TYPES = re.compile(r"(ssh-|ecdsa-|sk-|rsa-|dsa-)[A-Za-z0-9@._\-]*\Z")
_OPENSSH_MAGIC = b"openssh-key-v1\x00"
_MAX_AUTHORIZED_KEYS = 4 * 1024 * 1024
_MAX_KEY_FILE = 64 * 1024


class AuthorizedKeysError(ConfigError):
    """`authorized_keys` cannot be used; `issues` names every bad line."""


class KeyFileError(AgentdError):
    """A private key file cannot be read, or is not an unencrypted Ed25519 key."""


def valid_key_id(key_id: str) -> bool:
    return _KEY_ID.match(key_id) is not None


# --- authorized_keys -------------------------------------------------------------


def load_authorized_keys(path: Path | str) -> dict[str, Ed25519PublicKey]:
    """Read `authorized_keys`: key-id -> public key. Raises `AuthorizedKeysError`."""
    try:
        data = read_secret_file(path, "authorized keys file", max_bytes=_MAX_AUTHORIZED_KEYS,
                                readable_by_others=True)
    except SecretFileError as exc:
        raise AuthorizedKeysError([str(exc)]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AuthorizedKeysError([f"{path}: not UTF-8 ({exc.reason})"]) from None
    return parse_authorized_keys(text, source=str(path))


def parse_authorized_keys(
    text: str, source: str = "authorized_keys"
) -> dict[str, Ed25519PublicKey]:
    """Parse the text of an `authorized_keys` file; every bad line is reported."""
    keys: dict[str, Ed25519PublicKey] = {}
    issues: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{number}"
        parts = line.split()
        kind = parts[0]
        if kind != KEY_TYPE:
            if _OTHER_TYPES.match(kind) and len(parts) >= 2:
                issues.append(f"{where}: key type {kind} is not supported; only {KEY_TYPE} "
                              f"(create one with `agentctl keygen` or `ssh-keygen -t ed25519`)")
            elif (len(parts) >= 2 and parts[1] == KEY_TYPE) or "=" in kind:
                issues.append(f"{where}: options before the key type are not supported")
            else:
                issues.append(f"{where}: not a key line (expected `{KEY_TYPE} AAAA… KEY-ID`)")
            continue
        if len(parts) < 2:
            issues.append(f"{where}: the key is missing after {KEY_TYPE}")
            continue
        try:
            public = _public_from_blob(parts[1])
        except ValueError as exc:
            issues.append(f"{where}: {exc}")
            continue
        if len(parts) < 3:
            issues.append(f"{where}: no key-id (the comment after the key is the key-id)")
            continue
        key_id = " ".join(parts[2:])
        if not valid_key_id(key_id):
            issues.append(f"{where}: key-id {key_id!r} must match {KEY_ID_PATTERN}")
            continue
        if key_id in keys:
            issues.append(f"{where}: duplicate key-id {key_id!r}")
            continue
        keys[key_id] = public
    if issues:
        raise AuthorizedKeysError(issues)
    return keys


def _public_from_blob(b64: str) -> Ed25519PublicKey:
    try:
        blob = binascii.a2b_base64(b64.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("the key is not valid base64") from None
    fields = _ssh_strings(blob, 2)
    if fields is None or fields[0] != KEY_TYPE.encode() or len(fields[1]) != 32:
        raise ValueError(f"the key is not an {KEY_TYPE} public key")
    return Ed25519PublicKey.from_public_bytes(fields[1])


def _ssh_strings(blob: bytes, count: int) -> list[bytes] | None:
    """Exactly `count` SSH wire strings (uint32 length + bytes), or None."""
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(blob):
            return None
        (n,) = struct.unpack_from(">I", blob, pos)
        pos += 4
        if pos + n > len(blob):
            return None
        out.append(blob[pos:pos + n])
        pos += n
    return out if pos == len(blob) else None


def public_blob(public: Ed25519PublicKey) -> bytes:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _string(KEY_TYPE.encode()) + _string(raw)


def authorized_keys_line(public: Ed25519PublicKey, key_id: str) -> str:
    """`ssh-ed25519 AAAA… KEY-ID`, the line to append to the daemon's authorized_keys."""
    return f"{KEY_TYPE} {base64.b64encode(public_blob(public)).decode()} {key_id}"


# --- private keys ------------------------------------------------------------------


def private_key_to_openssh(key: Ed25519PrivateKey, comment: str) -> bytes:
    """Unencrypted `openssh-key-v1` with a comment (cryptography writes none)."""
    seed = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    check = secrets.token_bytes(4)
    private = (
        check + check + _string(KEY_TYPE.encode()) + _string(pub) + _string(seed + pub)
        + _string(comment.encode())
    )
    private += bytes(range(1, 1 + (-len(private)) % 8))  # deterministic padding 1, 2, 3…
    body = (
        _OPENSSH_MAGIC + _string(b"none") + _string(b"none") + _string(b"")
        + struct.pack(">I", 1) + _string(public_blob(key.public_key())) + _string(private)
    )
    b64 = base64.b64encode(body).decode()
    lines = [b64[i:i + 70] for i in range(0, len(b64), 70)]
    return ("-----BEGIN OPENSSH PRIVATE KEY-----\n" + "\n".join(lines)
            + "\n-----END OPENSSH PRIVATE KEY-----\n").encode()


def write_private_key(path: Path, key: Ed25519PrivateKey, key_id: str) -> None:
    """Create `path` with mode 0600 from the start; never overwrites (FileExistsError)."""
    write_private_atomic(path, private_key_to_openssh(key, key_id), replace=False)


def load_private_key(path: Path | str) -> tuple[Ed25519PrivateKey, str | None]:
    """The key and the key-id stored as its comment (None when it has none).

    Like ssh, a key file that group or others can read is refused.
    """
    path = Path(path)
    try:
        data = read_secret_file(path, "key", max_bytes=_MAX_KEY_FILE)
    except SecretFileError as exc:
        raise KeyFileError(str(exc)) from None
    comment: str | None = None
    key: object
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
            comment = _openssh_comment(data)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise KeyFileError(f"key {path} is encrypted; agentctl needs an unencrypted key "
                           f"(keep it in a mode-0600 file)") from None
    except (ValueError, binascii.Error):
        raise KeyFileError(f"{path} is not an OpenSSH or PEM private key") from None
    except Exception as exc:  # cryptography raises UnsupportedAlgorithm and others
        raise KeyFileError(f"{path}: cannot load the key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"key {path} is not an Ed25519 key")
    if comment is not None and not valid_key_id(comment):
        comment = None
    return key, comment


def _openssh_comment(pem: bytes) -> str | None:
    """The comment of an unencrypted openssh-key-v1 file, or None."""
    try:
        lines = pem.decode("ascii").strip().splitlines()
        body = base64.b64decode("".join(lines[1:-1]))
        if not body.startswith(_OPENSSH_MAGIC):
            return None
        pos = len(_OPENSSH_MAGIC)
        cipher, pos = _read_string(body, pos)
        _, pos = _read_string(body, pos)  # kdfname
        _, pos = _read_string(body, pos)  # kdfoptions
        if cipher != b"none":
            return None
        pos += 4  # number of keys (1)
        _, pos = _read_string(body, pos)  # public key
        private, _ = _read_string(body, pos)
        p = 8  # two check ints
        _, p = _read_string(private, p)  # key type
        _, p = _read_string(private, p)  # public
        _, p = _read_string(private, p)  # private
        comment, _ = _read_string(private, p)
        return comment.decode("utf-8") or None
    except (ValueError, UnicodeDecodeError, binascii.Error, struct.error, IndexError):
        return None


def _read_string(data: bytes, pos: int) -> tuple[bytes, int]:
    (n,) = struct.unpack_from(">I", data, pos)
    end = pos + 4 + n
    if end > len(data):
        raise ValueError("truncated")
    return data[pos + 4:end], end


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data
