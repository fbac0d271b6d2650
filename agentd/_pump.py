"""The message pump: the one path every message takes.

    bytes -> hardened parse -> envelope schema -> profile route -> payload schema
          -> (journal) -> per-thread queue -> handler -> HandlerResponse
          -> serialise -> envelope bytes -> hardened parse -> ... (zero-trust re-entry)

Invariants:
- A client's envelope and a handler's output enter through the same functions
  (`_ingest_request`, `_ingest_to_holder`) after the same `parse_envelope`; nothing
  a handler returns is trusted for identity, thread or route. The pump sets `from`
  (the listener's registered name) and `thread` (from the registry) itself.
- The route is resolved against the pinned dispatch table of the message's thread
  on every hop; a missing route and an out-of-profile route are indistinguishable.
- Messages on one thread are handled one at a time, in order; threads are served
  round-robin by a fixed pool of workers (`max_concurrency`), so one busy thread
  cannot starve the others and no task is created per message.
- Queues are bounded: client ingress waits for room (backpressure); handler output
  beyond a hard cap is refused with `huh rate-limited` to its producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from lxml import etree

from agentd import _meta as meta
from agentd import _metrics as metrics
from agentd._core import Accepted, Ack, Answer, CorePayload, Huh, core_from_element
from agentd._envelope import (
    NIL_THREAD,
    Envelope,
    PrivilegedOnBus,
    build_envelope,
    parse_envelope,
)
from agentd._errors import HuhCode, Rejection
from agentd._handler import HandlerMetadata, HandlerResponse, ResponseKind
from agentd._routing import Listener, Profile, Routing
from agentd._schemas import NS_CORE, schema
from agentd._threads import Frame, ThreadRegistry, ThreadState
from agentd._xml import c14n, parse_untrusted
from agentd._xmlify import XmlSpec, is_xmlified, spec_of
from agentd.config import MetaConfig, PumpConfig
from agentd.kernel import Kernel, KernelUnavailable, ThreadRow, Transaction

log = logging.getLogger("agentd.pump")

CORE = "core"
_CORE_PREFIX = "{" + NS_CORE + "}"
_CORE_SCHEMA = schema(NS_CORE)
_ANSWER = _CORE_PREFIX + "answer"
_XML_DECL = re.compile(rb"^\s*<\?xml[^>]*\?>")

# (client id, thread uuid, envelope bytes, outbox id) -> None; must not block. The
# outbox id is set for frames kept in the kernel's durable outbox until delivered.
DeliverFn = Callable[[str, str, bytes, "int | None"], None]

# Journal kinds of pump traffic: a request is routed by key, a reply goes to the
# holder of its frame. The suffix is the message's hop count (kept across restarts).
_REQUEST, _REPLY = "request", "reply"


def _kind(to_holder: bool, hops: int) -> str:
    return f"{_REPLY if to_holder else _REQUEST}/{hops}"


# Journal kinds by hop count, prebuilt (one is needed per journaled message).
_KINDS = {to_holder: tuple(_kind(to_holder, h) for h in range(64)) for to_holder in (False, True)}


class MsgKind(Enum):
    REQUEST = "request"  # routed by payload key; runs the callee in a child frame
    TO_HOLDER = "to-holder"  # a response, ack or huh for the holder of the frame


class Message:
    """A message admitted into the pump. Everything but `payload` is trusted."""

    __slots__ = (
        "envelope",
        "frame",
        "hops",
        "kind",
        "payload",
        "redelivered",
        "sender",
        "seq",
        "spec",
        "targets",
    )

    def __init__(
        self,
        kind: MsgKind,
        sender: str,
        frame: Frame,
        payload: etree._Element,
        targets: tuple[Listener, ...],
        spec: XmlSpec | None,
        envelope: bytes,
        seq: int = 0,
        redelivered: bool = False,
    ) -> None:
        self.kind = kind
        self.sender = sender
        self.frame = frame
        self.payload = payload
        self.targets = targets  # REQUEST: the callees; TO_HOLDER: () for a client holder
        self.spec = spec  # None for core payloads
        self.envelope = envelope
        self.seq = seq
        self.redelivered = redelivered
        self.hops = 0  # handler invocations on the causal chain before this message

    @property
    def is_core(self) -> bool:
        return self.spec is None


@dataclass(frozen=True)
class SubmitResult:
    """What became of a client envelope: `seq` if accepted, else `code`."""

    thread: str
    seq: int | None = None
    code: HuhCode | None = None

    @property
    def accepted(self) -> bool:
        return self.code is None


class _Inbox:
    """Per-frame FIFO; `scheduled` is True while the frame is queued or running."""

    __slots__ = ("frame", "items", "scheduled")

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.items: deque[Message] = deque()
        self.scheduled = False


class Pump:
    def __init__(
        self,
        routing: Routing,
        clients: Mapping[str, str],
        deliver: DeliverFn,
        settings: PumpConfig | None = None,
        kernel: Kernel | None = None,
        *,
        max_envelope_bytes: int = 256 * 1024,
    ) -> None:
        self.routing = routing
        self.clients = dict(clients)  # client id -> profile name
        self.deliver = deliver
        self.settings = settings or PumpConfig()
        self.max_envelope_bytes = max_envelope_bytes
        self.registry = ThreadRegistry()
        # With a kernel, every admitted message is journaled (pending until handled),
        # frames are persisted, and client-bound frames go through the outbox: the
        # writes of one handled message form one transaction, built in `_tx` during
        # the synchronous part of handling (no await happens while `_tx` is open).
        self.kernel = kernel
        # Security events (forged from, priv payloads, peer violations) go here too;
        # the daemon journals them as entries of kind `security`.
        self.on_security: Callable[[str, Mapping[str, str]], None] | None = None
        self.meta_flags = MetaConfig()  # meta introspection on the bus: all off by default
        self._tx: Transaction | None = None
        self._post: list[tuple[str, str, bytes, int | None]] = []
        self._inboxes: dict[str, _Inbox] = {}
        self._ready: deque[_Inbox] = deque()
        self._idle_workers: deque[asyncio.Future[None]] = deque()
        self._waking = 0  # workers woken and not yet running (see _wake_worker)
        self._workers: list[asyncio.Task[None]] = []
        self._queued = 0  # messages admitted and not yet handled
        self._running = 0  # messages being handled
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._seq = 0
        self._hard_cap = self.settings.max_queue * 2
        self.handled = 0  # handler invocations, for benchmarks and status
        # Handler timeouts: one watchdog scans the running calls' deadlines a few
        # times per timeout period. `asyncio.timeout()` per call costs ~5 us a hop.
        self._deadlines: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        # Kept: asyncio.get_running_loop() costs a getpid() system call on every call
        # (its fork check), several times a message on the hot path.
        self._loop = asyncio.get_running_loop()
        for i in range(self.settings.max_concurrency):
            self._workers.append(asyncio.create_task(self._worker(), name=f"pump-worker-{i}"))
        self._workers.append(asyncio.create_task(self._watchdog(), name="pump-watchdog"))

    def _tick(self) -> float:
        shortest = min(
            (lst.timeout_s for lst in self.routing.listeners.values()),
            default=self.settings.handler_timeout_s,
        )
        return min(1.0, max(0.005, shortest / 10))

    async def _watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._tick())
            now = loop.time()
            for task, deadline in list(self._deadlines.items()):
                if now >= deadline:
                    # Cancelled again on each tick while a handler swallows it.
                    self._expired.add(task)
                    task.cancel()

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()

    async def join(self) -> None:
        """Run until idle: return once nothing is queued or running."""
        while self._queued or self._running:
            fut = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(fut)
            await fut

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return self._running

    # ---- client ingress --------------------------------------------------

    async def submit(self, client: str, data: bytes) -> SubmitResult:
        """Admit one envelope from an authenticated client. The client is sent one
        `accepted` or one `huh` (through `deliver`), then whatever comes back. Waits
        for room in the pump, and with a kernel for the envelope's journal commit."""
        while self._queued >= self.settings.max_queue:
            fut = (self._loop or asyncio.get_running_loop()).create_future()
            self._room_waiters.append(fut)
            await fut
        result = self._submit_now(client, data, True)
        if isinstance(result, SubmitResult):
            return result
        return await result

    def submit_nowait(self, client: str, data: bytes) -> SubmitResult | None:
        """`submit` for a caller that cannot wait (the bus reads the next frame at
        once): None if the pump has no room now (call `submit` instead). Otherwise the
        envelope is admitted now and the client is told the outcome through `deliver`
        exactly as with `submit`. The result is final for a refusal; for an envelope
        being journaled it is provisional (`seq` set): if that commit fails, the
        client gets `huh internal` and nothing is acknowledged."""
        if self._queued >= self.settings.max_queue or self._room_waiters:
            return None
        result = self._submit_now(client, data, False)
        assert isinstance(result, SubmitResult)
        return result

    def _submit_now(
        self, client: str, data: bytes, wait: bool
    ) -> SubmitResult | asyncio.Future[SubmitResult]:
        """Parse, check, route and admit `data` without awaiting anything. With a
        kernel and `wait`, returns a future for the outcome of the journal commit."""
        metrics.HOT.received += 1
        thread = NIL_THREAD
        try:
            env = parse_envelope(data, max_bytes=self.max_envelope_bytes)
            thread = env.thread
            if env.sender != client:
                self._security_event("forged-from", client=client, claimed=env.sender)
                raise Rejection(HuhCode.INVALID_ENVELOPE, "from does not match the client")
            is_new = self.registry.get(env.thread) is None
            msg = self._ingest_client(client, env, data)
        except PrivilegedOnBus:
            self._security_event("priv-on-bus", client=client)
            return self._refuse_client(client, thread, HuhCode.UNROUTABLE)
        except Rejection as rej:
            log.info("rejected client=%s code=%s detail=%s", client, rej.code.value, rej.detail)
            return self._refuse_client(client, thread, rej.code)
        frame = msg.frame
        meta_answer = msg.sender == CORE  # answered by the pump itself (agentd/_meta.py)
        if self.kernel is None:
            self._seq += 1
            msg.seq = 0 if meta_answer else self._seq
            self._emit_core(client, frame.uuid, Accepted(frame.uuid, self._seq).to_bytes())
            self._enqueue(msg)
            return SubmitResult(frame.uuid, seq=self._seq)
        # The transaction that makes the envelope durable: its thread (if new) and
        # its journal entry.
        tx = self.kernel.transaction()
        if is_new:
            tx.thread_put(_row(frame))
            frame.persisted = True
        if meta_answer:
            seq = tx.journal(
                thread=frame.uuid, direction="in", kind="meta", sender=client,
                tag=env.key, payload=data, profile=frame.profile.name,
            )  # fmt: skip
        else:
            seq = msg.seq = self._journal_message(tx, msg)
        return self._admit(client, msg, tx, seq, wait, not meta_answer)

    def _admit(
        self, client: str, msg: Message, tx: Transaction, seq: int, wait: bool,
        optimistic: bool,
    ) -> SubmitResult | asyncio.Future[SubmitResult]:
        """Commit the admission `tx`; `accepted` (or `huh internal`) is sent from the
        commit callback, in commit order. `optimistic`: hand the message to its
        handler at once, while the commit is being written. Its own transaction is
        queued after this one, so it commits with it or after it, never before, and
        `accepted` always precedes the answer; if the commit fails the client gets
        `huh internal` and nothing was acknowledged, but the handler may have run
        (see docs/architecture.md). Otherwise (a meta answer) the message is queued
        only once its envelope is durable. With `wait`, returns a future for the
        outcome; without, the outcome as known now (provisional if accepted)."""
        assert self.kernel is not None
        frame = msg.frame
        outcome: asyncio.Future[SubmitResult] | None = None
        if wait:
            outcome = (self._loop or asyncio.get_running_loop()).create_future()
        refused: SubmitResult | None = None

        def admitted(exc: BaseException | None) -> None:
            nonlocal refused
            if exc is None:
                self._emit_core(client, frame.uuid, Accepted(frame.uuid, seq).to_bytes())
                if not optimistic:
                    self._open_tx()
                    self._enqueue(msg)
                    self._close_tx()
                if outcome is not None:
                    outcome.set_result(SubmitResult(frame.uuid, seq=seq))
                return
            log.error("journal unavailable, refusing client=%s: %s", client, exc)
            if (not optimistic and frame.is_root and frame.uuid not in self._inboxes
                    and not frame.children):
                self.registry.forget(frame)
            refused = self._refuse_client(client, frame.uuid, HuhCode.INTERNAL)
            if outcome is not None and not outcome.done():
                outcome.set_result(refused)

        try:
            self.kernel.commit_then(tx, admitted)
        except KernelUnavailable as exc:
            admitted(exc)
        else:
            if optimistic:
                self._enqueue(msg)
        if outcome is not None:
            return outcome
        return refused or SubmitResult(frame.uuid, seq=seq)

    def _ingest_client(self, client: str, env: Envelope, data: bytes) -> Message:
        frame = self.registry.get(env.thread)
        if frame is None:
            pname = self.clients.get(client)
            profile = self.routing.profiles.get(pname) if pname is not None else None
            if profile is None:
                raise Rejection(HuhCode.UNROUTABLE, f"client {client} has no profile")
            # The frame is registered only once every check has passed.
            frame = Frame(env.thread, (client,), None, client, profile)
            msg = self._ingest_request(
                env, data, sender=client, sender_listener=None, frame=frame, profile=profile
            )
            self.registry.restore(frame)
            return msg
        if frame.owner != client or not frame.is_root:
            raise Rejection(HuhCode.UNROUTABLE, "thread not owned by this client")
        frame.touched = time.monotonic()
        if frame.state is not ThreadState.ACTIVE:
            raise Rejection(HuhCode.UNROUTABLE, "conversation has ended")
        return self._ingest_request(
            env, data, sender=client, sender_listener=None, frame=frame, profile=frame.profile
        )

    def _refuse_client(self, client: str, thread: str, code: HuhCode) -> SubmitResult:
        metrics.envelopes_rejected.labels(code.value).inc()
        self._emit_core(client, thread, Huh.of(code).to_bytes())
        return SubmitResult(thread, code=code)

    def _emit_core(self, client: str, thread: str, payload: bytes) -> None:
        self.deliver(client, thread, build_envelope(CORE, thread, payload, to=client), None)

    def collect_idle(self, idle_s: float, now: float | None = None) -> int:
        """End conversations (and stray frames, e.g. a call whose peer never answered)
        untouched for `idle_s` seconds: the registry forgets them and the kernel marks
        them completed, so its thread GC can delete them. Deepest frames go first, so
        a conversation whose abandoned calls are collected is collected with them.
        O(frames); run periodically, never on the hot path."""
        now = time.monotonic() if now is None else now
        stale = sorted(
            (f for f in self.registry if now - f.touched > idle_s and f.uuid not in self._inboxes),
            key=lambda f: len(f.path),
            reverse=True,
        )
        ended = 0
        self._open_tx()
        for frame in stale:
            if frame.children:
                continue  # a call under it is still live
            if frame.parent is None:
                self.registry.forget(frame)
                frame.state = ThreadState.COMPLETED
            else:
                self.registry.complete(frame)
            if self._tx is not None and frame.persisted:
                self._tx.thread_state(frame.uuid, ThreadState.COMPLETED.value)
            ended += 1
        self._close_tx()
        return ended

    # ---- durability ------------------------------------------------------------

    def _journal_message(self, tx: Transaction, msg: Message) -> int:
        to_holder = msg.kind is MsgKind.TO_HOLDER
        hops, targets = msg.hops, msg.targets
        kinds = _KINDS[to_holder]
        return tx.journal(
            thread=msg.frame.uuid,
            direction="in",
            kind=kinds[hops] if hops < len(kinds) else _kind(to_holder, hops),
            handler=targets[0].name if len(targets) == 1 else ",".join(t.name for t in targets),
            sender=msg.sender,
            tag=msg.payload.tag,
            payload=msg.envelope,
            profile=msg.frame.profile.name,
            pending=True,
        )

    def _open_tx(self) -> None:
        if self.kernel is not None:
            self._tx = self.kernel.transaction()

    def _close_tx(self, handled: Message | None = None) -> None:
        """Commit what handling one message produced; client frames are handed to
        `deliver` only once their outbox rows are durable."""
        tx, self._tx = self._tx, None
        if tx is None or self.kernel is None:
            return
        if handled is not None and handled.seq:
            tx.delivered(handled.seq)
        post, self._post = self._post, []
        self.kernel.commit_then(tx, functools.partial(self._committed, post))

    def _committed(self, post: list[tuple[str, str, bytes, int | None]], exc: BaseException | None
                   ) -> None:
        if exc is not None:
            # Not acknowledged, so redelivered after a restart; the outbox rows did
            # not commit either, so nothing is shown to the client now.
            log.error("journal commit failed: %s", exc)
            return
        for client, thread, data, oid in post:
            self.deliver(client, thread, data, oid)

    async def recover(self) -> int:
        """Rebuild frames and re-queue undelivered messages from the kernel after a
        restart (at least once: handlers see `redelivered=True`). Returns the count."""
        if self.kernel is None:
            return 0
        rows = {r.uuid: r for r in await self.kernel.threads(state="active")}
        frames: dict[str, Frame] = {}

        def build(uuid: str) -> Frame | None:
            if uuid in frames:
                return frames[uuid]
            row = rows.get(uuid)
            if row is None:
                return None
            profile = self.routing.profiles.get(row.profile)
            if profile is None:
                log.warning("thread %s: profile %s no longer exists", uuid, row.profile)
                return None
            parent = build(row.parent) if row.parent else None
            if row.parent and parent is None:
                return None
            frame = Frame(row.uuid, row.path, parent, row.owner, profile)
            frame.persisted = True
            if parent is not None:
                parent.children += 1
            frames[uuid] = frame
            self.registry.restore(frame)
            return frame

        for uuid in rows:
            build(uuid)
        count = 0
        for entry in await self.kernel.pending_messages():
            msg = self._recovered(entry.kind, entry.thread, entry.payload, entry.handler, frames)
            if msg is None:
                log.warning("journal entry %d cannot be resumed; marking it handled", entry.seq)
                tx = self.kernel.transaction()
                tx.delivered(entry.seq)
                await self.kernel.commit(tx)
                continue
            msg.seq = entry.seq
            msg.redelivered = True
            self._enqueue(msg)
            count += 1
        return count

    def _recovered(
        self, kind: str, thread: str, data: bytes | None, handlers: str, frames: dict[str, Frame]
    ) -> Message | None:
        frame = frames.get(thread)
        if frame is None or data is None:
            return None
        base, _, hops = kind.partition("/")
        try:
            env = parse_envelope(data, max_bytes=max(len(data), 1))
            if base == _REQUEST:
                msg = self._resume_request(env, data, frame, handlers)
            else:
                spec = None if env.sender == CORE else self._responder_spec(env)
                msg = self._ingest_to_holder(env, data, sender=env.sender, frame=frame, spec=spec)
        except Rejection as rej:
            log.warning("recovered message refused thread=%s: %s", thread, rej.detail)
            return None
        msg.hops = int(hops or 0)
        return msg

    def _resume_request(self, env: Envelope, data: bytes, frame: Frame, handlers: str) -> Message:
        names = set(handlers.split(",")) if handlers else set()
        targets = tuple(
            t
            for t in frame.profile.table.resolve(env.key, env.to)
            if t.name in names and not t.retired
        )
        if not targets:
            raise Rejection(HuhCode.UNROUTABLE, "route gone after restart")
        spec = frame.profile.table.specs[env.key]
        _validate(spec, env.payload)
        return Message(MsgKind.REQUEST, env.sender, frame, env.payload, targets, spec, data)

    def _responder_spec(self, env: Envelope) -> XmlSpec | None:
        responder = self.routing.listeners.get(env.sender)
        if responder is None:
            raise Rejection(HuhCode.UNROUTABLE, "responder gone after restart")
        return _response_spec(responder, env)

    # ---- the shared admission checks --------------------------------------

    def _ingest_request(
        self,
        env: Envelope,
        data: bytes,
        *,
        sender: str,
        sender_listener: Listener | None,
        frame: Frame,
        profile: Profile,
    ) -> Message:
        """Route `env` against `profile`'s table (and the sender's peers), validate
        the payload against the routed schema. Raises `Rejection`."""
        key = env.key
        if sender_listener is None and key in meta.QUESTIONS:
            return self._meta_answer(env, sender, frame, profile)
        targets = profile.table.resolve(key, env.to)
        if sender_listener is not None:
            allowed = tuple(t for t in targets if sender_listener.may_send_to(t.name))
            if len(allowed) != len(targets) and (env.to is not None or not allowed):
                log.warning(
                    "peer violation blocked listener=%s to=%s key=%s",
                    sender_listener.name,
                    env.to,
                    key,
                )
                self._security_event("peer-violation", listener=sender_listener.name)
                raise Rejection(HuhCode.UNROUTABLE, "destination is not a declared peer")
            targets = allowed
        if len(targets) != 1 or targets[0].retired:
            targets = tuple(t for t in targets if not t.retired)
        if not targets:
            raise Rejection(HuhCode.UNROUTABLE, f"no route for {key}")
        spec = profile.table.specs[key]
        _validate(spec, env.payload)
        return Message(MsgKind.REQUEST, sender, frame, env.payload, targets, spec, data)

    def _meta_answer(self, env: Envelope, client: str, frame: Frame, profile: Profile) -> Message:
        """A client's meta question, answered by the pump itself from the client's own
        profile (agentd/_meta.py). The answer is built as bytes and re-parsed."""
        _validate_core(env.payload)
        body = meta.answer(self.meta_flags, profile, env.payload)
        data = build_envelope(CORE, frame.uuid, body, to=client)
        reply = parse_envelope(data, max_bytes=max(len(data), self.max_envelope_bytes))
        return Message(MsgKind.TO_HOLDER, CORE, frame, reply.payload, (), None, data)

    def _ingest_to_holder(
        self, env: Envelope, data: bytes, *, sender: str, frame: Frame, spec: XmlSpec | None
    ) -> Message:
        """A message for the holder of `frame` (a response, ack or huh)."""
        if spec is None:
            _validate_core(env.payload)
        else:
            _validate(spec, env.payload)
        targets: tuple[Listener, ...] = ()
        if not frame.is_root:
            holder = frame.profile.table.listeners.get(frame.holder)
            if holder is None or holder.retired:
                raise Rejection(HuhCode.UNROUTABLE, "caller no longer routable")
            targets = (holder,)
        return Message(MsgKind.TO_HOLDER, sender, frame, env.payload, targets, spec, data)

    # ---- scheduling ----------------------------------------------------------

    def _enqueue(self, msg: Message) -> None:
        tx = self._tx
        if msg.kind is MsgKind.TO_HOLDER and not msg.targets:
            # The holder is the external client: deliver in order (after the commit
            # of its outbox row when durable).
            client, thread = msg.frame.owner, msg.frame.uuid
            if tx is None:
                self.deliver(client, thread, msg.envelope, None)
            else:
                tx.journal(
                    thread=thread,
                    direction="out",
                    kind=_REPLY,
                    handler=client,
                    sender=msg.sender,
                    tag=msg.payload.tag,
                    payload=msg.envelope,
                    profile=msg.frame.profile.name,
                )
                oid = tx.outbox_put(client, thread, msg.envelope)
                self._post.append((client, thread, msg.envelope, oid))
            return
        if tx is not None and not msg.seq:
            msg.seq = self._journal_message(tx, msg)
        uuid = msg.frame.uuid
        inbox = self._inboxes.get(uuid)
        if inbox is None:
            inbox = self._inboxes[uuid] = _Inbox(msg.frame)
        inbox.items.append(msg)
        self._queued += 1
        if not inbox.scheduled:
            inbox.scheduled = True
            self._ready.append(inbox)
            if not self._waking:
                self._wake_worker()

    def _wake_worker(self) -> None:
        """Wake one idle worker, unless one is already woken and not yet running: a
        burst of messages queued in one loop turn wakes one worker, and each worker
        that takes a message while more are ready wakes the next (`_worker`). Fast
        handlers then drain a burst with few wake-ups (each costs a future and a task
        step); slow ones still get one more worker per loop turn, up to the pool."""
        idle = self._idle_workers
        while idle:
            fut = idle.popleft()
            if not fut.done():
                fut.set_result(None)
                self._waking += 1
                return

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        ready = self._ready
        while True:
            if not ready:
                fut = loop.create_future()
                self._idle_workers.append(fut)
                try:
                    await fut
                finally:
                    if fut.done() and not fut.cancelled():
                        self._waking -= 1
                continue
            inbox = ready.popleft()
            if ready and not self._waking:
                self._wake_worker()  # more is ready: let the next worker start on it
            msg = inbox.items.popleft()
            self._queued -= 1
            self._running += 1
            try:
                await self._handle(msg)
            except Exception:  # a pump bug must not kill the worker
                log.exception("pump error while handling a message")
            finally:
                self._running -= 1
            if inbox.items:
                ready.append(inbox)
            else:
                inbox.scheduled = False
                del self._inboxes[inbox.frame.uuid]
            if self._room_waiters and self._queued < self.settings.max_queue:
                self._wake(self._room_waiters)
            if not self._queued and not self._running and self._idle_waiters:
                waiters, self._idle_waiters = self._idle_waiters, []
                for w in waiters:
                    if not w.done():
                        w.set_result(None)

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    # ---- handling --------------------------------------------------------------

    async def _handle(self, msg: Message) -> None:
        root = msg.frame.root
        if root.state is not ThreadState.ACTIVE or msg.hops >= self.settings.max_hops:
            self._open_tx()
            if root.state is not ThreadState.ACTIVE:
                log.info("dropped message on ended conversation thread=%s", root.uuid)
            else:
                # Two listeners ping-ponging, or a runaway chain: stop it, tell the client.
                self._stop_chain(root, HuhCode.BUDGET_EXCEEDED, "hop limit reached")
            self._close_tx(msg)
            return
        if msg.kind is MsgKind.REQUEST and len(msg.targets) > 1:
            # Broadcast: the listeners on one key run concurrently; the message counts
            # as handled once all of them have returned.
            await asyncio.gather(*(self._call(msg, t, last=False) for t in msg.targets))
            self._open_tx()
            self._close_tx(msg)
        else:
            await self._call(msg, msg.targets[0], last=True)

    async def _call(self, msg: Message, listener: Listener, *, last: bool) -> None:
        """Run one handler on one message. `last`: this call completes the message."""
        if listener.retired:
            self._open_tx()
            self._huh_to(msg.frame, HuhCode.UNROUTABLE, msg.hops + 1)
            self._close_tx(msg if last else None)
            return
        created = msg.kind is MsgKind.REQUEST
        frame = self.registry.extend(msg.frame, listener.name) if created else msg.frame
        frame.touched = time.monotonic()
        payload: Any = (
            core_from_element(msg.payload)
            if msg.spec is None
            else msg.spec.from_element(msg.payload)
        )
        meta = HandlerMetadata(frame.uuid, msg.sender, listener.name, msg.redelivered)
        handler = listener.handler
        assert handler is not None
        self.handled += 1
        loop = self._loop
        assert loop is not None  # handlers run on the workers start() made
        task = asyncio.current_task(loop)
        assert task is not None
        if listener.active >= listener.max_concurrency:
            await listener.wait_for_slot()
        listener.active += 1
        started = time.perf_counter()
        self._deadlines[task] = loop.time() + listener.timeout_s
        failure: HuhCode | None = None
        try:
            result = await handler(payload, meta)
        except asyncio.CancelledError:
            if task not in self._expired:
                raise  # the pump is stopping
        except Exception:
            log.exception("handler raised listener=%s thread=%s", listener.name, frame.uuid)
            failure = HuhCode.INTERNAL
        finally:
            listener.release_slot()
            del self._deadlines[task]
            if task in self._expired:  # also when the handler swallowed the cancel
                self._expired.discard(task)
                task.uncancel()
                log.warning("handler timed out listener=%s thread=%s", listener.name, frame.uuid)
                failure = HuhCode.TIMEOUT
        self._open_tx()
        if failure is not None:
            listener.count("timeout" if failure is HuhCode.TIMEOUT else "error")
            self._fail_call(msg, frame, failure)
        else:
            listener.observe(time.perf_counter() - started)
            listener.count("ok")
            self._after(msg, listener, frame, result)
        if created and self._tx is not None and frame.state is ThreadState.ACTIVE:
            # Only a frame that outlives this transaction (a call still open: the
            # listener sent requests and awaits answers) needs a durable row; a call
            # answered at once ends inside the transaction that would create it.
            self._tx.thread_put(_row(frame))
            frame.persisted = True
        self._close_tx(msg if last else None)

    def _fail_call(self, msg: Message, frame: Frame, code: HuhCode) -> None:
        if msg.kind is MsgKind.REQUEST:
            self._complete(frame, ThreadState.FAILED)
            self._huh_to(msg.frame, code, msg.hops + 1)
        elif not msg.is_core and frame.parent is not None:
            # The holder failed while taking a response: its caller learns of it.
            self._complete(frame, ThreadState.FAILED)
            self._huh_to(frame.parent, code, msg.hops + 1)

    def _after(self, msg: Message, listener: Listener, frame: Frame, result: object) -> None:
        """Turn a handler's return value into new messages (all re-entering)."""
        hops = msg.hops + 1
        if result is None:
            if msg.kind is MsgKind.REQUEST:
                self._reenter_core(msg.frame, Ack(msg.frame.uuid).to_bytes(), hops)
                if not frame.children:
                    self._complete(frame)
            return
        if not isinstance(result, HandlerResponse):
            log.error(
                "handler returned %s, not HandlerResponse listener=%s",
                type(result).__name__,
                listener.name,
            )
            self._fail_call(msg, frame, HuhCode.INTERNAL)
            return
        kind = result.kind
        if kind is ResponseKind.ERROR:
            code = result.error_code or HuhCode.INTERNAL
            text = (result.error_message or "")[:1024] or None
            if frame.parent is not None:
                self._reenter_core(frame.parent, Huh.of(code, text).to_bytes(), hops)
            self._complete(frame, ThreadState.FAILED)
            return
        try:
            payloads = _serialise_all(
                result.payload,
                self.settings.max_fanout,
                allow_answer=listener.is_agent and kind is ResponseKind.RESPOND,
            )
        except Rejection as rej:
            log.warning("bad handler output listener=%s detail=%s", listener.name, rej.detail)
            self._huh_to(frame, rej.code, hops)
            return
        if kind is ResponseKind.RESPOND:
            caller = frame.parent
            assert caller is not None  # a listener never holds a root frame
            ok = True
            for body in payloads:
                data = build_envelope(listener.name, caller.uuid, body, to=caller.holder)
                ok = (
                    self._reenter(data, listener, caller, own=frame, respond=True, hops=hops) and ok
                )
            if ok:  # a refused answer leaves the frame open so the listener can retry
                self._complete(frame)
            return
        targets: Iterable[str | None] = (
            result.targets if kind is ResponseKind.BROADCAST else (result.to,)
        )
        for to in targets:
            for body in payloads:
                data = build_envelope(listener.name, frame.uuid, body, to=to)
                self._reenter(data, listener, frame, own=frame, respond=False, hops=hops)

    def _reenter(
        self, data: bytes, listener: Listener, frame: Frame, *, own: Frame, respond: bool, hops: int
    ) -> bool:
        """Handler output re-enters through the same parse and checks as client input.
        `frame` is the envelope's thread; `own` is the listener's frame, where a `huh`
        for its bad output goes (so an LLM agent can correct itself)."""
        if self._queued >= self._hard_cap:
            self._huh_to(own, HuhCode.RATE_LIMITED, hops)
            return False
        try:
            env = parse_envelope(data, max_bytes=self.max_envelope_bytes)
            if env.thread != frame.uuid or env.sender != listener.name:  # pragma: no cover
                raise Rejection(HuhCode.INTERNAL, "envelope metadata mismatch")
            if respond:
                spec = _response_spec(listener, env)
                msg = self._ingest_to_holder(
                    env, data, sender=listener.name, frame=frame, spec=spec
                )
            else:
                msg = self._ingest_request(
                    env,
                    data,
                    sender=listener.name,
                    sender_listener=listener,
                    frame=frame,
                    profile=frame.profile,
                )
        except PrivilegedOnBus:
            self._security_event("priv-from-handler", listener=listener.name)
            self._huh_to(own, HuhCode.UNROUTABLE, hops)
            return False
        except Rejection as rej:
            log.info(
                "handler output rejected listener=%s code=%s detail=%s",
                listener.name,
                rej.code.value,
                rej.detail,
            )
            self._huh_to(own, rej.code, hops)
            return False
        msg.hops = hops
        self._enqueue(msg)
        return True

    def _huh_to(self, frame: Frame, code: HuhCode, hops: int) -> None:
        metrics.envelopes_rejected.labels(code.value).inc()
        self._reenter_core(frame, Huh.of(code).to_bytes(), hops)

    def _reenter_core(self, frame: Frame, payload: bytes, hops: int) -> None:
        """A core payload (ack/huh) for the holder of `frame`, re-entering like any output."""
        data = build_envelope(CORE, frame.uuid, payload, to=frame.holder)
        try:
            env = parse_envelope(data)
            msg = self._ingest_to_holder(env, data, sender=CORE, frame=frame, spec=None)
        except Rejection as rej:
            log.info("core message dropped thread=%s detail=%s", frame.uuid, rej.detail)
            return
        msg.hops = hops
        self._enqueue(msg)

    def _complete(self, frame: Frame, state: ThreadState = ThreadState.COMPLETED) -> None:
        self.registry.complete(frame, state)
        if self._tx is not None and frame.persisted:
            self._tx.thread_state(frame.uuid, state.value)

    def _stop_chain(self, root: Frame, code: HuhCode, why: str) -> None:
        log.warning("chain stopped thread=%s owner=%s why=%s", root.uuid, root.owner, why)
        metrics.envelopes_rejected.labels(code.value).inc()
        if self._tx is None:
            self._emit_core(root.owner, root.uuid, Huh.of(code).to_bytes())
            return
        # After this transaction's commit, like every client frame the handling
        # produces: never before the conversation's `accepted`, committed first.
        frame = build_envelope(CORE, root.uuid, Huh.of(code).to_bytes(), to=root.owner)
        self._post.append((root.owner, root.uuid, frame, None))

    def _security_event(self, kind: str, **fields: str) -> None:
        metrics.security_events.labels(kind).inc()
        if self.on_security is not None:
            self.on_security(kind, fields)
        else:
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            log.warning("security event kind=%s %s", kind, detail)


