"""What one bus session asks of the organism behind it: its envelopes into the
pump, and its durable outbox (loaded at login, acknowledged frames reported).

The adapter hands `SessionFeed` the session's `Submit`, `LoadOutbox` and
`Acknowledge` actions; what the pump or the kernel answers goes back to the session,
and the actions the session returns to the adapter (`run`). No websockets here.

Invariants:
- One thread's envelopes reach the pump in the order they were received, even
  while the pump waits for room; different threads wait concurrently.
- A submit that fails is reported to the session (`submit_failed`), never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from agentd.bus._session import Action, BusSession, ConnState

log = logging.getLogger("agentd.bus")

SubmitFn = Callable[[str, bytes], Awaitable[object]]
# `Pump.submit_nowait`: admit now, or None when the pump has no room (then `submit`).
SubmitNowFn = Callable[[str, bytes], "object | None"]
RunFn = Callable[[Sequence[Action]], None]


class OutboxSource(Protocol):
    """The kernel's durable outbox, as the bus sees it."""

    async def pending(self, client: str) -> list[tuple[int, str, bytes]]:
        """(outbox_id, thread, data) not yet delivered to `client`, in order."""
        ...

    def delivered(self, client: str, outbox_id: int) -> None:
        """The frame reached the client: written to its socket, or acknowledged by a
        client that acknowledges delivery."""
        ...


class OrganismSide(Protocol):
    """The pump and the outbox as a connection reaches them (through `BusServer`)."""

    loop: asyncio.AbstractEventLoop
    outbox: OutboxSource | None
    submit: SubmitFn
    submit_nowait: SubmitNowFn | None

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]: ...


class SessionFeed:
    """One authenticated-or-authenticating session's pump submits and outbox."""

    __slots__ = ("_host", "_run", "_session", "_waiting")

    def __init__(self, session: BusSession, host: OrganismSide, run: RunFn) -> None:
        self._session = session
        self._host = host
        self._run = run
        self._waiting: dict[str, asyncio.Task[None]] | None = None  # thread -> its latest

    def submit(self, thread: str, data: bytes) -> None:
        session, host = self._session, self._host
        waiting = self._waiting
        previous = waiting.get(thread) if waiting else None
        nowait = host.submit_nowait
        if nowait is not None and (previous is None or previous.done()):
            # The common case, with no task: the pump has room and no earlier
            # envelope of this thread is still waiting for it.
            try:
                result = nowait(session.client, data)
            except Exception:
                log.exception("submit failed client=%s", session.client)
                self._run(session.submit_failed(thread))
                return
            if result is not None:
                actions = session.submitted(thread, result, host.loop.time(), len(data))
                if actions:  # usually none: the adapter's own run flushes what is queued
                    self._run(actions)
                return
        if waiting is None:
            waiting = self._waiting = {}
        waiting[thread] = host.spawn(self._submit_waiting(thread, data, previous))

    async def _submit_waiting(
        self, thread: str, data: bytes, previous: asyncio.Task[None] | None
    ) -> None:
        """One envelope into the pump, waiting for room. Envelopes on different
        threads wait concurrently (the pump journals them in the order they start,
        and a journal commit is shared by a batch); one thread's envelopes wait for
        each other, so their order is kept even while the pump waits for room."""
        session, host = self._session, self._host
        if previous is not None and not previous.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(previous)
        try:
            result = await host.submit(session.client, data)
        except Exception:
            log.exception("submit failed client=%s", session.client)
            self._run(session.submit_failed(thread))
            return
        finally:
            waiting = self._waiting
            if waiting is not None and waiting.get(thread) is asyncio.current_task():
                del waiting[thread]
        self._run(session.submitted(thread, result, host.loop.time(), len(data)))

    def load_outbox(self) -> None:
        self._host.spawn(self._replay())

    async def _replay(self) -> None:
        session, outbox = self._session, self._host.outbox
        pending = await outbox.pending(session.client) if outbox is not None else []
        if pending and session.state is ConnState.REPLAYING:
            log.info("outbox replay client=%s frames=%d", session.client, len(pending))
        self._run(session.outbox_loaded(pending))

    def acknowledge(self, ids: Sequence[int]) -> None:
        outbox = self._host.outbox
        if outbox is None:
            return
        client = self._session.client
        for outbox_id in ids:
            outbox.delivered(client, outbox_id)
