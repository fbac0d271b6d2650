"""Dispatch: one step of the pump, from a queued message to its committed outcome.

A worker of the `Scheduler` hands a message to `handle`: the `Invoker` calls its
handler, `response.py` (or the waits, for a timer) plans what the outcome turns
into, and `_apply` carries the plan out: envelopes re-enter through the same
admission checks as client input (`_reenter`), notices go to a frame's holder,
frames end. The steps that are not a handler's (a wait's round, a decision, the end
of a conversation, an admission) apply their plans through the same methods. Each
step writes into one `Batch` and commits it (`open`, `close`). A client's request
for a handler that never suspends (the calculator) runs on the caller's stack
(`start`) when a free worker would take it at once: the same steps, no task.

Invariants:
- Nothing a handler returns is trusted for identity, thread or route: the
  dispatch sets `from` (the listener's registered name) and `thread` (from the
  registry) itself, and every envelope passes admission again.
- A step's writes commit together, before the next await; client frames are handed
  to `deliver` only once their outbox rows are durable.
- Handler output beyond a hard cap (twice `pump.max_queue`) is refused with `huh
  rate-limited` to its producer.
- Once a conversation has no open call and nothing queued it is put at rest in
  the registry (a bounded set); one pushed out of it ends as abandoned, in the same
  batch, as idle collection would end it.

This module never imports `pump.py`: the `Pump` owns the way in (client ingress,
decisions, recovery, operators) and calls the methods here.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from lxml import etree

from agentd import _metrics as metrics
from agentd._core import Huh, Step, core_from_element
from agentd._envelope import (
    PrivilegedOnBus,
    adopt_envelope,
    build_envelope,
    parse_built_envelope,
    parse_envelope,
)
from agentd._errors import HuhCode, Rejection
from agentd._handler import ChainStopped, HandlerMetadata
from agentd._routing import Listener
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, ThreadState
from agentd._xml import c14n
from agentd.durable import Deadline, StateLimitExceeded, StateView, TimerRequest
from agentd.kernel import Kernel
from agentd.pump import admission
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
from agentd.pump.gate import Deny, Park, Pass, gate
from agentd.pump.intents import IntentDesk
from agentd.pump.invoker import CallFailed, Invoker, outcome_of
from agentd.pump.message import (
    CORE,
    IntentResolver,
    Message,
    MsgKind,
    StepSink,
)
from agentd.pump.options import PumpOptions
from agentd.pump.response import ResponsePlan, plan_failure, plan_response, plan_stopped
from agentd.pump.scheduler import Scheduler
from agentd.pump.waits import WaitPlan, Waits
from agentd.telemetry import tracer

log = logging.getLogger("agentd.pump")

_ACTIVE = ThreadState.ACTIVE
_REQUEST = MsgKind.REQUEST
_INTENT = MsgKind.INTENT
_HUH_TAG = "{https://xml-pipeline.org/ns/core/v1}huh"


class Dispatch:
    """The steps of one pump. `tick` is the invoker's polling interval (the pump's,
    from the shortest listener timeout); the rest as `Pump` takes it."""

    def __init__(
        self,
        registry: ThreadRegistry,
        deliver: DeliverFn,
        options: PumpOptions,
        kernel: Kernel | None,
        on_security: Callable[[str, Mapping[str, str]], None] | None,
        intents: IntentResolver | None,
        clock: Callable[[], float],
        tick: Callable[[], float],
        steps: StepSink | None = None,
    ) -> None:
        settings = self.settings = options.pump
        self.registry = registry
        self.deliver = deliver
        self.kernel = kernel
        self.on_security = on_security
        self.max_envelope_bytes = options.max_envelope_bytes
        self.shape = options.shape
        self.gateways = options.gateways
        self.intents = IntentDesk(intents, settings, self.max_envelope_bytes, self.shape)
        # Core `step` frames for a conversation's owner who asked; None: none.
        self.steps = steps
        self.scheduler = Scheduler(self.handle, settings.max_concurrency, settings.max_queue)
        self.invoker = Invoker(tick)
        self._hard_cap = settings.max_queue * 2
        # Timers, handler state and parked messages (pump/waits.py), with the
        # daemon's one deadline scheduler; `clock` is the wall clock they run on.
        self.waits = Waits(registry, settings, self.due, clock)
        # With telemetry: the span of the handler call being applied (set between its return
        # and its commit, no await between): what it sends, its huh codes and events hang on it.
        self._span: Any = None

    def emit_core(
        self, client: str, thread: str, payload: bytes, batch: Batch | None = None
    ) -> None:
        """A core frame for a client: now, or after `batch`'s commit if one is given."""
        frame = build_envelope(CORE, thread, payload, to=client)
        if batch is None:
            self.deliver(client, thread, frame, None)
        else:
            batch.post.append((client, thread, frame, None))

    # ---- batches ---------------------------------------------------------------

    def open(self) -> Batch | None:
        kernel = self.kernel
        return None if kernel is None else Batch(kernel.transaction(), self.deliver)

    def close(self, batch: Batch | None, handled: Message | None) -> None:
        """Commit what one step produced (and mark `handled` as processed); client
        frames are handed to `deliver` only once their outbox rows are durable."""
        if handled is not None:
            root = handled.frame.root
            if not root.children and root.state is _ACTIVE and not self.scheduler.waiting(
                root.uuid
            ) and root.uuid not in self.waits.holds:
                # Nothing in progress on the conversation: at rest, so memory holds
                # only work in progress and a bounded set of resumable conversations.
                # One holding a parked message stays in progress: pushing it out of
                # the rest set would end it, and deny what waits for a human.
                for pushed in self.registry.rest(root):
                    self.end(pushed, ThreadEvent.ABANDONED, batch)
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

    def enqueue(self, msg: Message, batch: Batch | None) -> None:
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
        self.scheduler.put(msg)

    def end(self, frame: Frame, event: ThreadEvent, batch: Batch | None) -> None:
        state = self.registry.end(frame, event)
        if batch is not None and frame.persisted:
            batch.tx.thread_state(frame.uuid, state_value(state))
        if frame.parent is None and self.waits.conversations:
            for plan in self.waits.conversation_ended(frame.uuid, batch):
                self.apply_wait(plan, batch)

    # ---- handling --------------------------------------------------------------

    async def handle(self, msg: Message) -> None:
        root = msg.frame.root
        if root.state is not _ACTIVE or msg.hops >= self.settings.max_hops:
            batch = self.open()
            if root.state is not _ACTIVE:
                log.info("dropped message on ended conversation thread=%s", root.uuid)
            else:
                # Two listeners ping-ponging, or a runaway chain: stop it, tell the client.
                self._stop_chain(root, HuhCode.BUDGET_EXCEEDED, "hop limit reached", batch)
            self.close(batch, msg)
            return
        if msg.kind is _INTENT:
            await self._resolve_intent(msg)
            return
        if msg.kind is _REQUEST and len(msg.targets) > 1:
            # Broadcast: the listeners on one key run concurrently; the message counts
            # as handled once all of them have returned.
            await asyncio.gather(*(self._call(msg, t, False) for t in msg.targets))
            batch = self.open()
            self.close(batch, msg)
        else:
            await self._call(msg, msg.targets[0], True)

    def start(self, msg: Message) -> None:
        """Hand a client's admitted message to its handler: called at once on this
        stack when a free worker would take it now and run it to its end without a
        pause (a request for one listener whose handler never suspends and has a free
        slot, nothing else queued, nothing queued or running on its thread, within
        the hop limit, the lease held), else queued. Its admission was committed or
        queued for commit first, as for a worker."""
        scheduler = self.scheduler
        if not _runs_now(msg, scheduler, self.settings.max_hops, self.kernel):
            self.enqueue(msg, None)
            return
        scheduler.running += 1
        try:
            listener = msg.targets[0]
            frame, meta, steps, token, payload = _begin(self.registry, self.steps,
                                                        self.waits.book, msg, listener)
            result = self.invoker.call_now(listener, payload, meta, frame.root.uuid)
            self._finish(msg, listener, frame, meta, steps, token, result, True)
        except Exception:  # a pump bug must not reach the client's transport
            log.exception("pump error while handling a message")
        finally:
            scheduler.running -= 1

    async def _call(self, msg: Message, listener: Listener, last: bool) -> None:
        """Run one handler on one message. `last`: this call completes the message."""
        kernel = self.kernel
        if kernel is not None and kernel.lease_expired and not await kernel.lease_current():
            return  # another daemon has the lease: it runs this message (recovery)
        if listener.retired:
            batch = self.open()
            self._huh_to(msg.frame, HuhCode.UNROUTABLE, msg.hops + 1, batch, msg.ref)
            self.close(batch, msg if last else None)
            return
        frame, meta, steps, token, payload = _begin(self.registry, self.steps,
                                                    self.waits.book, msg, listener)
        result = await self.invoker.call(listener, payload, meta, frame.root.uuid)
        self._finish(msg, listener, frame, meta, steps, token, result, last)

    def _finish(self, msg: Message, listener: Listener, frame: Frame, meta: HandlerMetadata,
                steps: StepSink | None, token: Any, result: object, last: bool) -> None:
        """Plan and apply what the call's `result` turns into, and commit it."""
        hops = msg.hops + 1
        tracing = tracer()
        span = self._span = None if token is None else tracing.detach(token)
        batch = self.open()
        if meta._after_commit is not None:  # a platform handler acts once its output is durable
            if batch is None:
                meta._after_commit()
            else:
                batch.after = [*(batch.after or ()), meta._after_commit]
        if result.__class__ is ChainStopped:
            # A peer organism refused the call at its hop limit: stopped as a chain
            # that stays home is (see handle), and the call's frame ends with it.
            self._stop_chain(frame.root, result.code, "hop limit reached at a peer", batch)
            plan = plan_stopped(frame)
        elif result.__class__ is CallFailed:
            if result.event is not None:
                self.security_event("tool-denied", {**result.event, "thread": frame.root.uuid})
            plan = plan_failure(msg, frame, result.code)
        elif meta._view is not None and not self._state_fits(meta._view, listener, batch):
            plan = plan_failure(msg, frame, HuhCode.TOO_LARGE)
        elif result.__class__ is TimerRequest:
            wait = self.waits.set_timer(result, msg, listener, frame, hops, batch)
            if wait.event is not None:
                self.security_event(*wait.event)
            plan = wait.answer
            if steps is not None and not plan.envelopes and plan.notice_to is None:
                steps.send(frame.root, Step("timer-wait", listener.name,
                                            frame.call or _call_id()).to_bytes())
        else:
            plan = plan_response(msg, listener, frame, result, self.settings.max_fanout)
        self._apply(plan, listener, frame, hops, batch)
        if msg.kind is _REQUEST and batch is not None and frame.state is _ACTIVE:
            # Only a frame that outlives this transaction (a call still open: the
            # listener sent requests and awaits answers) needs a durable row; a call
            # answered at once ends inside the transaction that would create it.
            batch.tx.thread_put(thread_row(frame))
            frame.persisted = True
        self.close(batch, msg if last else None)
        if span is not None:
            self._span = None
            tracing.end_handler(span, *outcome_of(result))

    def _apply(self, plan: ResponsePlan, listener: Listener | None, frame: Frame | None,
               hops: int, batch: Batch | None, ref: str = "") -> None:
        """Carry out a plan for `listener`'s call `frame`: the notice, the envelopes,
        then the end of the frame (only once every envelope was taken: a refused
        answer leaves it open). `ref`: the call the notice is about, when that is
        not `frame`'s (a parked call's denial)."""
        if plan.notice_to is not None:
            if plan.rejected is not None:
                metrics.envelopes_rejected.labels(plan.rejected.value).inc()
                if self._span is not None:
                    tracer().event(self._span, "agentd.huh", {"code": plan.rejected.value})
            # A notice for the caller (an ack or huh) is about the call `frame` runs:
            # it carries that call's ref. One about the listener's own output, none.
            if not ref and frame is not None and plan.notice_to is frame.parent:
                ref = frame.ref
            self._reenter_core(plan.notice_to, plan.notice, hops, batch, ref)
        taken = True
        thread = plan.thread
        adopted = plan.adopted
        refs = plan.refs
        for i, data in enumerate(plan.envelopes):
            assert thread is not None and listener is not None and frame is not None
            if not self._reenter(data, listener, thread, frame, plan.respond, hops, batch,
                                 built=True, adopted=None if adopted is None else adopted[i],
                                 ref=refs[i] if refs else ""):
                taken = False
        if plan.end is not None and taken:
            assert frame is not None
            self.end(frame, plan.end, batch)
            if frame.call:  # a call shown to the owner: its result is in
                steps = self.steps
                if steps is not None and listener is not None and steps.wanted(frame):
                    steps.send(frame.root,
                               Step("tool-result", listener.name, frame.call).to_bytes())
                frame.call = ""

    def apply_wait(self, plan: WaitPlan, batch: Batch | None) -> None:
        """Carry out a wait's plan (see `WaitPlan`): its event, its frame for a
        client, its answer through `_apply`, then its approved message."""
        if plan.event is not None:
            self.security_event(*plan.event)
        if plan.client is not None:
            self.emit_core(*plan.client, batch)
        self._apply(plan.answer, plan.listener, plan.frame, plan.hops, batch, plan.ref)
        msg, own = plan.dispatch, plan.own
        if msg is not None and plan.approval and self.steps is not None:
            msg.call = plan.approval  # its tool-call and approval-wait steps had this id
        if own is None:
            if msg is not None:
                self.enqueue(msg, None)
            return
        assert self.kernel is not None
        approval = plan.approval

        def decided(exc: BaseException | None) -> None:
            if exc is not None:
                log.error("approval not recorded (still pending in the kernel) approval=%s: "
                          "%s", approval, exc)
            elif msg is not None:
                self.scheduler.put(msg)

        self.kernel.commit_then(own, decided)

    def due(self, due: list[Deadline], now: float) -> None:
        """The deadline scheduler's round: what each due timer or approval does, in
        one batch."""
        batch = self.open()
        for entry in due:
            self.apply_wait(self.waits.due(entry, now, batch, self.kernel), batch)
        self.close(batch, None)

    async def _resolve_intent(self, msg: Message) -> None:
        """Core `intent`: resolved and planned by the `IntentDesk`, applied here: the
        filled payload enters as the sender's own output (the same checks as any
        handler output: schema, dispatch table, peers; one more hop); a client's is
        gated as its own envelope would be. Nothing fits: `huh unroutable` with the
        one text that never says why."""
        frame, hops = msg.frame, msg.hops + 1
        plan = await self.intents.plan(msg)
        batch = self.open()
        if plan.journal is not None and batch is not None:
            batch.tx.journal(**plan.journal)
        filled = plan.filled
        if plan.rejected is not None:
            metrics.envelopes_rejected.labels(plan.rejected.value).inc()
            self._reenter_core(frame, plan.notice, hops, batch)
        elif plan.listener is not None:
            self._reenter(plan.envelope, plan.listener, frame, frame, False, hops, batch)
        elif filled is not None:
            filled.hops = hops
            gated = gate(filled, frame.profile.table.gates, self.waits.counts)
            if isinstance(gated, Pass):
                self.enqueue(filled, batch)
            else:
                self.hold(filled, gated, frame, hops, batch)
        self.close(batch, msg)

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
        adopted: tuple[etree._Element, str | None] | None = None, ref: str = "",
    ) -> bool:
        """Handler output re-enters through the same parse and checks as client input.
        `frame` is the envelope's thread; `own` is the listener's frame, where a `huh`
        for its bad output goes (so an LLM agent can correct itself). `built`: the
        pump built it around a serializer's payload (a `ResponsePlan`'s envelopes;
        `parse_built_envelope`); `adopted`: the payload element and `to` it was built
        from, parsed strictly out of raw output (`adopt_envelope`: no second parse).
        `ref`: the listener's reference of the call a request starts, which a refusal's
        `huh` carries back; an answer carries the ref of the call `own` runs."""
        if self.scheduler.queued >= self._hard_cap:
            self._huh_to(own, HuhCode.RATE_LIMITED, hops, batch, ref)
            return False
        try:
            if adopted is not None:
                env = adopt_envelope(data, adopted[0], listener.name, adopted[1], frame.uuid,
                                     max_bytes=self.max_envelope_bytes, shape=self.shape)
            else:
                env = (parse_built_envelope if built else parse_envelope)(
                    data, max_bytes=self.max_envelope_bytes, shape=self.shape)
            if env.thread != frame.uuid or env.sender != listener.name:  # pragma: no cover
                raise Rejection(HuhCode.INTERNAL, "envelope metadata mismatch")
            if respond:
                spec = admission.response_spec(listener, env)
                msg = admission.to_holder(env, data, listener.name, frame, spec)
                msg.ref = own.ref
            else:
                msg = admission.route_request(env, env.key, data, listener.name, listener, frame)
                msg.ref = ref
                gated = gate(msg, frame.profile.table.gates, self.waits.counts)
                if not isinstance(gated, Pass):
                    msg.hops = hops
                    if isinstance(gated, Deny):
                        return self.hold(msg, gated, own, hops, batch)
                    approval = self.park(msg, gated, batch)
                    _show_call(self.steps, msg, approval)
                    return True
        except PrivilegedOnBus:
            self.security_event("priv-from-handler",
                                 {"listener": listener.name, "thread": frame.root.uuid})
            self._huh_to(own, HuhCode.UNROUTABLE, hops, batch, ref)
            return False
        except Rejection as rej:
            if isinstance(rej, Violation):
                log.warning("peer violation blocked listener=%s to=%s key=%s %s",
                            listener.name, env.to, env.key, own.log_ids)
                self.security_event(rej.event, {**rej.fields, "thread": frame.root.uuid})
            log.info("handler output rejected listener=%s code=%s %s detail=%s",
                     listener.name, rej.code.value, own.log_ids, rej.detail)
            self._huh_to(own, rej.code, hops, batch, ref)
            return False
        msg.hops = hops
        if not respond and self.steps is not None:
            _show_call(self.steps, msg)
        self.enqueue(msg, batch)
        return True

    def hold(self, msg: Message, gated: Park | Deny, own: Frame, hops: int,
              batch: Batch | None) -> bool:
        """A gated message: parked (True), or refused with `huh` to the holder of
        `own` (carrying the message's ref) and an `approval-limit` security event
        (False)."""
        if isinstance(gated, Deny):
            self.security_event("approval-limit", gated.event)
            self._huh_to(own, gated.code, hops, batch, msg.ref)
            return False
        self.park(msg, gated, batch)
        return True

    def park(self, msg: Message, gated: Park, batch: Batch | None) -> str:
        """Park `msg` as the gate decided; its approval id."""
        row, plan = self.waits.park(msg, gated, batch, msg.frame.root.owner not in self.gateways)
        self.apply_wait(plan, batch)
        return row.id

    def _huh_to(self, frame: Frame, code: HuhCode, hops: int, batch: Batch | None,
                ref: str = "") -> None:
        metrics.envelopes_rejected.labels(code.value).inc()
        if self._span is not None:
            tracer().event(self._span, "agentd.huh", {"code": code.value})
        self._reenter_core(frame, Huh.of(code).to_bytes(), hops, batch, ref)

    def _reenter_core(self, frame: Frame, payload: bytes, hops: int, batch: Batch | None,
                      ref: str = "") -> None:
        """A core payload (ack/huh) for the holder of `frame`, re-entering like any
        output; `ref`: the holder's call it is about, if one."""
        data = build_envelope(CORE, frame.uuid, payload, to=frame.holder)
        try:
            env = parse_built_envelope(data)
            msg = admission.to_holder(env, data, CORE, frame, None)
        except Rejection as rej:
            log.info("core message dropped %s detail=%s", frame.log_ids, rej.detail)
            return
        msg.hops = hops
        msg.ref = ref
        self.enqueue(msg, batch)

    def _stop_chain(self, root: Frame, code: HuhCode, why: str, batch: Batch | None) -> None:
        log.warning("chain stopped thread=%s owner=%s why=%s", root.uuid, root.owner, why)
        metrics.envelopes_rejected.labels(code.value).inc()
        payload = Huh.of(code).to_bytes()
        if batch is None:
            self.emit_core(root.owner, root.uuid, payload)
            return
        # Durable, like any answer to the client, and after the batch's commit (never
        # before the conversation's `accepted`): a peer organism whose call this is
        # takes it as the call's reply (a frame without an outbox row never reaches it).
        envelope = build_envelope(CORE, root.uuid, payload, to=root.owner)
        journal_to_client(batch, root, CORE, _HUH_TAG, envelope)

    def security_event(self, kind: str, fields: Mapping[str, str]) -> None:
        metrics.security_events.labels(kind).inc()
        if self._span is not None:
            tracer().event(self._span, "agentd.security", {"kind": kind, **fields})
        if self.on_security is not None:
            self.on_security(kind, fields)
        else:
            detail = " ".join(f"{k}={v}" for k, v in fields.items())
            log.warning("security event kind=%s %s", kind, detail)