def _validate(spec: XmlSpec, el: etree._Element) -> None:
    if not spec.schema.validate(el):
        raise Rejection(HuhCode.INVALID_PAYLOAD, str(spec.schema.error_log.last_error))


def _validate_core(el: etree._Element) -> None:
    if not _CORE_SCHEMA.validate(el):
        raise Rejection(HuhCode.INVALID_PAYLOAD, str(_CORE_SCHEMA.error_log.last_error))


def _response_spec(listener: Listener, env: Envelope) -> XmlSpec | None:
    """The schema `listener` may answer `env`'s payload with: one of its declared
    response classes, or None for core `answer`, which an LLM agent may always give
    (its final text). Anything else is refused."""
    spec = listener.response_specs.get(env.key)
    if spec is None and not (listener.is_agent and env.key == _ANSWER):
        raise Rejection(HuhCode.INVALID_PAYLOAD, "not a declared response class")
    return spec


_STATE_VALUES = {state: state.value for state in ThreadState}  # Enum.value is slow


def _row(frame: Frame) -> ThreadRow:
    now = time.time()
    profile = frame.profile
    parent = frame.parent
    # uuid, path, parent, owner, profile, table_version, state, created, updated
    return ThreadRow(frame.uuid, frame.path, parent.uuid if parent is not None else None,
                     frame.owner, profile.name, profile.table.version,
                     _STATE_VALUES[frame.state], now, now)


