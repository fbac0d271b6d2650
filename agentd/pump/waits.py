"""What the pump keeps waiting: timers, handler state and parked messages.

The rules are pure (`agentd.durable`); this owner keeps what is pending in memory
(mirrors of the kernel's `timers`, `handler_state` and pending `approvals` rows,
loaded at recovery) and writes every change into the batch of the step that causes
it, so a timer is set with the `wait` it answers, handler state commits with the
handler's output, and a message is parked in the transaction that admits it. What
a wait's step does beyond its own rows (an envelope to re-enter, a core frame for a
client, an approved message to dispatch, a security event) it returns as a
`WaitPlan`, as `response.plan_response` returns a `ResponsePlan`: the pump applies
both, and this module never reaches into it.

Invariants:
- One deadline scheduler (`deadlines`) wakes both: timers that are due fire,
  approvals whose deadline passed expire. Each entry fires once: it leaves the
  pending maps (and `live`) before its batch is built.
- A frame with a pending timer or parked message is held (`holds`): the idle
  collector leaves it alone. When a conversation ends, its timers are cancelled,
  its handler state dropped and its parked messages denied, in the same batch.
- A parked message keeps the rules it was parked under; approval dispatches it
  once, through the same routing checks as a message that has just arrived.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from agentd import _metrics as metrics
from agentd._core import Huh
from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._routing import Listener
from agentd._threads import Frame, ThreadEvent, ThreadRegistry, ThreadState
from agentd._xml import c14n
from agentd._xmlify import spec_of
from agentd.config import PumpConfig
from agentd.durable import (
    NOT_APPROVED,
    ApprovalEvent,
    ApprovalState,
    Deadline,
    DeadlineScheduler,
    Decision,
    StateBook,
    StateView,
    TimerRequest,
    Woke,
    approval_required,
    close,
    is_late,
    judge,
    new_approval_id,
    payload_sha256,
)
from agentd.kernel import ApprovalRow, Kernel, TimerRow, Transaction
from agentd.pump import admission
from agentd.pump.batch import Batch, journal_message
from agentd.pump.gate import Park, ParkedCounts, count_down, count_up, unindex
from agentd.pump.message import CORE, Message
from agentd.pump.response import ResponsePlan, plan_failure
from agentd.telemetry import tracer

log = logging.getLogger("agentd.pump")

_ACTIVE = ThreadState.ACTIVE
_WOKE = spec_of(Woke)
TIMER, APPROVAL = "timer", "approval"
# Pending timers in all and per client (the timer tool bounds them per conversation
# too): each keeps its call's frame in memory.
MAX_TIMERS = 100_000
MAX_TIMERS_PER_CLIENT = 10_000
_NOTHING = ResponsePlan((), None, False, None, b"", None, None)
_DENIED = Huh.of(HuhCode.DENIED, NOT_APPROVED).to_bytes()


class WaitPlan(NamedTuple):
    """What one wait's step asks of the pump, applied in this order: `event` (a
    security event: kind and fields) is reported; `client` (client, thread, core
    payload) is sent to a client; `answer` is applied as a handler's outcome is, for
    `listener`'s call `frame` at `hops` (its envelopes re-enter, its notice goes to a
    holder, its frame ends); `dispatch`, an approved message, is queued once `own`
    (the approval's own transaction) has committed, or at once without one.
    `approval` names the decision `own` records, for the log; `ref`, the caller's
    reference of a parked call, which its `huh` carries back."""

    answer: ResponsePlan = _NOTHING
    listener: Listener | None = None
    frame: Frame | None = None
    hops: int = 0
    client: tuple[str, str, bytes] | None = None
    dispatch: Message | None = None
    own: Transaction | None = None
    approval: str = ""
    event: tuple[str, dict[str, str]] | None = None
    ref: str = ""


NOTHING = WaitPlan()


class Waits:
    """The pending timers, handler state and parked messages of one pump. `fire` is
    called with the entries that are due (the pump opens a batch and asks `due` what
    each does); `registry` holds the frames they wait on."""

    def __init__(self, registry: ThreadRegistry, settings: PumpConfig,
                 fire: Callable[[list[Deadline], float], None],
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self.clock = clock
        self.book = StateBook(settings.max_state_bytes_per_thread)
        self.timers: dict[str, TimerRow] = {}
        self.parked: dict[str, ApprovalRow] = {}
        # What is parked, counted as the gate (pump/gate.py) bounds it.
        self.counts = ParkedCounts(settings.max_parked_bytes,
                                   settings.max_parked_bytes_per_client)
        self._timers_of: dict[str, set[str]] = {}  # conversation -> timer ids
        self._timer_owner: dict[str, str] = {}  # conversation with timers -> its client
        self._timers_by_owner: dict[str, int] = {}  # client -> pending timers
        self.max_timers_per_client = MAX_TIMERS_PER_CLIENT
        self.live: set[tuple[str, str]] = set()  # (kind, id) still pending
        self.holds: dict[str, int] = {}  # frame uuid -> pending timers and parked messages
        self.deadlines = DeadlineScheduler(fire, self.live, clock)
        metrics.approvals_pending.set_function(lambda: len(self.parked))

    @property
    def parked_bytes(self) -> int:
        return self.counts.bytes

    @property
    def conversations(self) -> bool:
        """Anything kept per conversation at all (the pump's cheap test at frame end)."""
        return bool(self._timers_of or self.parked or self.book)

    # ---- handler state ----------------------------------------------------------

    def commit_state(self, view: StateView, batch: Batch | None) -> None:
        if not view.overlay:
            return
        changes = self.book.apply(view)
        if batch is None:
            return
        tx = batch.tx
        for key, value in changes:
            if value is None:
                tx.state_delete(view.listener, view.conversation, key)
            else:
                tx.state_put(view.listener, view.conversation, key, value)

    # ---- timers -----------------------------------------------------------------

    def set_timer(self, req: TimerRequest, msg: Message, listener: Listener, frame: Frame,
                  hops: int, batch: Batch | None) -> WaitPlan:
        """The timer tool answered `wait`: keep the call open, durable with this step;
        past the limits on pending timers the call fails `huh denied`."""
        conversation = frame.root.uuid
        if (len(self._timers_of.get(conversation, ())) >= req.max_pending
                or len(self.timers) >= MAX_TIMERS
                or self._timers_by_owner.get(frame.root.owner, 0) >= self.max_timers_per_client):
            return WaitPlan(plan_failure(msg, frame, HuhCode.DENIED), listener, frame, hops,
                            event=("tool-denied", {
                                "listener": listener.name, "cause": "too many pending timers",
                                "thread": conversation, "pending": str(len(self.timers))}))
        now = self.clock()
        row = TimerRow(new_approval_id(), conversation, frame.uuid, listener.name,
                       now + req.seconds, req.note, hops, now)
        self._add_timer(row, frame.root.owner)
        if batch is not None:
            batch.tx.timer_put(row)
        return NOTHING

    def _add_timer(self, row: TimerRow, owner: str) -> None:
        self.timers[row.id] = row
        self._timers_of.setdefault(row.conversation, set()).add(row.id)
        self._timer_owner[row.conversation] = owner
        count_up(self._timers_by_owner, owner)
        count_up(self.holds, row.frame)
        self.live.add((TIMER, row.id))
        self.deadlines.schedule(row.due, TIMER, row.id)

    def _drop_timer(self, timer_id: str, batch: Batch | None) -> TimerRow | None:
        row = self.timers.pop(timer_id, None)
        if row is None:
            return None
        self.live.discard((TIMER, timer_id))
        more = unindex(self._timers_of, row.conversation, timer_id)
        owner = (self._timer_owner.get(row.conversation) if more
                 else self._timer_owner.pop(row.conversation, None))
        if owner is not None:
            count_down(self._timers_by_owner, owner)
        count_down(self.holds, row.frame)
        if batch is not None:
            batch.tx.timer_delete(timer_id)
        return row

    def _fire_timer(self, timer_id: str, now: float, batch: Batch | None) -> WaitPlan:
        """A due timer answers its call with `woke`, which re-enters as the call's
        answer (and ends the call once taken); a timer whose call ended is dropped."""
        row = self._drop_timer(timer_id, batch)
        if row is None:
            return NOTHING
        frame = self._registry.get(row.frame)
        caller = None if frame is None else frame.parent
        listener = None if frame is None else frame.profile.table.listeners.get(row.listener)
        if (frame is None or caller is None or listener is None or frame.state is not _ACTIVE
                or frame.root.state is not _ACTIVE):
            log.info("timer cancelled: its call ended timer=%s thread=%s", row.id,
                     row.conversation)
            return NOTHING
        body = _WOKE.to_bytes(Woke(note=row.note, late=is_late(row.due, now)))
        data = build_envelope(listener.name, caller.uuid, body, to=caller.holder)
        answer = ResponsePlan([data], caller, True, None, b"", None, ThreadEvent.ANSWERED)
        return WaitPlan(answer, listener, frame, row.hops)

    # ---- approval gates ---------------------------------------------------------

    def park(self, msg: Message, gate: Park, batch: Batch | None, tell_owner: bool
             ) -> tuple[ApprovalRow, WaitPlan]:
        """Park `msg` instead of dispatching it, as `gate` decided; its thread's owner
        is told unless `tell_owner` is False (a peer organism: everything it is sent on
        a call's thread is taken as the call's answer, so its call waits for the
        outcome instead, or its call_timeout_s)."""
        frame = msg.frame
        root = frame.root
        payload = c14n(msg.payload)
        now = self.clock()
        rules = gate.rules
        row = ApprovalRow(new_approval_id(), root.uuid, frame.uuid, root.owner, gate.listener,
                          msg.sender, msg.hops, msg.envelope, payload,
                          payload_sha256(payload), rules.approvers, now, now + rules.timeout_s,
                          call_ref=msg.ref)
        self._add_parked(row)
        self.deadlines.schedule(row.deadline, APPROVAL, row.id)
        if batch is not None:
            tx = batch.tx
            tx.approval_put(row)
            self._audit(tx, "approval-request", row, {"sender": row.sender,
                                                      "approvers": ",".join(row.approvers)})
        plan = NOTHING
        if tell_owner:
            plan = self._to_owner(row, approval_required(row), batch)
        # Only the envelope is held until the decision: it is what runs; the payload
        # bytes were for the owner and the hash, both done.
        self.parked[row.id] = row._replace(payload=b"")
        log.info("message parked for approval approval=%s listener=%s %s", row.id,
                 row.listener, frame.log_ids)
        return row, plan

    def refusal(self, decision: Decision) -> tuple[str, dict[str, str]] | None:
        """Why `decision` may not stand, with the fields of its `approval-refused`
        security event; None if it stands."""
        row = self.parked.get(decision.approval)
        why = judge(row, decision, self.clock())
        if why is None:
            return None
        return why, {
            "approval": decision.approval[:64], "by": decision.by, "cause": why,
            "thread": decision.thread or (row.conversation if row is not None else ""),
            "client": decision.client or ""}

    def decide(self, decision: Decision, batch: Batch | None, kernel: Kernel | None
               ) -> WaitPlan:
        """Apply a decision that `refusal` let stand (a client's or an operator's)."""
        row = self.parked[decision.approval]
        event = ApprovalEvent.APPROVE if decision.approve else ApprovalEvent.DENY
        return self.settle(row, event, decision.by, decision.reason, batch, kernel)

    def settle(self, row: ApprovalRow, event: ApprovalEvent, by: str, reason: str,
               batch: Batch | None, kernel: Kernel | None) -> WaitPlan:
        """Close a parked message: dispatch it once (approved) or tell its caller
        `huh denied` "not approved"."""
        self.unpark(row.id)
        frame = self._registry.get(row.frame)
        alive = (frame is not None and frame.state is _ACTIVE
                 and frame.root.state is _ACTIVE)
        if not alive and event is ApprovalEvent.APPROVE:
            event = ApprovalEvent.THREAD_ENDED
        outcome = close(row.state, event)
        metrics.approvals_total.labels(row.listener, outcome.value).inc()
        # An approval is its own transaction, and the message runs only once it has
        # committed: a crash before leaves it pending, after, the journal resumes it.
        own = kernel.transaction() if outcome is ApprovalState.APPROVED and kernel else None
        tx = own if own is not None else (batch.tx if batch is not None else None)
        if tx is not None:
            tx.approval_decide(row.id, outcome.value, by, reason, self.clock())
            self._audit(tx, "approval-decision", row, {
                "outcome": outcome.value, "by": by, "reason": reason})
        log.info("approval %s approval=%s listener=%s by=%s thread=%s", outcome.value,
                 row.id, row.listener, by, row.conversation)
        tracing = tracer()
        waited = None if not tracing.enabled else tracing.approval(
            row.conversation, row.listener, outcome.value, by, row.created)
        if frame is None or not alive:
            if row.frame == row.conversation:  # the caller is the client: still told
                return WaitPlan(client=(row.owner, row.conversation, _DENIED))
            return NOTHING
        if outcome is not ApprovalState.APPROVED:
            return WaitPlan(ResponsePlan((), None, False, frame, _DENIED, None, None),
                            None, frame, row.hops, ref=row.call_ref)
        msg = self._route_again(row, frame)
        if isinstance(msg, HuhCode):  # refused: the code its sender is answered
            answer = ResponsePlan((), None, False, frame, Huh.of(msg).to_bytes(), msg, None)
            return WaitPlan(answer, None, frame, row.hops, own=own, approval=row.id,
                            ref=row.call_ref)
        msg.cause = waited  # its handling hangs from the wait
        if own is not None:
            msg.seq = journal_message(own, msg, approved=True)
        return WaitPlan(dispatch=msg, own=own, approval=row.id)

    def _route_again(self, row: ApprovalRow, frame: Frame) -> Message | HuhCode:
        """As if it had just arrived: routed again against the thread's table (and the
        sender's peers); a refusal is the code its sender is answered."""
        from_client = frame.is_root and row.sender == frame.owner
        sender = None if from_client else frame.profile.table.listeners.get(row.sender)
        try:
            if sender is None and not from_client:
                raise Rejection(HuhCode.UNROUTABLE, "sender gone")
            env = parse_envelope(row.envelope, max_bytes=max(len(row.envelope), 1))
            msg = admission.route_request(env, env.key, row.envelope, row.sender, sender,
                                          frame)
        except Rejection as rej:
            log.info("approved message no longer routable approval=%s detail=%s", row.id,
                     rej.detail)
            return rej.code
        msg.hops = row.hops
        msg.ref = row.call_ref
        return msg

    def _add_parked(self, row: ApprovalRow) -> None:
        self.parked[row.id] = row
        self.counts.add(row)
        self.live.add((APPROVAL, row.id))
        count_up(self.holds, row.frame)

    def unpark(self, approval_id: str) -> None:
        row = self.parked.pop(approval_id, None)
        if row is None:
            return
        self.counts.remove(row)
        self.live.discard((APPROVAL, approval_id))
        count_down(self.holds, row.frame)

    # ---- the end of a conversation, recovery, the scheduler -----------------------

    def conversation_ended(self, conversation: str, batch: Batch | None) -> list[WaitPlan]:
        """Its timers cancelled, its handler state dropped, its parked messages
        denied: what that sends, as plans."""
        for timer_id in list(self._timers_of.get(conversation, ())):
            self._drop_timer(timer_id, batch)
        if self.book.drop(conversation) and batch is not None:
            batch.tx.state_drop(conversation)
        return [self.settle(self.parked[approval_id], ApprovalEvent.THREAD_ENDED,
                            "thread-ended", "", batch, None)
                for approval_id in list(self.counts.ids_of.get(conversation, ()))]

    async def recover(self, kernel: Kernel) -> None:
        """Load what was pending before the restart; timers whose call no longer
        exists are cancelled, approvals due meanwhile expire at the first round."""
        self.book.load(await kernel.handler_state())
        registry = self._registry
        stale: list[str] = []
        for timer in await kernel.timers():
            frame = registry.get(timer.frame)
            if frame is None:
                stale.append(timer.id)
            else:
                self._add_timer(timer, frame.root.owner)
        for row in await kernel.approvals(payloads=False):
            self._add_parked(row)
            self.deadlines.schedule(row.deadline, APPROVAL, row.id)
        if stale:
            tx = kernel.transaction()
            for timer_id in stale:
                tx.timer_delete(timer_id)
            await kernel.commit(tx)
            log.info("timers of ended calls cancelled at recovery count=%d", len(stale))
        if self.parked:
            log.info("approvals pending at recovery count=%d", len(self.parked))

    def due(self, entry: Deadline, now: float, batch: Batch | None, kernel: Kernel | None
            ) -> WaitPlan:
        """What a due entry does: a timer answers its call, an approval expires."""
        if entry.kind == TIMER:
            return self._fire_timer(entry.id, now, batch)
        row = self.parked.get(entry.id)
        if row is None:
            return NOTHING
        return self.settle(row, ApprovalEvent.EXPIRE, "deadline", "", batch, kernel)

    def _to_owner(self, row: ApprovalRow, payload: bytes, batch: Batch | None) -> WaitPlan:
        """A core frame for the thread's owner, through the durable outbox."""
        if batch is None:
            return WaitPlan(client=(row.owner, row.conversation, payload))
        data = build_envelope(CORE, row.conversation, payload, to=row.owner)
        tx = batch.tx
        tx.journal(thread=row.conversation, direction="out", kind="reply", handler=row.owner,
                   sender=CORE, tag="approval-required", payload=data)
        oid = tx.outbox_put(row.owner, row.conversation, data)
        batch.post.append((row.owner, row.conversation, data, oid))
        return NOTHING

    @staticmethod
    def _audit(tx: Transaction, kind: str, row: ApprovalRow, fields: dict[str, str]) -> None:
        body = {"approval": row.id, "listener": row.listener, "thread": row.conversation,
                "payload_sha256": row.payload_sha256, **fields}
        tx.journal(thread=row.conversation, direction="audit", kind=kind,
                   handler=row.listener, sender=fields.get("by", row.sender),
                   payload=json.dumps(body, sort_keys=True).encode())
