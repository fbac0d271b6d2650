"""The message pump: the one path every message takes, wired from small owners.

    bytes -> hardened parse -> admission (route, schema) -> (journal) -> scheduler
          -> invoker (handler) -> response plan -> envelope bytes -> hardened parse
          -> admission -> ...   (zero-trust re-entry)

`Pump` owns no decision itself: admission (`admission.py`) decides whether and
where a message goes, `gate.py` whether it waits for a human, `response.py` what a
handler's outcome turns into, the `Scheduler` when it runs, the `Invoker` how the
handler is called, `recovery.py` what survives a restart, `waits.py` what a timer
or a parked message does when it wakes or is decided. The pump applies their
results (`_apply`): it registers frames, ends them, queues messages and commits one
`Batch` per step.

Invariants:
- A client's envelope and a handler's output take the same path; nothing a handler
  returns is trusted for identity, thread or route. The pump sets `from` (the
  listener's registered name) and `thread` (from the registry) itself.
- Handling one message is one batch, passed explicitly to everything that writes
  to it and committed before the next await, so its writes commit together.
- Queues are bounded: client ingress waits for room (backpressure); handler output
  beyond a hard cap is refused with `huh rate-limited` to its producer.
- Memory is bounded by the work in progress: once a conversation has no open call
  and nothing queued, it is put at rest in the registry (a bounded set); one pushed
  out of it is ended as abandoned, in the same batch, as idle collection would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from lxml import etree

from agentd import _metrics as metrics
from agentd._core import Accepted, Huh, core_from_element
from agentd._envelope import (
    NIL_THREAD,
    Envelope,
    PrivilegedOnBus,
    adopt_envelope,
    build_envelope,
    parse_built_envelope,
    parse_envelope,
    thread_hint,
)
from agentd._errors import AgentdError, HuhCode, Rejection
from agentd._handler import ChainStopped, HandlerMetadata
from agentd._routing import Listener, Routing
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, ThreadState
from agentd._xml import DEFAULT_SHAPE, ShapeLimits
from agentd.config import MetaConfig, PumpConfig
from agentd.durable import Deadline, Decision, StateLimitExceeded, StateView, TimerRequest
from agentd.kernel import Kernel, KernelUnavailable, Transaction
from agentd.pump import admission, recovery
from agentd.pump.admission import Violation
from agentd.pump.batch import (
    Batch,
    DeliverFn,
    journal_message,
    journal_outgoing,
    journal_to_client,
    state_value,
    thread_row,
)
from agentd.pump.gate import PASS, Deny, Park, Pass, gate
from agentd.pump.invoker import CallFailed, Invoker, outcome_of
from agentd.pump.message import (
    CORE,
    NO_CAPABILITY,
    IntentOutcome,
    IntentResolver,
    Message,
    MsgKind,
    SubmitResult,
)
from agentd.pump.response import ResponsePlan, plan_failure, plan_response, plan_stopped
from agentd.pump.scheduler import Scheduler
from agentd.pump.waits import WaitPlan, Waits
from agentd.telemetry import tracer

log = logging.getLogger("agentd.pump")

_ACTIVE = ThreadState.ACTIVE
_REQUEST = MsgKind.REQUEST
_INTENT = MsgKind.INTENT
_INTENT_TEXT = "{https://xml-pipeline.org/ns/core/v1}text"
_HUH_TAG = "{https://xml-pipeline.org/ns/core/v1}huh"
_TRACEPARENT = "{https://xml-pipeline.org/ns/trace/v1}traceparent"


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
        shape: ShapeLimits = DEFAULT_SHAPE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.routing = routing
        self.clients = dict(clients)  # client id -> profile name
        self.deliver = deliver
        self.settings = settings or PumpConfig()
        self.max_envelope_bytes = max_envelope_bytes
        self.shape = shape
        self.registry = ThreadRegistry()
        # With a kernel, every admitted message is journaled (pending until handled),
        # frames are persisted, and client-bound frames go through the outbox.
        self.kernel = kernel
        # Security events (forged from, priv payloads, peer violations) go here too;
        # the daemon journals them as entries of kind `security`.
        self.on_security: Callable[[str, Mapping[str, str]], None] | None = None
        self.meta_flags = MetaConfig()  # meta introspection on the bus: all off by default
        # The clients that are peer organisms (gateways exporting listeners): their call
        # is answered by the reply alone, so they are not sent `approval-required`.
        self.gateways: frozenset[str] = frozenset()
        # Semantic routing of core `intent` (set by the daemon); None: every intent is
        # unroutable, and said so in the log.
        self.intents: IntentResolver | None = None
        # Intents being resolved (embeddings and model calls): at most a quarter of
        # the pump's slots, so a slow embeddings endpoint cannot stall other traffic.
        self._intents_running = 0
        self._scheduler = Scheduler(
            self._handle, self.settings.max_concurrency, self.settings.max_queue
        )
        self._invoker = Invoker(self._tick)
        self._seq = 0
        self._hard_cap = self.settings.max_queue * 2
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        # Timers, handler state and parked messages (pump/waits.py), with the
        # daemon's one deadline scheduler; `clock` is the wall clock they run on.
        self.waits = Waits(self.registry, self.settings, self._due, clock)
        # With telemetry: the span of the handler call whose outcome is being applied
        # (set between its return and its commit, with no await in between): what it
        # sends hangs from it, its huh codes and security events are its events.
        self._span: Any = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        # Kept: asyncio.get_running_loop() costs a getpid() system call on every call
        # (its fork check), several times a message on the hot path.
        self._loop = asyncio.get_running_loop()
        self._scheduler.start()
        self._invoker.start(self._loop)
        self.waits.deadlines.start()

    def _tick(self) -> float:
        shortest = min(
            (lst.timeout_s for lst in self.routing.listeners.values()),
            default=self.settings.handler_timeout_s,
        )
        return min(1.0, max(0.005, shortest / 10))

    async def stop(self) -> None:
        await self.waits.deadlines.stop()
        await self._scheduler.stop()
        await self._invoker.stop()

    def join(self) -> Coroutine[Any, Any, None]:
        """Run until idle: await it to return once nothing is queued or running.
        (The scheduler's own coroutine, not one wrapping it: no extra frame.)"""
        return self._scheduler.join()

    @property
    def queue_depth(self) -> int:
        return self._scheduler.queued

    @property
    def running(self) -> int:
        return self._scheduler.running

    @property
    def handled(self) -> int:
        """Handler invocations, for benchmarks and status."""
        return self._invoker.calls

    # ---- client ingress --------------------------------------------------

    async def submit(
        self, client: str, data: bytes, parsed: Envelope | None = None, hops: int = 0,
        traceparent: str = "",
    ) -> SubmitResult:
        """Admit one envelope from an authenticated client. The client is sent one
        `accepted` or one `huh` (through `deliver`), then whatever comes back. Waits
        for room in the pump, and with a kernel for the envelope's journal commit.
        `parsed`: `data` as `parse_envelope` with this pump's limits would return it,
        from a caller that had to parse it first (the federation, which re-addresses
        a peer's envelope to the gateway). `hops`: the hops its causal chain has
        made already (a peer's call carries its caller's), so a chain that crosses
        organisms back and forth still meets `max_hops`. `traceparent`: the trace
        context a peer organism's call carried (telemetry: its work continues it)."""
        scheduler = self._scheduler
        if scheduler.queued >= scheduler.max_queue:
            await scheduler.wait_for_room(self._loop or asyncio.get_running_loop())
        result = self._submit_now(client, data, True, parsed, hops, traceparent)
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
        scheduler = self._scheduler
        if scheduler.queued >= scheduler.max_queue or scheduler.room_waiters:
            return None
        result = self._submit_now(client, data, False)
        assert isinstance(result, SubmitResult)
        return result

    def _submit_now(
        self, client: str, data: bytes, wait: bool, parsed: Envelope | None = None,
        hops: int = 0, traceparent: str = "",
    ) -> SubmitResult | asyncio.Future[SubmitResult]:
        """Parse, check, route and admit `data` without awaiting anything. With a
        kernel and `wait`, returns a future for the outcome of the journal commit."""
        metrics.HOT.received += 1
        tracing = tracer()
        started = time.time_ns() if tracing.enabled else 0
        thread = NIL_THREAD
        try:
            env = parsed if parsed is not None else parse_envelope(
                data, max_bytes=self.max_envelope_bytes, shape=self.shape)
            thread = env.thread
            known = self.registry.get(thread)
            msg = admission.admit_client(
                client, env, data, known, self.routing.profiles, self.clients,
                self.meta_flags, self.max_envelope_bytes,
            )  # fmt: skip
        except PrivilegedOnBus:
            self._security_event("priv-on-bus", {"client": client})
            if started:
                tracing.admit(client, thread_hint(data), started, None, "unroutable",
                              "priv-on-bus")
            return self._refuse_client(client, thread_hint(data), HuhCode.UNROUTABLE)
        except Rejection as rej:
            if isinstance(rej, Violation):
                self._security_event(rej.event, rej.fields)
            if thread == NIL_THREAD:  # refused before its meta was read (docs/protocol.md)
                thread = thread_hint(data)
            if started:
                tracing.admit(client, thread, started, None, rej.code.value,
                              rej.event if isinstance(rej, Violation) else "")
            log.info("rejected client=%s code=%s thread=%s detail=%s",
                     client, rej.code.value, thread, rej.detail)
            return self._refuse_client(client, thread, rej.code, rej.public)
        if msg.__class__ is not Message:  # a client's decision on a parked message
            return self._client_decision(client, env.thread, data, msg)  # type: ignore[arg-type]
        assert isinstance(msg, Message)
        if hops:
            if hops >= self.settings.max_hops:
                return self._refuse_client(client, thread, HuhCode.BUDGET_EXCEEDED)
            msg.hops = hops
        frame = msg.frame
        gated = gate(msg, frame.profile.table.gates, self.waits.counts)
        if isinstance(gated, Deny):
            self._security_event("approval-limit", gated.event)
            if started:
                tracing.admit(client, frame.uuid, started, None, gated.code.value,
                              "approval-limit")
            return self._refuse_client(client, frame.uuid, gated.code)
        if known is None:
            self.registry.add(frame)  # registered only once every check has passed
        else:
            frame.touched = time.monotonic()
            self.registry.wake(frame)
        parked = None if isinstance(gated, Pass) else gated
        if started:
            self._trace_admission(client, env, msg, started, traceparent)
        meta_answer = msg.sender == CORE  # answered by the pump itself (agentd/_meta.py)
        if self.kernel is None:
            if started:
                tracing.end(msg.cause)
            self._seq += 1
            msg.seq = 0 if meta_answer else self._seq
            self._emit_core(client, frame.uuid, Accepted(frame.uuid, self._seq).to_bytes())
            if parked is None:
                self._enqueue(msg, None)
            else:
                self._park(msg, parked, None)
            return SubmitResult(frame.uuid, seq=self._seq)
        # The transaction that makes the envelope durable: its thread (if new) and
        # its journal entry.
        tx = self.kernel.transaction()
        if known is None:
            tx.thread_put(thread_row(frame))
            frame.persisted = True
        if meta_answer or parked is not None:
            # Not pending: the pump answers it, or the approval row holds it.
            seq = tx.journal(
                thread=frame.uuid, direction="in", kind="meta" if meta_answer else "parked",
                sender=client, tag=env.key, payload=data, profile=frame.profile.name,
            )  # fmt: skip
        else:
            seq = msg.seq = journal_message(tx, msg)
        return self._admit(client, msg, tx, seq, wait, not meta_answer and parked is None,
                           parked)

    def _admit(
        self, client: str, msg: Message, tx: Transaction, seq: int, wait: bool,
        optimistic: bool, parked: Park | None = None,
    ) -> SubmitResult | asyncio.Future[SubmitResult]:
        """Commit the admission `tx`; `accepted` (or `huh internal`) is sent from the
        commit callback, in commit order. `optimistic`: hand the message to its
        handler at once, while the commit is being written. Its own transaction is
        queued after this one, so it commits with it or after it, never before, and
        `accepted` always precedes the answer; if the commit fails the client gets
        `huh internal` and nothing was acknowledged, but the handler may have run
        (see docs/architecture.md). Otherwise (a meta answer) the message is queued
        only once its envelope is durable. `parked`: the message is parked in `tx`
        instead, as the gate decided, and `approval-required` follows `accepted`.
        With `wait`, returns a future for the outcome; without, the outcome as known
        now (provisional if accepted)."""
        kernel = self.kernel
        assert kernel is not None
        frame = msg.frame
        outcome: asyncio.Future[SubmitResult] | None = None
        if wait:
            outcome = (self._loop or asyncio.get_running_loop()).create_future()
        refused: SubmitResult | None = None
        held: Batch | None = None
        approval = ""
        if parked is not None:
            held = Batch(tx, self.deliver)
            approval = self._park(msg, parked, held)

        def admitted(exc: BaseException | None) -> None:
            nonlocal refused
            if msg.cause is not None:  # its agentd.admit span (telemetry)
                tracer().end(msg.cause, exc)
            if exc is None:
                self._emit_core(client, frame.uuid, Accepted(frame.uuid, seq).to_bytes())
                if held is not None:
                    held.committed(None)
                elif not optimistic:
                    batch = self._open()
                    self._enqueue(msg, batch)
                    self._close(batch, None)
                if outcome is not None:
                    outcome.set_result(SubmitResult(frame.uuid, seq=seq))
                return
            log.error("journal unavailable, refusing client=%s: %s", client, exc)
            if held is not None:
                self.waits.unpark(approval)
            elif (not optimistic and frame.is_root and not self._scheduler.has_inbox(
                    frame.uuid) and not frame.children):
                self.registry.forget(frame)
            refused = self._refuse_client(client, frame.uuid, HuhCode.INTERNAL)
            if outcome is not None and not outcome.done():
                outcome.set_result(refused)

        try:
            kernel.commit_then(tx, admitted)
        except KernelUnavailable as exc:
            admitted(exc)
        else:
            if optimistic:
                self._enqueue(msg, None)
        if outcome is not None:
            return outcome
        return refused or SubmitResult(frame.uuid, seq=seq)

    def _trace_admission(self, client: str, env: Envelope, msg: Message, started: int,
                         traceparent: str) -> None:
        """The `agentd.admit` span of an admitted envelope, the parent of its handling:
        under the trace context a peer's call carried, or (only when the
        configuration allows it) the client's own traceparent; otherwise the first
        span of the conversation's trace, or a new root of it."""
        tracing = tracer()
        conversation = msg.frame.root.uuid
        if not traceparent and tracing.accept_client_context and client not in self.gateways:
            root = env.payload.getparent()  # the envelope; its first child is `meta`
            found = None if root is None else root[0].find(_TRACEPARENT)
            traceparent = (found.text or "").strip() if found is not None else ""
        remote = tracing.adopt(conversation, traceparent) if traceparent else None
        msg.cause = tracing.admit(client, conversation, started, remote)

    def _refuse_client(
        self, client: str, thread: str, code: HuhCode, message: str | None = None
    ) -> SubmitResult:
        """`huh code` to the client on `thread`; `message` (a `Rejection.public`,
        about the client's own input) replaces the code's generic text."""
        metrics.envelopes_rejected.labels(code.value).inc()
        self._emit_core(client, thread, Huh.of(code, message).to_bytes())
        return SubmitResult(thread, code=code)

    def _emit_core(
        self, client: str, thread: str, payload: bytes, batch: Batch | None = None
    ) -> None:
        """A core frame for a client: now, or after `batch`'s commit if one is given."""
        frame = build_envelope(CORE, thread, payload, to=client)
        if batch is None:
            self.deliver(client, thread, frame, None)
        else:
            batch.post.append((client, thread, frame, None))

    def collect_idle(self, idle_s: float, now: float | None = None) -> int:
        """End conversations (and stray frames, e.g. a call whose peer never answered)
        untouched for `idle_s` seconds: the registry forgets them and the kernel marks
        them completed, so its thread GC can delete them. Deepest frames go first, so
        a conversation whose abandoned calls are collected is collected with them.
        O(frames); run periodically, never on the hot path."""
        now = time.monotonic() if now is None else now
        busy = self._scheduler.has_inbox
        held = self.waits.holds  # a pending timer or parked message keeps its frame
        stale = sorted(
            (f for f in self.registry
             if now - f.touched > idle_s and not busy(f.uuid) and f.uuid not in held),
            key=lambda f: len(f.path),
            reverse=True,
        )
        ended = 0
        batch = self._open()
        for frame in stale:
            if frame.children:
                continue  # a call under it is still live
            self._end(frame, ThreadEvent.ABANDONED, batch)
            ended += 1
        self._close(batch, None)
        return ended

    def end_conversation(self, thread: str) -> bool:
        """End a client's conversation now (the operator's `end-thread`): its open
        calls that are not running and its root frame end as collected, in one batch,
        with what it kept: timers cancelled, handler state dropped, parked messages
        denied "not approved". A call still running finishes into an ended thread
        (its output is dropped). False if `thread` is not an active conversation."""
        root = self.registry.get(thread)
        if root is None or root.parent is not None or root.state is not _ACTIVE:
            return False
        busy = self._scheduler.has_inbox
        under = sorted((f for f in self.registry
                        if f is not root and f.root is root and not busy(f.uuid)),
                       key=lambda f: len(f.path), reverse=True)
        batch = self._open()
        for frame in under:
            if frame.state is _ACTIVE and not frame.children:
                self._end(frame, ThreadEvent.ABANDONED, batch)
        self._end(root, ThreadEvent.ABANDONED, batch)
        self._close(batch, None)
        log.info("conversation ended by the operator thread=%s owner=%s", root.uuid,
                 root.owner)
        return True

    async def recover(self) -> int:
        """Rebuild frames and re-queue undelivered messages from the kernel after a
        restart (at least once: handlers see `redelivered=True`). Returns the count."""
        if self.kernel is None:
            return 0
        resumed = await recovery.recover(
            self.kernel, self.routing.listeners, self.routing.profiles, self.registry
        )
        await self.waits.recover(self.kernel)  # what is parked, before more is
        for msg, approved in resumed:
            gated = PASS if approved else gate(msg, msg.frame.profile.table.gates,
                                               self.waits.counts)
            if isinstance(gated, Pass):
                self._enqueue(msg, None)
            else:
                self._regate(msg, gated)
        return len(resumed)

    def _regate(self, msg: Message, gated: Park | Deny) -> None:
        """A pending request for a listener gated since it was accepted (a new
        configuration): parked for approval like any new one, never dispatched
        unapproved; its journal entry is handled (the approval row holds it now)."""
        log.warning("resumed message for a listener gated since parked for approval "
                    "listener=%s %s", ",".join(t.name for t in msg.targets), msg.frame.log_ids)
        batch = self._open()
        assert batch is not None
        self._hold(msg, gated, msg.frame, msg.hops, batch)
        batch.tx.delivered(msg.seq)
        self._close(batch, None)

    # ---- batches ---------------------------------------------------------------

    def _open(self) -> Batch | None:
        kernel = self.kernel
        return None if kernel is None else Batch(kernel.transaction(), self.deliver)

    def _close(self, batch: Batch | None, handled: Message | None) -> None:
        """Commit what one step produced (and mark `handled` as processed); client
        frames are handed to `deliver` only once their outbox rows are durable."""
        if handled is not None:
            root = handled.frame.root
            if not root.children and root.state is _ACTIVE and not self._scheduler.waiting(
                root.uuid
            ) and root.uuid not in self.waits.holds:
                # Nothing in progress on the conversation: at rest, so memory holds
                # only work in progress and a bounded set of resumable conversations.
                # One holding a parked message stays in progress: pushing it out of
                # the rest set would end it, and deny what waits for a human.
                for pushed in self.registry.rest(root):
                    self._end(pushed, ThreadEvent.ABANDONED, batch)
        if batch is None or self.kernel is None:
            return
        if handled is not None and handled.seq:
            batch.tx.delivered(handled.seq)
        if self._span is None:
            self.kernel.commit_then(batch.tx, batch.committed)
            return
        span = tracer().commit(self._span)  # agentd.commit, under the handler's span

        def committed(exc: BaseException | None) -> None:
            batch.committed(exc)
            tracer().end(span, exc)

        self.kernel.commit_then(batch.tx, committed)

    def _enqueue(self, msg: Message, batch: Batch | None) -> None:
        if msg.cause is None:
            msg.cause = self._span
        if msg.kind is MsgKind.TO_HOLDER and not msg.targets:
            # The holder is the external client: deliver in order (after the commit
            # of its outbox row when durable).
            if batch is None:
                self.deliver(msg.frame.owner, msg.frame.uuid, msg.envelope, None)
            else:
                journal_outgoing(batch, msg)
            return
        if batch is not None and not msg.seq:
            msg.seq = journal_message(batch.tx, msg)
        self._scheduler.put(msg)

    def _end(self, frame: Frame, event: ThreadEvent, batch: Batch | None) -> None:
        state = self.registry.end(frame, event)
        if batch is not None and frame.persisted:
            batch.tx.thread_state(frame.uuid, state_value(state))
        if frame.parent is None and self.waits.conversations:
            for plan in self.waits.conversation_ended(frame.uuid, batch):
                self._apply_wait(plan, batch)

    # ---- handling --------------------------------------------------------------

    async def _handle(self, msg: Message) -> None:
        root = msg.frame.root
        if root.state is not _ACTIVE or msg.hops >= self.settings.max_hops:
            batch = self._open()
            if root.state is not _ACTIVE:
                log.info("dropped message on ended conversation thread=%s", root.uuid)
            else:
                # Two listeners ping-ponging, or a runaway chain: stop it, tell the client.
                self._stop_chain(root, HuhCode.BUDGET_EXCEEDED, "hop limit reached", batch)
            self._close(batch, msg)
            return
        if msg.kind is _INTENT:
            await self._resolve_intent(msg)
            return
        if msg.kind is _REQUEST and len(msg.targets) > 1:
            # Broadcast: the listeners on one key run concurrently; the message counts
            # as handled once all of them have returned.
            await asyncio.gather(*(self._call(msg, t, False) for t in msg.targets))
            batch = self._open()
            self._close(batch, msg)
        else:
            await self._call(msg, msg.targets[0], True)

    async def _call(self, msg: Message, listener: Listener, last: bool) -> None:
        """Run one handler on one message. `last`: this call completes the message."""
        hops = msg.hops + 1
        if listener.retired:
            batch = self._open()
            self._huh_to(msg.frame, HuhCode.UNROUTABLE, hops, batch)
            self._close(batch, msg if last else None)
            return
        created = msg.kind is _REQUEST
        frame = self.registry.extend(msg.frame, listener.name) if created else msg.frame
        frame.touched = time.monotonic()
        spec = msg.spec
        payload: Any = (
            msg.payload if listener.takes_element  # an isolation pool: no object to build
            else core_from_element(msg.payload) if spec is None
            else spec.from_element(msg.payload)
        )
        meta = HandlerMetadata(frame.uuid, msg.sender, listener.name, msg.redelivered, "",
                               self.waits.book, frame.root.uuid, None, msg.seq,
                               _hops=msg.hops, _about=msg.about)
        tracing = tracer()
        token = tracing.handler(listener.name, listener.is_agent, frame.root.uuid, msg.seq,
                                msg.redelivered, msg.cause)
        result = await self._invoker.call(listener, payload, meta, frame.root.uuid)
        span = self._span = None if token is None else tracing.detach(token)
        batch = self._open()
        if meta._after_commit is not None:  # a platform handler acts once its output is durable
            if batch is None:
                meta._after_commit()
            else:
                batch.after = [*(batch.after or ()), meta._after_commit]
        if result.__class__ is ChainStopped:
            # A peer organism refused the call at its hop limit: stopped as a chain
            # that stays home is (see _handle), and the call's frame ends with it.
            self._stop_chain(frame.root, result.code, "hop limit reached at a peer", batch)
            plan = plan_stopped(frame)
        elif result.__class__ is CallFailed:
            if result.event is not None:
                self._security_event("tool-denied", {**result.event, "thread": frame.root.uuid})
            plan = plan_failure(msg, frame, result.code)
        elif meta._view is not None and not self._state_fits(meta._view, listener, batch):
            plan = plan_failure(msg, frame, HuhCode.TOO_LARGE)
        elif result.__class__ is TimerRequest:
            wait = self.waits.set_timer(result, msg, listener, frame, hops, batch)
            if wait.event is not None:
                self._security_event(*wait.event)
            plan = wait.answer
        else:
            plan = plan_response(msg, listener, frame, result, self.settings.max_fanout)
        self._apply(plan, listener, frame, hops, batch)
        if created and batch is not None and frame.state is _ACTIVE:
            # Only a frame that outlives this transaction (a call still open: the
            # listener sent requests and awaits answers) needs a durable row; a call
            # answered at once ends inside the transaction that would create it.
            batch.tx.thread_put(thread_row(frame))
            frame.persisted = True
        self._close(batch, msg if last else None)
        if span is not None:
            self._span = None
            tracing.end_handler(span, *outcome_of(result))

    def _apply(self, plan: ResponsePlan, listener: Listener | None, frame: Frame | None,
               hops: int, batch: Batch | None, about: str = "") -> None:
        """Carry out a plan for `listener`'s call `frame`: the notice, the envelopes,
        then the end of the frame (only once every envelope was taken: a refused
        answer leaves it open). `about`: the listener whose call the notice answers,
        when it is not `listener` (a parked call's denial)."""
        if plan.notice_to is not None:
            if plan.rejected is not None:
                metrics.envelopes_rejected.labels(plan.rejected.value).inc()
                if self._span is not None:
                    tracer().event(self._span, "agentd.huh", {"code": plan.rejected.value})
            # Whatever the notice says, it is about `listener`'s call (an ack or huh
            # for its caller) or its own output: a caller with calls open knows which.
            self._reenter_core(plan.notice_to, plan.notice, hops, batch,
                               about or (listener.name if listener is not None else ""))
        taken = True
        thread = plan.thread
        adopted = plan.adopted
        for i, data in enumerate(plan.envelopes):
            assert thread is not None and listener is not None and frame is not None
            if not self._reenter(data, listener, thread, frame, plan.respond, hops, batch,
                                 built=True, adopted=None if adopted is None else adopted[i]):
                taken = False
        if plan.end is not None and taken:
            assert frame is not None
            self._end(frame, plan.end, batch)

    def _apply_wait(self, plan: WaitPlan, batch: Batch | None) -> None:
        """Carry out a wait's plan (see `WaitPlan`): its event, its frame for a
        client, its answer through `_apply`, then its approved message."""
        if plan.event is not None:
            self._security_event(*plan.event)
        if plan.client is not None:
            self._emit_core(*plan.client, batch)
        self._apply(plan.answer, plan.listener, plan.frame, plan.hops, batch, plan.about)
        msg, own = plan.dispatch, plan.own
        if own is None:
            if msg is not None:
                self._enqueue(msg, None)
            return
        assert self.kernel is not None
        approval = plan.approval

        def decided(exc: BaseException | None) -> None:
            if exc is not None:
                log.error("approval not recorded (still pending in the kernel) approval=%s: "
                          "%s", approval, exc)
            elif msg is not None:
                self._scheduler.put(msg)

        self.kernel.commit_then(own, decided)

    def _due(self, due: list[Deadline], now: float) -> None:
        """The deadline scheduler's round: what each due timer or approval does, in
        one batch."""
        batch = self._open()
        for entry in due:
            self._apply_wait(self.waits.due(entry, now, batch, self.kernel), batch)
        self._close(batch, None)

    def decide(self, decision: Decision, envelope: bytes | None = None) -> str | None:
        """Apply a decision on a parked message (a client's, whose `envelope` is
        journaled, or an operator's): None if it stood, else why not (logged; a
        security event)."""
        refused = self.waits.refusal(decision)
        if refused is not None:
            self._security_event("approval-refused", refused[1])
            return refused[0]
        thread = decision.thread or self.waits.parked[decision.approval].conversation
        batch = self._open()
        self._apply_wait(self.waits.decide(decision, batch, self.kernel), batch)
        client = decision.client
        if client is not None:
            # The decider is told its decision was taken, before what it causes.
            seq = 0
            if batch is not None and envelope is not None:
                seq = batch.tx.journal(thread=thread, direction="in", kind="decision",
                                       sender=client, tag="decision", payload=envelope)
            note = build_envelope(CORE, thread, Accepted(thread, seq).to_bytes(), to=client)
            if batch is None:
                self.deliver(client, thread, note, None)
            else:
                batch.post.insert(0, (client, thread, note, None))
        self._close(batch, None)
        return None

    def _client_decision(self, client: str, thread: str, data: bytes, decision: Decision
                         ) -> SubmitResult:
        """A client's `approve`/`deny`: `accepted` and the outcome, or `huh
        unroutable` if it may not stand."""
        if self.decide(decision, data) is not None:
            metrics.envelopes_rejected.labels(HuhCode.UNROUTABLE.value).inc()
            self._emit_core(client, thread, Huh.of(HuhCode.UNROUTABLE).to_bytes())
            return SubmitResult(thread, code=HuhCode.UNROUTABLE)
        return SubmitResult(thread, seq=0)

    async def _resolve_intent(self, msg: Message) -> None:
        """Core `intent`: the resolver ranks what the sender may reach and fills a
        payload, which then enters as the sender's own output (the same checks as
        any handler output: schema, dispatch table, peers; one more hop). Nothing
        fits: `huh unroutable` with the one text that never says why."""
        frame, sender, hops = msg.frame, msg.sender, msg.hops + 1
        # A listener never holds a root frame: on one, the sender is the client.
        listener = None if frame.is_root else frame.profile.table.listeners.get(sender)
        outcome: IntentOutcome | None = None
        if self.intents is None:
            log.warning("intent refused: semantic routing is not configured %s", frame.log_ids)
        elif self._intents_running >= max(1, self.settings.max_concurrency // 4):
            log.warning("intent refused: %d intents are being resolved %s",
                        self._intents_running, frame.log_ids)
            batch = self._open()
            self._huh_to(frame, HuhCode.RATE_LIMITED, hops, batch)
            self._close(batch, msg)
            return
        elif frame.is_root or listener is not None:
            text = msg.payload.findtext(_INTENT_TEXT) or ""
            self._intents_running += 1
            try:
                async with asyncio.timeout(self.settings.handler_timeout_s):
                    outcome = await self.intents.resolve(text, sender, listener, frame)
            except TimeoutError:
                log.warning("intent refused: not resolved within handler_timeout_s (%g s) %s",
                            self.settings.handler_timeout_s, frame.log_ids)
            except AgentdError as exc:  # an endpoint's outage (embeddings, model): one line
                log.warning("intent refused: %s %s", exc, frame.log_ids)
            except Exception:  # a resolver bug: refused, loudly, never half-done
                log.exception("intent resolver failed %s", frame.log_ids)
            finally:
                self._intents_running -= 1
        batch = self._open()
        if outcome is not None and batch is not None:
            batch.tx.journal(
                thread=frame.uuid, direction="audit", kind="intent-route",
                handler=outcome.listener or "", sender=sender, tag=msg.payload.tag,
                payload=outcome.record, profile=frame.profile.name,
            )  # fmt: skip
        if outcome is None or outcome.payload is None or outcome.listener is None:
            huh = Huh.of(HuhCode.UNROUTABLE, NO_CAPABILITY)
            metrics.envelopes_rejected.labels(HuhCode.UNROUTABLE.value).inc()
            self._reenter_core(frame, huh.to_bytes(), hops, batch)
        else:
            data = build_envelope(sender, frame.uuid, outcome.payload, to=outcome.listener)
            if listener is not None:
                self._reenter(data, listener, frame, frame, False, hops, batch)
            else:
                self._admit_filled(data, sender, frame, hops, batch)
        self._close(batch, msg)

    def _admit_filled(
        self, data: bytes, client: str, frame: Frame, hops: int, batch: Batch | None
    ) -> None:
        """A client's filled intent: routed like the client's own envelope."""
        try:
            env = parse_envelope(data, max_bytes=self.max_envelope_bytes, shape=self.shape)
            filled = admission.route_request(env, env.key, data, client, None, frame)
        except Rejection as rej:
            log.info("filled intent rejected client=%s code=%s %s detail=%s",
                     client, rej.code.value, frame.log_ids, rej.detail)
            self._huh_to(frame, rej.code, hops, batch)
            return
        filled.hops = hops
        # Gated as the client's own envelope would be.
        gated = gate(filled, frame.profile.table.gates, self.waits.counts)
        if isinstance(gated, Pass):
            self._enqueue(filled, batch)
        else:
            self._hold(filled, gated, frame, hops, batch)

    def _state_fits(self, view: StateView, listener: Listener, batch: Batch | None) -> bool:
        """Commit the handler's `meta.state` writes with its output; False (nothing
        written, the call fails) if calls on other frames of the conversation filled
        the slice meanwhile."""
        try:
            self.waits.commit_state(view, batch)
        except StateLimitExceeded as exc:
            log.warning("handler state refused listener=%s: %s", listener.name, exc)
            return False
        return True

    def _reenter(
        self, data: bytes, listener: Listener, frame: Frame, own: Frame, respond: bool,
        hops: int, batch: Batch | None, built: bool = False,
        adopted: tuple[etree._Element, str | None] | None = None,
    ) -> bool:
        """Handler output re-enters through the same parse and checks as client input.
        `frame` is the envelope's thread; `own` is the listener's frame, where a `huh`
        for its bad output goes (so an LLM agent can correct itself). `built`: the
        pump built it around a serializer's payload (a `ResponsePlan`'s envelopes;
        `parse_built_envelope`); `adopted`: the payload element and `to` it was built
        from, parsed strictly out of raw output (`adopt_envelope`: no second parse).
        A refusal's `huh` names the listener the envelope was addressed to (`about`)."""
        about = (adopted[1] if adopted is not None else None) or ""
        if self._scheduler.queued >= self._hard_cap:
            self._huh_to(own, HuhCode.RATE_LIMITED, hops, batch, about)
            return False
        try:
            if adopted is not None:
                env = adopt_envelope(data, adopted[0], listener.name, adopted[1], frame.uuid,
                                     max_bytes=self.max_envelope_bytes, shape=self.shape)
            else:
                env = (parse_built_envelope if built else parse_envelope)(
                    data, max_bytes=self.max_envelope_bytes, shape=self.shape)
            about = env.to or ""
            if env.thread != frame.uuid or env.sender != listener.name:  # pragma: no cover
                raise Rejection(HuhCode.INTERNAL, "envelope metadata mismatch")
            if respond:
                spec = admission.response_spec(listener, env)
                msg = admission.to_holder(env, data, listener.name, frame, spec)
            else:
                msg = admission.route_request(env, env.key, data, listener.name, listener, frame)
                gated = gate(msg, frame.profile.table.gates, self.waits.counts)
                if not isinstance(gated, Pass):
                    msg.hops = hops
                    return self._hold(msg, gated, own, hops, batch, about)
        except PrivilegedOnBus:
            self._security_event("priv-from-handler",
                                 {"listener": listener.name, "thread": frame.root.uuid})
            self._huh_to(own, HuhCode.UNROUTABLE, hops, batch, about)
            return False
        except Rejection as rej:
            if isinstance(rej, Violation):
                log.warning("peer violation blocked listener=%s to=%s key=%s %s",
                            listener.name, env.to, env.key, own.log_ids)
                self._security_event(rej.event, {**rej.fields, "thread": frame.root.uuid})
            log.info("handler output rejected listener=%s code=%s %s detail=%s",
                     listener.name, rej.code.value, own.log_ids, rej.detail)
            self._huh_to(own, rej.code, hops, batch, about)
            return False
        msg.hops = hops
        self._enqueue(msg, batch)
        return True

    def _hold(self, msg: Message, gated: Park | Deny, own: Frame, hops: int,
              batch: Batch | None, about: str = "") -> bool:
        """A gated message: parked (True), or refused with `huh` to the holder of
        `own` and an `approval-limit` security event (False)."""
        if isinstance(gated, Deny):
            self._security_event("approval-limit", gated.event)
            self._huh_to(own, gated.code, hops, batch, about)
            return False
        self._park(msg, gated, batch)
        return True

    def _park(self, msg: Message, gated: Park, batch: Batch | None) -> str:
        """Park `msg` as the gate decided; its approval id."""
        row, plan = self.waits.park(msg, gated, batch, msg.frame.root.owner not in self.gateways)
        self._apply_wait(plan, batch)
        return row.id

    def _huh_to(self, frame: Frame, code: HuhCode, hops: int, batch: Batch | None,
                about: str = "") -> None:
        metrics.envelopes_rejected.labels(code.value).inc()
        if self._span is not None:
            tracer().event(self._span, "agentd.huh", {"code": code.value})
        self._reenter_core(frame, Huh.of(code).to_bytes(), hops, batch, about)

    def _reenter_core(self, frame: Frame, payload: bytes, hops: int, batch: Batch | None,
                      about: str = "") -> None:
        """A core payload (ack/huh) for the holder of `frame`, re-entering like any
        output; `about`: the listener of the holder's call it answers, if one."""
        data = build_envelope(CORE, frame.uuid, payload, to=frame.holder)
        try:
            env = parse_built_envelope(data)
            msg = admission.to_holder(env, data, CORE, frame, None)
        except Rejection as rej:
            log.info("core message dropped %s detail=%s", frame.log_ids, rej.detail)
            return
        msg.hops = hops
        msg.about = about
        self._enqueue(msg, batch)

    def _stop_chain(self, root: Frame, code: HuhCode, why: str, batch: Batch | None) -> None:
        log.warning("chain stopped thread=%s owner=%s why=%s", root.uuid, root.owner, why)
        metrics.envelopes_rejected.labels(code.value).inc()
        payload = Huh.of(code).to_bytes()
        if batch is None:
            self._emit_core(root.owner, root.uuid, payload)
            return
        # Durable, like any answer to the client, and after the batch's commit (never
        # before the conversation's `accepted`): a peer organism whose call this is
        # takes it as the call's reply (a frame without an outbox row never reaches it).
        envelope = build_envelope(CORE, root.uuid, payload, to=root.owner)
        journal_to_client(batch, root, CORE, _HUH_TAG, envelope)

    def _security_event(self, kind: str, fields: Mapping[str, str]) -> None:
        metrics.security_events.labels(kind).inc()
        if self._span is not None:
            tracer().event(self._span, "agentd.security", {"kind": kind, **fields})
        if self.on_security is not None:
            self.on_security(kind, fields)
        else:
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            log.warning("security event kind=%s %s", kind, detail)
