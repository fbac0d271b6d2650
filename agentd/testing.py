"""An in-process harness that runs a whole organism without a network.

It is how listener authors test their organisms, the way Starlette's TestClient
tests an app: `send` puts an envelope (or a payload object, wrapped) through the
same ingress checks as the bus, runs the organism until idle, and returns what was
delivered to that client on that envelope's thread, in order.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from agentd._config import OrganismConfig, load_config
from agentd._core import Huh
from agentd._envelope import NIL_THREAD, build_envelope
from agentd._pump import CORE, Pump, PumpSettings
from agentd._routing import Routing
from agentd._threads import new_uuid
from agentd._xmlify import is_xmlified, spec_of


def settings_from(config: OrganismConfig) -> PumpSettings:
    p = config.pump
    return PumpSettings(
        max_concurrency=p.max_concurrency,
        per_listener_concurrency=p.per_listener_concurrency,
        handler_timeout_s=p.handler_timeout_s,
        max_hops=p.max_hops,
        max_queue=p.max_queue,
        max_fanout=p.max_fanout,
        max_envelope_bytes=config.bus.max_envelope_bytes,
    )


class Harness:
    def __init__(self, config: OrganismConfig, clients: Mapping[str, str]) -> None:
        self.config = config
        self.clients = dict(clients)
        self._frames: dict[tuple[str, str], list[bytes]] = defaultdict(list)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.routing = Routing.build(config)
        self.pump = Pump(self.routing, self.clients, self._deliver, settings_from(config))

    @classmethod
    def from_config(cls, path: str | Path, clients: Mapping[str, str]) -> Harness:
        # The state directory is private to the harness and deleted on exit.
        tmp = tempfile.TemporaryDirectory(prefix="agentd-harness-")
        harness = cls(load_config(path, state_dir_override=Path(tmp.name)), clients)
        harness._tmp = tmp
        return harness

    async def __aenter__(self) -> Harness:
        await self.pump.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.pump.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _deliver(self, client: str, thread: str, data: bytes) -> None:
        self._frames[(client, thread)].append(data)

    def wrap(self, client: str, payload: Any, thread: str | None = None) -> bytes:
        """An envelope from `client` around an `@xmlify` payload object."""
        return build_envelope(client, thread or new_uuid(), spec_of(payload).to_bytes(payload))

    async def send(self, client: str, data: bytes | Any, thread: str | None = None) -> list[bytes]:
        if not isinstance(data, bytes | bytearray):
            if not is_xmlified(data):
                raise TypeError("send() takes envelope bytes or an @xmlify payload object")
            data = self.wrap(client, data, thread)
        result = await self.pump.submit(client, bytes(data))
        if result.thread == NIL_THREAD and result.code is not None:
            return [build_envelope(CORE, NIL_THREAD, Huh.of(result.code).to_bytes(), to=client)]
        key = (client, result.thread)
        start = len(self._frames[key]) - 1  # the accepted/huh just emitted
        await self.pump.join()
        return list(self._frames[key][start:])

    async def run_until_idle(self) -> None:
        await self.pump.join()

    def frames(self, client: str, thread: str) -> list[bytes]:
        return list(self._frames.get((client, thread), ()))

    async def gather(self, *sends: Any) -> list[list[bytes]]:
        return list(await asyncio.gather(*sends))