def _begin(registry: ThreadRegistry, steps: StepSink | None, book: Any, msg: Message,
           listener: Listener) -> tuple[Frame, HandlerMetadata, StepSink | None, Any, Any]:
    """The start of `listener`'s call on `msg`: the frame it runs in (a new one for
    a request), its metadata (`book`: the waits' state book), the step sink if its
    owner asked, its telemetry token and what the handler takes."""
    created = msg.kind is _REQUEST
    frame = registry.extend(msg.frame, listener.name) if created else msg.frame
    frame.touched = time.monotonic()
    if steps is not None and not steps.wanted(frame):
        steps = None
    if created:
        frame.ref = msg.ref
        if msg.call:
            frame.call = msg.call
    spec = msg.spec
    payload: Any = (
        msg.payload if listener.takes_element  # an isolation pool: no object to build
        else core_from_element(msg.payload) if spec is None
        else spec.from_element(msg.payload)
    )
    meta = HandlerMetadata(frame.uuid, msg.sender, listener.name, msg.redelivered, "", book,
                           frame.root.uuid, None, msg.seq, _hops=msg.hops, _ref=msg.ref,
                           _progress=None if steps is None else _progress(
                               steps, frame.root, listener.name))
    token = tracer().handler(listener.name, listener.is_agent, frame.root.uuid, msg.seq,
                             msg.redelivered, msg.cause)
    return frame, meta, steps, token, payload


