"""The main bus: TLS WebSocket transport with TOTP authentication (CONTRACT section 3).

`ClientAuth` decides who may connect; `BusServer` moves frames between sockets and
the pump; `OutboxSource` is what the server needs of the kernel's durable outbox.
"""

from agentd.bus._auth import (
    AuthFileError,
    ClientAuth,
    ClientsDiff,
    auth_frame,
    diff_clients,
    read_clients_file,
    totp_code,
)
from agentd.bus._server import (
    AUTH_FAILED_REASON,
    BUS_PATH,
    CLOSE_AUTH_FAILED,
    CLOSE_AUTH_TIMEOUT,
    BusServer,
    ConnState,
    OutboxSource,
)
from agentd.bus._tls import TlsSetupError, client_context, make_self_signed, server_context

__all__ = [
    "AUTH_FAILED_REASON",
    "BUS_PATH",
    "CLOSE_AUTH_FAILED",
    "CLOSE_AUTH_TIMEOUT",
    "AuthFileError",
    "BusServer",
    "ClientAuth",
    "ClientsDiff",
    "ConnState",
    "OutboxSource",
    "TlsSetupError",
    "auth_frame",
    "client_context",
    "diff_clients",
    "make_self_signed",
    "read_clients_file",
    "server_context",
    "totp_code",
]
