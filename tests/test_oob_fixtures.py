"""Shared helpers for the OOB and agentctl tests (no tests here).

`ServerThread` runs a real `OobServer` on a real Unix socket in an event loop of its
own thread, so blocking clients (OobClient, click's CliRunner, subprocesses) can
talk to it from the test. `FakeCommands` answers the five commands the way the
daemon's implementation will, in shape if not in substance.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from lxml import etree

from agentd.oob import (
    CommandFailed,
    OobServer,
    authorized_keys_line,
    result_element,
    write_private_key,
)

THREAD = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"
XSD = '<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema"/>'


class FakeCommands:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.on_shutdown: Any = None

    async def run(self, name: str, args: Mapping[str, str]) -> etree._Element | str:
        self.calls.append((name, dict(args)))
        if name == "status":
            return result_element("status", {
                "organism": "hello", "uptime_s": 12.5, "config_sha256": "abc123",
                "listeners": ["calculator.add", "greeter"], "threads": 3, "queue_depth": 0,
            })
        if name == "reload":
            return result_element("reload", {
                "added": ["new.one"], "removed": [], "changed": ["greeter"], "version": 2,
                "dry_run": args.get("dry-run") == "true",
            })
        if name == "introspect":
            return self._introspect(args)
        if name == "journal":
            # Built by hand, as XML with attributes: a typed list of entries.
            el = etree.Element("journal", type="list")
            limit = int(args.get("limit", "2"))
            for seq in range(1, limit + 1):
                etree.SubElement(el, "entry", seq=str(seq),
                                 thread=args.get("thread", THREAD)).text = f"message {seq}"
            return el
        if name == "shutdown":
            if self.on_shutdown is not None:
                self.on_shutdown()
            return result_element("shutdown", {"mode": args.get("mode", "graceful")})
        if name == "explode":
            raise RuntimeError("a bug in a command")
        if name == "huge":
            return "x" * (2 << 20)
        if name == "control-char":
            return "bell \x07"
        raise CommandFailed("unknown-command", f"no command {name!r}")

    def _introspect(self, args: Mapping[str, str]) -> etree._Element | str:
        what = args.get("what")
        if what == "capabilities":
            el = etree.Element("capabilities", type="list")
            lst = etree.SubElement(el, "listener", name="calculator.add", kind="tool")
            etree.SubElement(lst, "description").text = "Adds two integers."
            return el
        if what in ("schema", "example", "prompt"):
            if args.get("name") != "calculator.add":
                raise CommandFailed("invalid", f"no listener {args.get('name')!r}")
            return {"schema": XSD, "example": "<add><a>1</a><b>2</b></add>",
                    "prompt": "You add numbers.\nTwo of them."}[what]
        if what == "threads":
            el = etree.Element("threads", type="list")
            etree.SubElement(el, "thread", uuid=THREAD, owner="alice")
            return el
        if what == "thread":
            return result_element("thread", {
                "uuid": args.get("thread", ""), "path": "alice.relay.calculator.add"})
        raise CommandFailed("invalid", f"unknown introspection {what!r}")


def make_key(directory: Path, key_id: str = "ops-1") -> tuple[Ed25519PrivateKey, Path, str]:
    """A private key file (mode 0600, key-id as comment) and its authorized_keys line."""
    key = Ed25519PrivateKey.generate()
    path = directory / f"{key_id}.key"
    write_private_key(path, key, key_id)
    return key, path, authorized_keys_line(key.public_key(), key_id)


class ServerThread:
    """A started OobServer in a background event loop; a context manager."""

    def __init__(self, socket_path: Path, authorized_keys: Path,
                 commands: Any = None, **kwargs: Any) -> None:
        self.commands = commands if commands is not None else FakeCommands()
        self.audit: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.server = OobServer(socket_path, authorized_keys, self.commands,
                                audit=self._record, **kwargs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def _record(self, kind: str, fields: Mapping[str, str]) -> None:
        with self._lock:
            self.audit.append((kind, dict(fields)))

    def kinds(self) -> list[str]:
        with self._lock:
            return [kind for kind, _ in self.audit]

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        try:
            self.run(self.server.start())
        except BaseException:
            self._stop_loop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.server.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
