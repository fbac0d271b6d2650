"""The replies owed to each gateway: its outbox rows sent when a link comes up (and
the live replies that arrived meanwhile, held), later replies as the pump makes
them, and rows removed only up to an unbroken run of acknowledgements
(`ReplyWindow`). Replies are durable: what a lost link did not get goes again on
the next one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentd._core import Huh
from agentd._envelope import build_envelope
from agentd._errors import HuhCode
from agentd.federation._frames import FrameTooLarge
from agentd.federation._peers import CallHost, GatewayLink


class GatewayOutbox:
    def __init__(self, host: CallHost | None,
                 send: Callable[[GatewayLink, dict[str, object]], bool],
                 tasks: set[asyncio.Task[None]]) -> None:
        self.host = host
        self._send = send  # the link's queue; raises FrameTooLarge
        self._tasks = tasks  # the federation's, cancelled on close
        # Live replies that arrived while a gateway's outbox was being loaded.
        self._held: dict[str, dict[int, tuple[str, bytes]]] = {}

    async def load(self, link: GatewayLink) -> None:
        """Send the gateway's outbox rows, and the live replies held meanwhile."""
        if self.host is None:
            return
        window = link.replies
        window.start_load()
        self._held[link.config.name] = {}
        try:
            rows = await self.host.pending(link.config.name)
        except BaseException:
            window.end_load([])
            raise
        by_id = {oid: (thread, data) for oid, thread, data in rows}
        by_id.update(self._held.pop(link.config.name, {}))
        for oid in window.end_load(list(by_id)):
            self.send_reply(link, oid, *by_id[oid])

    def send_reply(self, link: GatewayLink, outbox_id: int, thread: str, data: bytes) -> None:
        try:
            self._send(link, {"t": "reply", "id": outbox_id, "thread": thread,
                              "envelope": data.decode("utf-8")})
        except FrameTooLarge:  # the caller is told so, and acknowledges this row
            # From `core`, as the pump's own huh: the caller takes it as the answer.
            too_large = build_envelope("core", thread, Huh.of(HuhCode.TOO_LARGE).to_bytes())
            self._send(link, {"t": "reply", "id": outbox_id, "thread": thread,
                              "envelope": too_large.decode("utf-8")})

    def acknowledged(self, link: GatewayLink, outbox_id: int) -> None:
        """Outbox rows are removed up to an id; only up to an unbroken run of
        acknowledgements (`ReplyWindow`), so no unsent or uncommitted reply goes."""
        if self.host is None:
            return
        up_to = link.replies.acknowledge(outbox_id)
        if up_to is not None:
            self.host.delivered(link.config.name, up_to)
        if link.replies.needs_reload:
            task = asyncio.create_task(self.load(link))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def deliver(self, link: GatewayLink, thread: str, data: bytes, outbox_id: int) -> None:
        """A reply for an up link: sent now, or held while its outbox loads."""
        if link.replies.loading:
            self._held.setdefault(link.config.name, {})[outbox_id] = (thread, data)
            link.replies.offer(outbox_id)
        elif link.replies.offer(outbox_id):
            self.send_reply(link, outbox_id, thread, data)
