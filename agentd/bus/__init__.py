"""The main bus: TLS WebSocket transport with TOTP authentication.

`ClientAuth` decides who may connect; `BusSession` decides everything about one
connection without I/O; `BusConnection` (the only module touching websockets on the
server side) drives a session from the socket; `BusServer` listens and routes the
pump's frames to connections; `OutboxSource` is what the server needs of the
kernel's durable outbox. Other packages import from here only.
"""

from agentd.bus._adapter import BUS_PATH, BusConnection
from agentd.bus._auth import (
    TOTP_STEP_S,
    AuthFileError,
    ClientAuth,
    ClientsDiff,
    auth_frame,
    current_totp,
    diff_clients,
    parse_auth_ok,
    read_clients_file,
    totp_code,
    write_private_atomic,
)
from agentd.bus._limits import TokenBucket
from agentd.bus._server import BusServer, OutboxSource
from agentd.bus._session import (
    AUTH_FAILED_REASON,
    CLOSE_AUTH_FAILED,
    CLOSE_AUTH_TIMEOUT,
    BusSession,
    ConnEvent,
    ConnState,
    SessionLimits,
)
from agentd.bus._tls import (
    TlsSetupError,
    client_context,
    make_self_signed,
    server_context,
    write_new,
)

__all__ = [
    "AUTH_FAILED_REASON",
    "BUS_PATH",
    "CLOSE_AUTH_FAILED",
    "CLOSE_AUTH_TIMEOUT",
    "TOTP_STEP_S",
    "AuthFileError",
    "BusConnection",
    "BusServer",
    "BusSession",
    "ClientAuth",
    "ClientsDiff",
    "ConnEvent",
    "ConnState",
    "OutboxSource",
    "SessionLimits",
    "TlsSetupError",
    "TokenBucket",
    "auth_frame",
    "client_context",
    "current_totp",
    "diff_clients",
    "make_self_signed",
    "parse_auth_ok",
    "read_clients_file",
    "server_context",
    "totp_code",
    "write_new",
    "write_private_atomic",
]
