"""Observability at the edge (docs/protocol.md): the metrics/health HTTP endpoint,
one-line logs, and systemd's notify protocol.

- `MetricsServer`: a deliberately tiny HTTP/1.1 server (GET only, one request per
  connection, request head bounded to 8 KiB and 5 s) for `/metrics` (Prometheus
  text format from `agentd._metrics.REGISTRY`), `/healthz` (the process answers),
  `/readyz` (200 once `ready()` says the bus listens and the kernel is open, else
  503). Anything else is 404. It binds where `metrics.listen` says (loopback in
  the defaults); nothing is ever sent off the host.
- `setup_logging`: one line a record on stderr, `key=value` or JSON.
- `sd_notify`: a datagram to `$NOTIFY_SOCKET` (`@name` is an abstract socket);
  `watchdog_pinger` sends `WATCHDOG=1` every half `$WATCHDOG_USEC` (the daemon's
  only watchdog).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agentd import _metrics

log = logging.getLogger("agentd.metrics")

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT_S = 2.0  # the request head, and the answer's write, each
# Connections served at once: a scraper needs one; past this a new one is closed at
# once, so idle sockets cannot take the daemon's descriptors from the bus.
MAX_CONNECTIONS = 32


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


class MetricsServer:
    def __init__(self, listen: str = "127.0.0.1:9464", ready: Callable[[], bool] = lambda: True):
        self.host, self._port = _split_listen(listen)
        self.ready = ready
        self._server: asyncio.Server | None = None
        self.connections = 0  # being served now

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self.host, self._port, limit=MAX_REQUEST_HEAD
        )
        log.info("metrics listening url=http://%s:%d/metrics", self.host, self.port)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the metrics server is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= MAX_CONNECTIONS:
            writer.transport.abort()
            return
        self.connections += 1
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, ValueError):
                await self._respond(writer, 431, b"request too large or incomplete\n")
                return
            except TimeoutError:
                return
            status, body, ctype = self.route(head)
            async with asyncio.timeout(REQUEST_TIMEOUT_S):  # a client that does not read
                await self._respond(writer, status, body, ctype)
        except (ConnectionError, OSError, TimeoutError):
            pass
        finally:
            self.connections -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def route(self, head: bytes) -> tuple[int, bytes, str]:
        """(status, body, content type) for a request head; pure, so testable."""
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, b"bad request\n", "text/plain"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, b"method not allowed\n", "text/plain"
        if target == "/metrics":
            return 200, generate_latest(_metrics.REGISTRY), CONTENT_TYPE_LATEST
        if target == "/healthz":
            return 200, b"ok\n", "text/plain"
        if target == "/readyz":
            try:
                ok = bool(self.ready())
            except Exception:
                ok = False
            return (200, b"ready\n", "text/plain") if ok else (503, b"not ready\n", "text/plain")
        return 404, b"not found\n", "text/plain"

    @staticmethod
    async def _respond(
        writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "text/plain"
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  431: "Request Header Fields Too Large", 503: "Service Unavailable"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            "Cache-Control: no-store\r\n\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()


# ---------------------------------------------------------------------------- logs

_RESERVED = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


def _kv_value(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return json.dumps(text)


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=info logger=agentd.bus msg="..."`, one line a record."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_kv_value(record.getMessage())}",
        ]
        for key, value in vars(record).items():
            if key not in _RESERVED:
                parts.append(f"{key}={_kv_value(value)}")
        if record.exc_info:
            parts.append(f"exc={_kv_value(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        doc: dict[str, object] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED:
                doc[key] = value if isinstance(value, int | float | bool) else str(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup_logging(fmt: str = "kv", level: str | int = "INFO") -> logging.Handler:
    """Route every log record to stderr, one line each (under systemd: the journal)."""
    if fmt not in ("kv", "json"):
        raise ValueError(f"log format must be kv or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.getLogger("agentd.bus.websockets").setLevel(logging.WARNING)
    return handler


# ---------------------------------------------------------------------------- systemd


def sd_notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1") to systemd. False when not under systemd or the
    send failed; never raises (notification is best effort)."""
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        return False  # vsock and other forms are not used for a local daemon
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
        return True
    except OSError as exc:
        log.debug("sd_notify failed: %s", exc)
        return False


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Half of `$WATCHDOG_USEC` in seconds, if systemd watches this process: the
    variable is set, `$NOTIFY_SOCKET` too, and `$WATCHDOG_PID` is unset or our pid
    (a child that inherited the environment must not ping for its parent)."""
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) <= 0 or not env.get("NOTIFY_SOCKET"):
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2e6


async def watchdog_pinger(
    environ: Mapping[str, str] | None = None,
    sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
) -> None:
    """Send WATCHDOG=1 now and then every half period, from the event loop: a wedged
    loop stops the pings and lets systemd restart the service. Returns at once when
    the watchdog is off for this process. `sleep` is a seam for tests."""
    interval = watchdog_interval(environ)
    if interval is None:
        return
    while True:
        sd_notify("WATCHDOG=1", environ)
        await sleep(interval)


__all__ = [
    "JsonFormatter",
    "KeyValueFormatter",
    "MetricsServer",
    "sd_notify",
    "setup_logging",
    "watchdog_interval",
    "watchdog_pinger",
]
