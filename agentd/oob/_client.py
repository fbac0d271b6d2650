"""A blocking client for the out-of-band socket (used by `agentctl` and tests).

Connection problems become `OobConnectError` with a one-line reason such as
"cannot connect to /var/lib/agentd/oob.sock: permission denied"; a daemon that
closes without answering, answers garbage or too slowly becomes `OobProtocolError`.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from types import TracebackType

from agentd._errors import AgentdError
from agentd.oob._protocol import (
    MAX_FRAME_BYTES,
    BadResponse,
    Response,
    encode_frame,
    parse_response,
)


class OobConnectError(AgentdError):
    """The socket cannot be reached."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"cannot connect to {path}: {reason}")
        self.path = path
        self.reason = reason


class OobProtocolError(AgentdError):
    """Connected, but no valid answer came back."""


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc) or type(exc).__name__).lower()


class OobClient:
    def __init__(self, socket_path: Path | str, *, timeout: float = 60.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._sock: socket.socket | None = None

    def __enter__(self) -> OobClient:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(str(self.socket_path))
        except TimeoutError:
            sock.close()
            raise OobConnectError(self.socket_path, "timed out") from None
        except OSError as exc:
            sock.close()
            raise OobConnectError(self.socket_path, _reason(exc)) from None
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send_frame(self, payload: bytes) -> None:
        self.send_bytes(encode_frame(payload))

    def send_bytes(self, data: bytes) -> None:
        """`data` as it is, framed or not: `send_frame` for a well-formed frame."""
        sock = self._require()
        try:
            sock.sendall(data)
        except TimeoutError:
            raise OobProtocolError("timed out sending to the daemon") from None
        except OSError as exc:
            raise OobProtocolError(f"the daemon closed the connection ({_reason(exc)})") from None

    def recv_frame(self) -> bytes:
        header = self._recv_exact(4)
        (size,) = struct.unpack(">I", header)
        if size > self.max_frame_bytes:
            raise OobProtocolError(f"the daemon sent a frame of {size} bytes "
                                   f"(limit {self.max_frame_bytes})")
        return self._recv_exact(size)

    def _recv_exact(self, n: int) -> bytes:
        sock = self._require()
        chunks: list[bytes] = []
        remaining = n
        while remaining:
            try:
                chunk = sock.recv(min(remaining, 1 << 16))
            except TimeoutError:
                raise OobProtocolError(f"no answer from the daemon within "
                                       f"{self.timeout:g} s") from None
            except OSError as exc:
                raise OobProtocolError(f"the daemon closed the connection "
                                       f"({_reason(exc)})") from None
            if not chunk:
                raise OobProtocolError(
                    "the daemon closed the connection without answering (if it logged a "
                    "refused peer, your uid is not allowed: see oob.allowed_uids)")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def exchange(self, payload: bytes) -> bytes:
        """Send one request frame, return the raw response frame body."""
        self.send_frame(payload)
        return self.recv_frame()

    def request(self, payload: bytes) -> Response:
        raw = self.exchange(payload)
        try:
            return parse_response(raw, max_bytes=self.max_frame_bytes)
        except BadResponse as exc:
            raise OobProtocolError(str(exc)) from None

    def _require(self) -> socket.socket:
        if self._sock is None:
            raise OobProtocolError("not connected")
        return self._sock
