"""The scheduler: per-frame inboxes served round-robin by a fixed pool of workers.

Invariants:
- Messages on one frame are handled one at a time, in arrival order, but for the
  calls a handler sends (requests on a frame below the conversation's root): each
  runs its callee in a frame of its own, so they start in order and run at once,
  beside each other and beside the next message for the frame's holder (an agent's
  calls of one reply run in parallel). A client's requests on its conversation stay
  one at a time. A frame's inbox is in the ready queue at most once, and stays
  known while any of its messages is queued or running.
- Frames are served round-robin, so one busy frame cannot starve the others, and no
  task is created per message: `max_concurrency` workers take turns.
- `queued` counts messages admitted and not yet taken, `running` those being
  handled; ingress waits for room (`wait_for_room`) while `queued` is at the limit.
- A burst wakes one worker, and each worker that takes a message while more are
  ready wakes the next: few wake-ups (each a future and a task step) for fast
  handlers, one more worker per loop turn for slow ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from agentd._threads import Frame
from agentd._waiters import WaiterQueue
from agentd.pump.message import Message, MsgKind

log = logging.getLogger("agentd.pump")

HandleFn = Callable[[Message], Coroutine[Any, Any, None]]


class Inbox:
    """Per-frame FIFO; `scheduled` is True while the inbox is in the ready queue,
    `holding` while a message for the frame's holder is being handled, `running`
    counts its messages being handled."""

    __slots__ = ("frame", "holding", "items", "running", "scheduled")

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.items: deque[Message] = deque()
        self.scheduled = False
        self.holding = False
        self.running = 0

    def startable(self) -> bool:
        """Its next message may start now: a handler's call always, anything else
        once no other message for the holder is being handled."""
        return bool(self.items) and (not self.holding or _a_call(self.items[0]))


def _a_call(msg: Message) -> bool:
    """A call a handler sent: it runs in a frame of its own, beside others."""
    return msg.kind is MsgKind.REQUEST and msg.frame.parent is not None


class Scheduler:
    def __init__(self, handle: HandleFn, workers: int, max_queue: int) -> None:
        self._handle = handle
        self._pool_size = workers
        self.max_queue = max_queue
        self.queued = 0  # messages admitted and not yet taken by a worker
        self.running = 0  # messages being handled
        self._inboxes: dict[str, Inbox] = {}
        self._ready: deque[Inbox] = deque()
        self._idle_workers = WaiterQueue()
        self._waking = 0  # workers woken and not yet running (see put)
        self.room_waiters = WaiterQueue()  # ingress waiting for queue room
        self._idle_waiters = WaiterQueue()  # join(): waiting for nothing to do
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for i in range(self._pool_size):
            self._workers.append(asyncio.create_task(self._worker(), name=f"pump-worker-{i}"))

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()

    def has_inbox(self, uuid: str) -> bool:
        """True while messages for the frame `uuid` are queued or being handled."""
        return uuid in self._inboxes

    def free(self, uuid: str) -> bool:
        """True when a worker would take a message for the frame `uuid` at once:
        the workers run, one is free, nothing else is queued and nothing for the
        frame is queued or running."""
        return (not self.queued and self.running < self._pool_size and bool(self._workers)
                and uuid not in self._inboxes)

    def waiting(self, uuid: str) -> bool:
        """True while messages for the frame `uuid` are queued and not yet taken."""
        inbox = self._inboxes.get(uuid)
        return inbox is not None and bool(inbox.items)

    def put(self, msg: Message) -> None:
        uuid = msg.frame.uuid
        inbox = self._inboxes.get(uuid)
        if inbox is None:
            inbox = self._inboxes[uuid] = Inbox(msg.frame)
        inbox.items.append(msg)
        self.queued += 1
        if not inbox.scheduled and inbox.startable():
            inbox.scheduled = True
            self._ready.append(inbox)
            if not self._waking and self._idle_workers.wake_one():
                self._waking += 1

    async def wait_for_room(self, loop: asyncio.AbstractEventLoop) -> None:
        while self.queued >= self.max_queue:
            await self.room_waiters.park(loop)

    async def join(self) -> None:
        """Run until idle: return once nothing is queued or running."""
        while self.queued or self.running:
            await self._idle_waiters.park(asyncio.get_running_loop())

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        ready = self._ready
        idle = self._idle_workers
        handle = self._handle
        while True:
            if not ready:
                fut = idle.park(loop)
                try:
                    await fut
                finally:
                    if fut.done() and not fut.cancelled():
                        self._waking -= 1
                continue
            inbox = ready.popleft()
            msg = inbox.items.popleft()
            holds = not _a_call(msg)
            inbox.running += 1
            if holds:
                inbox.holding = True
            if not inbox.startable():
                inbox.scheduled = False
            else:  # a call: what follows it may start beside it
                ready.append(inbox)
            if ready and not self._waking and idle.wake_one():
                self._waking += 1  # more is ready: let the next worker start on it
            self.queued -= 1
            self.running += 1
            try:
                await handle(msg)
            except Exception:  # a pump bug must not kill the worker
                log.exception("pump error while handling a message")
            finally:
                self.running -= 1
                # An idle worker must not keep its last message (and its payload)
                # alive until its next one: every worker would hold one.
                del msg
            inbox.running -= 1
            if holds:
                inbox.holding = False
            if not inbox.scheduled and inbox.startable():
                inbox.scheduled = True
                ready.append(inbox)
            elif not inbox.scheduled and not inbox.items and not inbox.running:
                del self._inboxes[inbox.frame.uuid]
            del inbox
            if self.room_waiters and self.queued < self.max_queue:
                self.room_waiters.wake_one()
            if not self.queued and not self.running and self._idle_waiters:
                self._idle_waiters.wake_all()
