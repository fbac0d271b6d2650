"""Federation: sovereign organisms calling each other's exported listeners.

identity (the Ed25519 key and its public line) · binding (the TLS `tls-exporter`
value) · handshake (sans-I/O, pure) · gateway (the link state machine, backoff) ·
link (the `/federation` endpoint and the dialers: the I/O).
"""

from agentd.federation._binding import ChannelBindingUnavailable, tls_exporter
from agentd.federation._gateway import LinkState, check_gateways
from agentd.federation._handshake import (
    HANDSHAKE_FAILED,
    Handshake,
    HandshakeFailed,
    Role,
)
from agentd.federation._identity import (
    Identity,
    IdentityError,
    fingerprint,
    load_identity,
    parse_public_line,
    public_line,
    write_identity,
)
from agentd.federation._link import (
    FEDERATION_PATH,
    SECURITY_KINDS,
    Federation,
    federation_server_context,
)
from agentd.federation._remote import classes_by_root, offer_of, with_remote_listeners

__all__ = [
    "FEDERATION_PATH",
    "HANDSHAKE_FAILED",
    "SECURITY_KINDS",
    "ChannelBindingUnavailable",
    "Federation",
    "Handshake",
    "HandshakeFailed",
    "Identity",
    "IdentityError",
    "LinkState",
    "Role",
    "check_gateways",
    "classes_by_root",
    "federation_server_context",
    "fingerprint",
    "load_identity",
    "offer_of",
    "parse_public_line",
    "public_line",
    "tls_exporter",
    "with_remote_listeners",
    "write_identity",
]