def _serialise_all(payload: object, max_fanout: int, *, allow_answer: bool = False) -> list[bytes]:
    """Handler payload(s) -> C14N payload bytes. Raw bytes are untrusted XML holding
    one or more payload elements: they are parsed with repair (handler and LLM
    output only) and split, one envelope each."""
    if isinstance(payload, bytes | bytearray | str):
        raw = payload.encode() if isinstance(payload, str) else bytes(payload)
        raw = _XML_DECL.sub(b"", raw, count=1)
        wrapper = parse_untrusted(b"<agentd-output>" + raw + b"</agentd-output>", repair=True)
        bodies = [c14n(el) for el in wrapper if isinstance(el.tag, str)]
    elif isinstance(payload, list | tuple):
        bodies = [_one(p, allow_answer) for p in payload]
    else:
        bodies = [_one(payload, allow_answer)]
    if not bodies:
        raise Rejection(HuhCode.INVALID_PAYLOAD, "no payload element in handler output")
    if len(bodies) > max_fanout:
        raise Rejection(HuhCode.TOO_LARGE, f"{len(bodies)} payloads > max_fanout {max_fanout}")
    return bodies


def _one(obj: object, allow_answer: bool) -> bytes:
    if allow_answer and isinstance(obj, Answer):
        return obj.to_bytes()
    if isinstance(obj, CorePayload):
        raise Rejection(HuhCode.INVALID_PAYLOAD, "handlers may not emit core payloads")
    if not is_xmlified(obj):
        raise Rejection(HuhCode.INVALID_PAYLOAD, f"{type(obj).__name__} is not an @xmlify class")
    try:
        return spec_of(obj).to_bytes(obj)
    except (ValueError, TypeError) as exc:
        raise Rejection(HuhCode.INVALID_PAYLOAD, f"cannot serialise: {exc}") from None