def _runs_now(msg: Message, scheduler: Scheduler, max_hops: int, kernel: Kernel | None
              ) -> bool:
    """Whether `msg`, a client's, may run on the caller's stack (`Dispatch.start`).
    Only with a kernel: its frames then reach clients from commit callbacks, never
    from inside the transport's own submit (without one they would, at once)."""
    targets = msg.targets
    if (kernel is None or msg.kind is not _REQUEST or len(targets) != 1
            or not targets[0].immediate):
        return False
    listener = targets[0]
    return (listener.active < listener.max_concurrency and not listener.retired
            and msg.frame.root.state is _ACTIVE and msg.hops < max_hops
            and scheduler.free(msg.frame.uuid) and not kernel.lease_expired)


def _show_call(steps: StepSink | None, msg: Message, approval: str = "") -> None:
    """`step tool-call` (and `approval-wait` for a parked one) for the owner of
    `msg`'s conversation, if it asked. A parked call's id is its approval's, so
    its steps still share it when it is approved after a restart."""
    root = msg.frame.root
    if steps is None or not steps.wanted(msg.frame):
        return
    msg.call = call = approval or _call_id()
    payload = c14n(msg.payload)
    for target in msg.targets:
        steps.send(root, Step("tool-call", target.name, call, payload).to_bytes())
        if approval:
            steps.send(root, Step("approval-wait", target.name, call).to_bytes())


def _progress(steps: StepSink, root: Frame, listener: str) -> Any:
    """What a handler calls with its tool's progress (`HandlerMetadata._progress`):
    each report becomes `step progress` for the conversation's owner (left out
    while the owner's connection is behind)."""

    def report(progress: float, total: float | None = None,
               message: str | None = None) -> None:
        steps.send(root, Step("progress", listener, progress=progress, total=total,
                              message=message).to_bytes(), lossy=True)

    return report


def _call_id() -> str:
    return secrets.token_hex(8)
