"""TLS for the main bus: the server and client contexts, and a self-signed
certificate for first runs (`agentd init`) and tests.

The server refuses anything below TLS 1.2 and prefers TLS 1.3 (OpenSSL negotiates
the highest both sides have). TLS compression stays off (OpenSSL's default). In
TLS 1.2 only ECDHE key exchange with AEAD ciphers is offered: CBC suites (LUCKY13
and kin) and static-RSA key exchange (no forward secrecy) are never negotiated.
TLS 1.3 suites are all AEAD and stay as OpenSSL ships them. The private key is read
like every secret file (agentd._secrets: no symbolic link, owner root or ours, mode
0600 or stricter) before OpenSSL sees it.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from agentd._errors import AgentdError
from agentd._secrets import SecretFileError, read_secret_file
from agentd.config import TlsConfig

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
_MAX_KEY_FILE = 1024 * 1024

# OpenSSL cipher string for TLS 1.2 (it does not affect TLS 1.3's suites).
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class TlsSetupError(AgentdError):
    """The certificate or key cannot be loaded."""


def server_context(tls: TlsConfig | None, key: bytes | None = None) -> ssl.SSLContext:
    """The bus's server context for `tls`; `key`: the key's bytes if already read."""
    if tls is None:
        raise TlsSetupError(
            "bus.tls is required: the main bus only speaks TLS (set bus.tls.cert and "
            "bus.tls.key; `agentd init` writes a self-signed pair)"
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    # No TLS 1.3 session tickets: bus clients reconnect with a session token, not TLS
    # resumption, and each ticket costs a little memory and CPU per connection.
    ctx.num_tickets = 0
    _load_pair(ctx, tls, _read_key(tls) if key is None else key)
    return ctx


def reload_pair(ctx: ssl.SSLContext, tls: TlsConfig) -> None:
    """Load `tls`'s pair into the live `ctx` (connections made from now on get it).
    The key is read once, through the secret-file checks, and the pair is loaded into
    a fresh context first, so a bad pair raises `TlsSetupError` and changes nothing."""
    key = _read_key(tls)
    server_context(tls, key)  # raises on a missing certificate or a key that does not match
    _load_pair(ctx, tls, key)


def _read_key(tls: TlsConfig) -> bytes:
    try:
        return read_secret_file(tls.key, "TLS key", max_bytes=_MAX_KEY_FILE)
    except SecretFileError as exc:
        raise TlsSetupError(str(exc)) from None


def _load_pair(ctx: ssl.SSLContext, tls: TlsConfig, key: bytes) -> None:
    try:
        _load_cert_chain(ctx, tls.cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(
            f"cannot load TLS certificate {tls.cert} with key {tls.key}: {exc}"
        ) from None


def _load_cert_chain(ctx: ssl.SSLContext, cert: Path, key: bytes) -> None:
    """`load_cert_chain` with the key's bytes as read (and checked) by
    `read_secret_file`: OpenSSL only loads keys from a path, so it gets an anonymous
    in-memory file that no one else can name or swap."""
    fd = os.memfd_create("agentd-tls-key", os.MFD_CLOEXEC)
    try:
        view = memoryview(key)
        while view:
            view = view[os.write(fd, view):]
        ctx.load_cert_chain(str(cert), f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def client_context(cafile: str | Path | None = None, verify: bool = True) -> ssl.SSLContext:
    """Verifies the server against `cafile` (or the system store); `verify=False`
    only for tests and throwaway setups."""
    try:
        ctx = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    except (OSError, ssl.SSLError) as exc:  # a mistyped path said only "No such file"
        raise TlsSetupError(f"CA file {cafile}: {getattr(exc, 'strerror', None) or exc}"
                            ) from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def make_self_signed(
    cert_path: Path,
    key_path: Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = 825,
) -> None:
    """A P-256 self-signed server certificate for `hosts` (DNS names or IPs). The key
    is written with mode 0600. A client trusts it with `--cafile cert.pem`."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    subject = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, hosts[0] if hosts else "agentd"),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agentd self-signed"),
    ])
    now = dt.datetime.now(dt.UTC)
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        # CA:TRUE so that strict verifiers accept it as its own trust anchor.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=True,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_new(key_path, key_bytes, 0o600)
    write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Create `path` with `mode` from the start (never briefly world-readable);
    refuses to overwrite."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)  # umask does not narrow it further than asked
    finally:
        os.close(fd)
