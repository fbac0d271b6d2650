"""A federation peer played by the test: it dials a real daemon's /federation
endpoint, authenticates with an identity the daemon declares, and sends raw frames,
so tests can send what a hostile organism would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from agentd._envelope import build_envelope
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import to_xml
from agentd.bus import client_context
from agentd.federation import Handshake, Identity, Role, tls_exporter
from agentd.federation._frames import lines


@contextlib.asynccontextmanager
async def _explained(peer: RawPeer, timeout: float) -> AsyncIterator[None]:
    """A timeout whose error lists the frames received (what the test waited among)."""
    try:
        async with asyncio.timeout(timeout):
            yield
    except TimeoutError:
        raise AssertionError(f"timed out; frames received: {peer.received}") from None


class RawPeer:
    def __init__(self, identity: Identity, daemon_name: str, daemon_key: Any) -> None:
        self.identity = identity
        self.daemon_name = daemon_name
        self.daemon_key = daemon_key
        self.ws: ClientConnection | None = None
        self.received: list[dict[str, Any]] = []
        self._taken: set[int] = set()  # indexes in `received` that `next` returned

    async def connect(self, port: int) -> RawPeer:
        self.ws = await connect(f"wss://127.0.0.1:{port}/federation",
                                ssl=client_context(verify=False), proxy=None)
        binding = tls_exporter(self.ws.transport.get_extra_info("ssl_object"))
        hs = Handshake(Role.DIALER, self.identity, binding,
                       {self.daemon_name: self.daemon_key}, expect=self.daemon_name)
        for frame in hs.start():
            await self.ws.send(frame)
        async with asyncio.timeout(10):
            while not hs.done:
                for frame in hs.receive(await self.ws.recv(decode=False)):
                    await self.ws.send(frame)
        return self

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    def envelope(self, payload: Any, to: str | None, sender: str | None = None) -> str:
        body = payload if isinstance(payload, bytes) else to_xml(payload)
        data = build_envelope(sender or self.identity.name, str(uuid.uuid4()),
                              c14n(parse_untrusted(body)), to)
        return data.decode()

    async def send(self, frame: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(frame))

    async def call(self, call_id: str, payload: Any, to: str | None,
                   sender: str | None = None, again: bool = False) -> None:
        """`again`: this call id may have been sent before (as an honest peer marks
        every resend), so the daemon checks its journal for it."""
        frame = {"t": "call", "id": call_id, "envelope": self.envelope(payload, to, sender)}
        await self.send({**frame, "again": True} if again else frame)

    async def next(self, kind: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The first frame of `kind` (with fields equal to `match`) not returned yet,
        in arrival order: a reply may arrive before its call's `accepted`."""
        assert self.ws is not None
        seen = 0
        async with _explained(self, timeout):
            while True:
                for i, frame in enumerate(self.received[seen:], start=seen):
                    if (i not in self._taken and frame.get("t") == kind
                            and all(frame.get(k) == v for k, v in match.items())):
                        self._taken.add(i)
                        return frame
                seen = len(self.received)
                await self._receive()

    async def next_of_call(self, call_id: str, timeout: float = 30.0) -> str:
        """`accepted` or the refusal code of the call `call_id`."""
        async with asyncio.timeout(timeout):
            while True:
                for frame in self.received:
                    if frame.get("id") == call_id and frame.get("t") in ("accepted", "refused"):
                        return "accepted" if frame["t"] == "accepted" else str(frame["code"])
                await self._receive()

    async def _receive(self) -> None:
        """One message: its frames, one a line."""
        assert self.ws is not None
        self.received.extend(json.loads(line) for line in lines(await self.ws.recv()))

    async def ack(self, reply: dict[str, Any]) -> None:
        await self.send({"t": "ack", "id": reply["id"]})
