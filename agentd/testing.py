"""An in-process harness that runs a whole organism without a network.

It is how listener authors test their organisms, the way Starlette's TestClient
tests an app: `send` puts an envelope (or a payload object, wrapped) through the
same ingress checks as the bus, runs the organism until idle, and returns what was
delivered to that client on that envelope's thread, in order.

Every delivered frame gets a number in delivery order and is filed under its
(client, thread); a `send` notes the count before it submits and takes, from its
own thread's file, the frames numbered from there on. So a `send` costs the same
however many frames and threads came before it, and concurrent `send` calls each
get their own thread's frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from agentd._core import Huh
from agentd._envelope import NIL_THREAD, build_envelope
from agentd._routing import Routing
from agentd._threads import new_uuid
from agentd._wiring import kernel_options, pump_options
from agentd._xmlify import is_xmlified, spec_of
from agentd.config import OrganismConfig, load_config
from agentd.isolation import IsolationPools
from agentd.kernel import Kernel, KernelUnavailable
from agentd.pump import CORE, IntentResolver, Pump, PumpOptions


class _ThreadFrames:
    """The frames delivered on one (client, thread), with their delivery numbers."""

    __slots__ = ("data", "numbers")

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.data: list[bytes] = []

    def since(self, number: int) -> list[bytes]:
        """The frames delivered as number `number` or later."""
        return self.data[bisect_left(self.numbers, number):]


class Harness:
    """Pump and kernel over a private temporary state directory (deleted on exit),
    or over `state_dir` when given (to test recovery: open a second Harness on the
    same directory). `durable=False` runs the pump without the kernel. The pump is
    built on entry, as the daemon builds it: with `options` (default: from
    `config`), `on_security` (security events; default: logged), `intents` (default:
    the semantic router `config` describes) and `clock`."""

    def __init__(
        self,
        config: OrganismConfig,
        clients: Mapping[str, str],
        *,
        state_dir: Path | None = None,
        durable: bool = True,
        agent_handlers: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        options: PumpOptions | None = None,
        on_security: Callable[[str, Mapping[str, str]], None] | None = None,
        intents: IntentResolver | None = None,
    ) -> None:
        self.config = config
        self.clients = dict(clients)
        self.durable = durable
        self._frames: dict[tuple[str, str], _ThreadFrames] = defaultdict(_ThreadFrames)
        self._delivered = 0  # frames delivered so far: the next one's number
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="agentd-harness-")
            state_dir = Path(self._tmp.name)
        self.state_dir = state_dir
        self.kernel: Kernel | None = None
        # Without a kernel no writer process competes with the workers for a core.
        self.isolation = IsolationPools(others=2 if durable else 1)
        self._own_platform: Any = None
        # As the daemon: a platform whenever `llm` is configured (semantic routing
        # fills through it) or an agent needs one.
        if agent_handlers is None and (
                config.llm is not None or any(lst.agent is not None for lst in config.listeners)):
            from agentd.platform import make_agent_handlers

            agent_handlers = built = make_agent_handlers(config)
            self._own_platform = built.platform
        self._agent_handlers = agent_handlers
        self.routing = Routing.build(config, agent_handlers=agent_handlers)
        from agentd.semantic import SemanticRouter  # late: numpy only when a harness runs

        platform = getattr(agent_handlers, "platform", None)
        self.router = SemanticRouter.from_config(config, lambda: platform)
        # What the pump is built with on entry (once the kernel is open), as the
        # daemon builds it.
        self._options = options or pump_options(config)
        self._on_security = on_security
        self._intents = intents
        self._clock = clock
        self.pump: Pump

    @classmethod
    def from_config(cls, path: str | Path, clients: Mapping[str, str], **kwargs: Any) -> Harness:
        return cls(load_config(path), clients, **kwargs)

    async def __aenter__(self) -> Harness:
        # Listeners with `isolation:` run in worker processes, as in the daemon.
        isolated = await self.isolation.apply(self.config, agents=self._agent_handlers)
        for name, handler in isolated.items():
            self.routing.listeners[name].bind(handler)
        if self.durable:
            self.kernel = await Kernel.open(self.state_dir, kernel_options(self.config))
        self.pump = Pump(self.routing, self.clients, self._deliver, self._options, self.kernel,
                         on_security=self._on_security,
                         intents=self.router if self._intents is None else self._intents,
                         clock=self._clock)
        if self._own_platform is not None:
            self._own_platform.bind_threads(self.pump.registry)
        if self.kernel is not None:
            await self.pump.recover()
            # What was committed for a client but not yet delivered (a crash between
            # the two) is delivered now, in order, as the bus does on reconnect.
            for client in self.clients:
                for oid, thread, data in await self.kernel.outbox(client):
                    self._deliver(client, thread, data, oid)
        await self.pump.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.pump.stop()
        await self.isolation.stop()
        await self.router.aclose()
        if self._own_platform is not None:
            await self._own_platform.aclose()
        if self.kernel is not None:
            await self.kernel.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _deliver(self, client: str, thread: str, data: bytes, outbox_id: int | None) -> None:
        filed = self._frames[(client, thread)]
        filed.numbers.append(self._delivered)
        filed.data.append(data)
        self._delivered += 1
        if outbox_id is not None and self.kernel is not None:
            # The harness "connection" received it: the outbox row can go.
            tx = self.kernel.transaction()
            tx.outbox_delivered(client, outbox_id)
            self.kernel.commit(tx)

    def wrap(self, client: str, payload: Any, thread: str | None = None) -> bytes:
        """An envelope from `client` around an `@xmlify` payload object."""
        return build_envelope(client, thread or new_uuid(), spec_of(payload).to_bytes(payload))

    async def send(self, client: str, data: bytes | Any, thread: str | None = None) -> list[bytes]:
        if not isinstance(data, bytes | bytearray):
            if not is_xmlified(data):
                raise TypeError("send() takes envelope bytes or an @xmlify payload object")
            data = self.wrap(client, data, thread)
        # The answer may be delivered before submit returns (the handler runs while
        # the envelope's commit is written): count from before the submit.
        start = self._delivered
        result = await self.pump.submit(client, bytes(data))
        if result.thread == NIL_THREAD and result.code is not None:
            return [build_envelope(CORE, NIL_THREAD, Huh.of(result.code).to_bytes(), to=client)]
        await self.run_until_idle()
        filed = self._frames.get((client, result.thread))
        return filed.since(start) if filed is not None else []

    async def run_until_idle(self) -> None:
        """Until nothing is queued or running and every write is committed (so every
        client frame has been delivered)."""
        while True:
            await self.pump.join()
            handled = self.pump.handled
            if self.kernel is not None:
                # Storage failing: what was not written will not be delivered.
                with contextlib.suppress(KernelUnavailable):
                    await self.kernel.flush()
            # A commit may have released work (an approved message runs once its
            # decision is durable), which may even have run meanwhile: go round again.
            if (not self.pump.queue_depth and not self.pump.running
                    and self.pump.handled == handled):
                return

    async def fire_due(self) -> int:
        """Fire the timers and expire the approvals due by the harness's clock (a
        fake one moves only when the test moves it), then run until idle. Returns
        how many were due."""
        fired = self.pump.waits.deadlines.run_due()
        await self.run_until_idle()
        return fired

    async def end_conversation(self, thread: str) -> bool:
        """End client conversation `thread` as the operator's `end-thread` does, then
        run until idle. False if it was not an active conversation."""
        ended = self.pump.end_conversation(thread)
        await self.run_until_idle()
        return ended

    def frames(self, client: str, thread: str) -> list[bytes]:
        """Every frame delivered to `client` on `thread` so far, in order."""
        filed = self._frames.get((client, thread))
        return list(filed.data) if filed is not None else []

    async def gather(self, *sends: Any) -> list[list[bytes]]:
        """`asyncio.gather` over several `send` calls; each returns its own thread's frames."""
        return list(await asyncio.gather(*sends))
