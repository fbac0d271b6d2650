"""The out-of-band channel: signed privileged commands on a local Unix socket.

The wire format is in docs/protocol.md. The daemon runs an `OobServer` with its own `Commands`; the
operator's `agentctl` signs requests with `sign_request` and sends them with
`OobClient`. The decisions (framing, verification, nonce window, responses) live in
`_protocol` without I/O; `_server` and `_client` are the socket adapters.
"""

from agentd.oob._client import OobClient, OobConnectError, OobProtocolError
from agentd.oob._keys import (
    AuthorizedKeysError,
    KeyFileError,
    authorized_keys_line,
    load_authorized_keys,
    load_private_key,
    parse_authorized_keys,
    valid_key_id,
    write_private_key,
)
from agentd.oob._protocol import (
    AUTH_CODES,
    COMMAND_NAMES,
    SECURITY_KINDS,
    ErrorCode,
    FrameDecoder,
    NonceCache,
    Refusal,
    Response,
    SignedCommand,
    Verifier,
    build_response,
    encode_frame,
    format_time,
    parse_response,
    sign_request,
)
from agentd.oob._results import element_to_json, result_element, result_to_json
from agentd.oob._server import (
    CommandFailed,
    Commands,
    OobServer,
    OobSocketError,
    Peer,
    ServerState,
    operator_key_id,
)

__all__ = [
    "AUTH_CODES",
    "COMMAND_NAMES",
    "SECURITY_KINDS",
    "AuthorizedKeysError",
    "CommandFailed",
    "Commands",
    "ErrorCode",
    "FrameDecoder",
    "KeyFileError",
    "NonceCache",
    "OobClient",
    "OobConnectError",
    "OobProtocolError",
    "OobServer",
    "OobSocketError",
    "Peer",
    "Refusal",
    "Response",
    "ServerState",
    "SignedCommand",
    "Verifier",
    "authorized_keys_line",
    "build_response",
    "element_to_json",
    "encode_frame",
    "format_time",
    "load_authorized_keys",
    "load_private_key",
    "operator_key_id",
    "parse_authorized_keys",
    "parse_response",
    "result_element",
    "result_to_json",
    "sign_request",
    "valid_key_id",
    "write_private_key",
]
