"""The message pump: the one path every message takes, wired from small owners.

    bytes -> hardened parse -> admission (route, schema) -> (journal) -> scheduler
          -> invoker (handler) -> response plan -> envelope bytes -> hardened parse
          -> admission -> ...   (zero-trust re-entry)

`Pump` owns the way in and owns no decision itself: admission (`admission.py`)
decides whether and where a message goes, `gate.py` whether it waits for a human,
`recovery.py` what survives a restart, `waits.py` what a parked message does when
it is decided. The way through is `dispatch.py`'s: a handler's call and the
application of every plan (`response.py`'s, the waits'), one `Batch` per step.
Here: client ingress (parse, admit, gate, journal, `accepted`), the decisions of
clients and operators, recovery after a restart, idle collection and the
operator's end of a conversation, and the lifecycle.

Invariants:
- A client's envelope and a handler's output take the same path through
  admission; nothing a client claims is trusted for identity or thread.
- A new conversation's frame is registered only once every check has passed;
  `accepted` (or one `huh`) is sent for each envelope, after its journal commit.
- Client ingress waits for room in the scheduler (backpressure).
- Without a kernel the pump alone numbers what it accepts (`_seq`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from agentd import _metrics as metrics
from agentd._core import Accepted, Huh
from agentd._envelope import (
    NIL_THREAD,
    Envelope,
    PrivilegedOnBus,
    build_envelope,
    parse_envelope,
    thread_hint,
)
from agentd._errors import HuhCode, Rejection
from agentd._routing import Routing
from agentd._threads import ThreadEvent, ThreadRegistry, ThreadState
from agentd.config import MetaConfig
from agentd.durable import Decision
from agentd.kernel import Kernel, KernelUnavailable, Transaction
from agentd.pump import admission, recovery
from agentd.pump.admission import Violation
from agentd.pump.batch import Batch, DeliverFn, journal_message, thread_row
from agentd.pump.dispatch import Dispatch
from agentd.pump.gate import PASS, Deny, Park, Pass, gate
from agentd.pump.message import CORE, IntentResolver, Message, StepSink, SubmitResult
from agentd.pump.options import PumpOptions
from agentd.telemetry import tracer

log = logging.getLogger("agentd.pump")

_ACTIVE = ThreadState.ACTIVE
_TRACEPARENT = "{https://xml-pipeline.org/ns/trace/v1}traceparent"


class Pump:
    """The pump of one organism. Everything it runs with is given here: `options`
    (`PumpOptions`, built from the loaded configuration), the `kernel` (None: not
    durable), `on_security` (where security events go; None: logged), `intents`
    (the resolver of core `intent`; None: every intent is unroutable, and said so
    in the log), `steps` (where a conversation's `step` frames go; None: nowhere)
    and `clock` (the wall clock of timers and approvals). A reload
    swaps what it may change through `reload`."""

    def __init__(
        self,
        routing: Routing,
        clients: Mapping[str, str],
        deliver: DeliverFn,
        options: PumpOptions | None = None,
        kernel: Kernel | None = None,
        *,
        on_security: Callable[[str, Mapping[str, str]], None] | None = None,
        intents: IntentResolver | None = None,
        steps: StepSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        options = options or PumpOptions()
        self.routing = routing
        self.clients = dict(clients)  # client id -> profile name
        self.deliver = deliver
        self.settings = options.pump
        self.max_envelope_bytes = options.max_envelope_bytes
        self.shape = options.shape
        self.meta_flags = options.meta
        self.gateways = options.gateways
        self.registry = ThreadRegistry()
        # With a kernel, every admitted message is journaled (pending until handled),
        # frames are persisted, and client-bound frames go through the outbox.
        self.kernel = kernel
        # The steps: handler calls and what their outcomes, waits and decisions do.
        dispatch = self._dispatch = Dispatch(self.registry, deliver, options, kernel,
                                             on_security, intents, clock, self._tick, steps)
        self._scheduler = dispatch.scheduler
        self._invoker = dispatch.invoker
        self.waits = dispatch.waits
        self._seq = 0  # the accepted count without a kernel (the kernel numbers its own)
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()

    # ---- lifecycle -------------------------------------------------------

    def reload(self, routing: Routing, meta: MetaConfig,
               clients: Mapping[str, str] | None = None) -> None:
        """Put a reloaded configuration's routing (new conversations take its tables;
        live ones keep theirs), meta flags and, when given, client profiles in
        service. The rest of `PumpOptions` needs a restart."""
        self.routing = routing
        self.meta_flags = meta
        if clients is not None:
            self.clients = dict(clients)

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
            self._dispatch.security_event("priv-on-bus", {"client": client})
            if started:
                tracing.admit(client, thread_hint(data), started, None, "unroutable",
                              "priv-on-bus")
            return self._refuse_client(client, thread_hint(data), HuhCode.UNROUTABLE)
        except Rejection as rej:
            if isinstance(rej, Violation):
                self._dispatch.security_event(rej.event, rej.fields)
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
            self._dispatch.security_event("approval-limit", gated.event)
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
            self._dispatch.emit_core(client, frame.uuid, Accepted(frame.uuid, self._seq).to_bytes())
            if parked is None:
                self._dispatch.start(msg)
            else:
                self._dispatch.park(msg, parked, None)
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
            approval = self._dispatch.park(msg, parked, held)

        def admitted(exc: BaseException | None) -> None:
            nonlocal refused
            if msg.cause is not None:  # its agentd.admit span (telemetry)
                tracer().end(msg.cause, exc)
            if exc is None:
                self._dispatch.emit_core(client, frame.uuid, Accepted(frame.uuid, seq).to_bytes())
                if held is not None:
                    held.committed(None)
                elif not optimistic:
                    batch = self._dispatch.open()
                    self._dispatch.enqueue(msg, batch)
                    self._dispatch.close(batch, None)
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
                self._dispatch.start(msg)
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
        self._dispatch.emit_core(client, thread, Huh.of(code, message).to_bytes())
        return SubmitResult(thread, code=code)

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
        batch = self._dispatch.open()
        for frame in stale:
            if frame.children:
                continue  # a call under it is still live
            self._dispatch.end(frame, ThreadEvent.ABANDONED, batch)
            ended += 1
        self._dispatch.close(batch, None)
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
        batch = self._dispatch.open()
        for frame in under:
            if frame.state is _ACTIVE and not frame.children:
                self._dispatch.end(frame, ThreadEvent.ABANDONED, batch)
        self._dispatch.end(root, ThreadEvent.ABANDONED, batch)
        self._dispatch.close(batch, None)
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
                self._dispatch.enqueue(msg, None)
            else:
                self._regate(msg, gated)
        return len(resumed)

    def _regate(self, msg: Message, gated: Park | Deny) -> None:
        """A pending request for a listener gated since it was accepted (a new
        configuration): parked for approval like any new one, never dispatched
        unapproved; its journal entry is handled (the approval row holds it now)."""
        log.warning("resumed message for a listener gated since parked for approval "
                    "listener=%s %s", ",".join(t.name for t in msg.targets), msg.frame.log_ids)
        batch = self._dispatch.open()
        assert batch is not None
        self._dispatch.hold(msg, gated, msg.frame, msg.hops, batch)
        batch.tx.delivered(msg.seq)
        self._dispatch.close(batch, None)

    def decide(self, decision: Decision, envelope: bytes | None = None) -> str | None:
        """Apply a decision on a parked message (a client's, whose `envelope` is
        journaled, or an operator's): None if it stood, else why not (logged; a
        security event)."""
        refused = self.waits.refusal(decision)
        if refused is not None:
            self._dispatch.security_event("approval-refused", refused[1])
            return refused[0]
        thread = decision.thread or self.waits.parked[decision.approval].conversation
        batch = self._dispatch.open()
        self._dispatch.apply_wait(self.waits.decide(decision, batch, self.kernel), batch)
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
        self._dispatch.close(batch, None)
        return None

    def _client_decision(self, client: str, thread: str, data: bytes, decision: Decision
                         ) -> SubmitResult:
        """A client's `approve`/`deny`: `accepted` and the outcome, or `huh
        unroutable` if it may not stand."""
        if self.decide(decision, data) is not None:
            metrics.envelopes_rejected.labels(HuhCode.UNROUTABLE.value).inc()
            self._dispatch.emit_core(client, thread, Huh.of(HuhCode.UNROUTABLE).to_bytes())
            return SubmitResult(thread, code=HuhCode.UNROUTABLE)
        return SubmitResult(thread, seq=0)
