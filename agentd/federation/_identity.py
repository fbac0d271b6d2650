"""An organism's identity: one Ed25519 key.

The private key lives in `identity.key` (OpenSSH format, mode 0600, read through
the secret-file checks); the public half travels as one line, `ssh-ed25519 AAAA…
NAME`, which the peer's operator pastes into its `gateways:` entry. Nothing else
identifies a peer: TLS certificates only carry the channel the handshake binds to.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from agentd._errors import AgentdError, ConfigError
from agentd.oob import (
    KeyFileError,
    authorized_keys_line,
    load_private_key,
    parse_authorized_keys,
    write_private_key,
)


class IdentityError(AgentdError):
    """The identity key cannot be read, or a declared public key is not one."""


@dataclass(frozen=True)
class Identity:
    name: str  # the organism's name, signed into every handshake
    key: Ed25519PrivateKey

    @property
    def public_line(self) -> str:
        return public_line(self.key.public_key(), self.name)


def public_line(public: Ed25519PublicKey, name: str) -> str:
    return authorized_keys_line(public, name)


def fingerprint(public: Ed25519PublicKey) -> str:
    """`SHA256:…` as ssh-keygen -l prints it, for logs and status."""
    blob = base64.b64decode(public_line(public, "x").split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def parse_public_line(line: str) -> Ed25519PublicKey:
    """One `ssh-ed25519 AAAA… comment` line; anything else raises `IdentityError`."""
    text = line.strip()
    if len(text.split()) == 2:
        text += " peer"  # the comment is optional here
    try:
        keys = parse_authorized_keys(text, source="public_key")
    except ConfigError as exc:
        raise IdentityError(f"not an ssh-ed25519 public key line: {exc}") from None
    if len(keys) != 1:
        raise IdentityError("expected exactly one ssh-ed25519 public key line")
    return next(iter(keys.values()))


def write_identity(path: Path, name: str) -> Identity:
    """A new identity key at `path` (refuses to overwrite)."""
    if path.exists():
        raise IdentityError(f"{path} already exists; an identity key is never overwritten")
    key = Ed25519PrivateKey.generate()
    write_private_key(path, key, name)
    return Identity(name, key)


def load_identity(path: Path, name: str) -> Identity:
    try:
        key, _comment = load_private_key(path)
    except KeyFileError as exc:
        raise IdentityError(f"identity.key: {exc}") from None
    return Identity(name, key)
