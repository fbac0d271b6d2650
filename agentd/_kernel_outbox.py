"""The kernel's durable outbox as its readers see it: `KernelOutbox`, the bus's
view (frames pending per client, delivery marks coalesced into one transaction
per loop iteration and kept for another try when it fails), and `FederationHost`,
what the federation needs to serve a peer's calls (the pump, and one range
delete per gateway for acknowledged replies). Only the kernel writes; these
only batch the marks they hand it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from agentd.config import OrganismConfig
from agentd.kernel import Kernel, KernelUnavailable, Transaction
from agentd.pump import Pump

log = logging.getLogger("agentd.daemon")

_MARK_RETRY_S = 0.5  # delivery marks whose transaction failed are tried again this late


class KernelOutbox:
    """The bus's view of the kernel's durable outbox. Delivery marks are coalesced:
    the frames written in one loop iteration are deleted by one transaction. Each
    by its id: a client may hold several connections, and a frame written to one
    says nothing of older frames still queued on another (deleting up to an id
    would lose those if the daemon died before they were written). Marks whose
    transaction failed (the kernel's writer died) are kept and tried again: dropped,
    their frames were sent a second time at the client's next connection."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self._marks: dict[str, list[int]] = {}
        self._flush_due = False

    async def pending(self, client: str) -> list[tuple[int, str, bytes]]:
        return await self.kernel.outbox(client)

    def delivered(self, client: str, outbox_id: int) -> None:
        # Once a frame (every answer a bus client gets): no list made to be dropped
        # by setdefault, no call once a flush is due.
        ids = self._marks.get(client)
        if ids is None:
            self._marks[client] = [outbox_id]
        else:
            ids.append(outbox_id)
        if not self._flush_due:
            self._schedule(0.0)

    def _schedule(self, delay: float) -> None:
        if not self._flush_due:
            self._flush_due = True
            loop = asyncio.get_running_loop()
            if delay:
                loop.call_later(delay, self._flush)
            else:
                loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        marks, self._marks = self._marks, {}
        if marks:
            self._commit(marks, Transaction.outbox_sent, self._keep)

    def _keep(self, marks: Mapping[str, Any]) -> None:
        for client, ids in marks.items():
            self._marks.setdefault(client, []).extend(ids)

    def _commit(self, marks: Mapping[str, Any],
                mark: Callable[[Transaction, str, Any], None],
                keep: Callable[[Mapping[str, Any]], None]) -> None:
        """One transaction with `mark(tx, client, value)` for each client's marks; if
        it fails, `keep(marks)` puts them back and a flush is tried again later."""
        tx = self.kernel.transaction()
        for client, value in marks.items():
            mark(tx, client, value)

        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or fut.exception() is not None:
                if not fut.cancelled():
                    log.warning("outbox delivery marks not written (%s); trying again",
                                fut.exception())
                keep(marks)
                self._schedule(_MARK_RETRY_S)

        try:
            self.kernel.commit(tx).add_done_callback(done)
        except KernelUnavailable as exc:  # closed: the next daemon replays the frames
            log.warning("outbox delivery marks not written: %s", exc)


class FederationHost(KernelOutbox):
    """What the federation needs to serve a peer's calls: the pump, where a gateway
    is a client under its own name, and the kernel's outbox of its replies."""

    def __init__(self, kernel: Kernel, pump: Pump, config: Callable[[], OrganismConfig]) -> None:
        super().__init__(kernel)
        self.pump = pump
        self.config = config  # the configuration in force (a reload replaces it)
        self._up_to: dict[str, int] = {}

    def delivered(self, client: str, outbox_id: int) -> None:
        """A peer acknowledged every reply up to `outbox_id` (the link only says so
        for an unbroken run): one range delete per gateway and loop iteration."""
        if outbox_id > self._up_to.get(client, 0):
            self._up_to[client] = outbox_id
        self._schedule(0.0)

    def _flush(self) -> None:
        self._flush_due = False
        marks, self._up_to = self._up_to, {}
        if marks:
            self._commit(marks, Transaction.outbox_delivered, self._keep_up_to)

    def _keep_up_to(self, marks: Mapping[str, Any]) -> None:
        for client, up_to in marks.items():
            if up_to > self._up_to.get(client, 0):
                self._up_to[client] = up_to

    def offers(self, names: list[str]) -> list[Any]:
        from agentd.federation import offer_of

        config = self.config()
        known = {lst.name for lst in config.listeners if ":" not in lst.name}
        return [offer_of(config.listener(n)) for n in names if n in known]

    def local_classes(self) -> dict[tuple[str, str], type]:
        from agentd.federation import classes_by_root

        return classes_by_root(self.config().listeners)

    async def submit(self, client: str, data: bytes, parsed: Any = None, hops: int = 0,
                     traceparent: str = "") -> Any:
        return await self.pump.submit(client, data, parsed, hops, traceparent)

    async def thread_exists(self, thread: str, durable: bool) -> bool:
        return self.pump.registry.get(thread) is not None or (
            durable and await self.kernel.thread(thread) is not None)
