"""Approval gates: who may decide on a parked message, and what a decision does.

Pure rules over values. A message bound for a gated listener is parked by the pump
(in the transaction that admits it) as an `ApprovalRow` that carries the gate's
rules as they were then (approvers, deadline): a reload never changes them. `judge`
says whether a decision may stand; anything else is refused with `huh unroutable`
and journaled as a security event, with the precise reason only in the log.

Invariants: a decision binds to the SHA-256 of the exact payload bytes parked (a
client's approval names it; an operator decides on the id, whose row fixes it); an
approval is decided at most once (the kernel updates only a pending row); a client
may decide only on its own thread, and only when `client` is among the approvers.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum

from agentd._schemas import NS_CORE
from agentd._states import step
from agentd._xml import escape_text
from agentd.kernel import ApprovalRow

OPERATOR = "operator"
CLIENT = "client"
NOT_APPROVED = "not approved"  # the text of the caller's `huh denied`

_C = "{" + NS_CORE + "}"
APPROVE = _C + "approve"
DENY = _C + "deny"
DECISIONS = frozenset({APPROVE, DENY})


@dataclass(frozen=True, slots=True)
class ApprovalRules:
    """A gate as configured: who may decide, and how long a message may wait."""

    approvers: tuple[str, ...]
    timeout_s: float


class ApprovalState(Enum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"
    CANCELLED = "cancelled"  # its thread ended first


class ApprovalEvent(Enum):
    APPROVE = "approve"
    DENY = "deny"
    EXPIRE = "expire"
    THREAD_ENDED = "thread-ended"


_S, _E = ApprovalState, ApprovalEvent
# A parked message is decided once: every closed state is final.
TRANSITIONS: dict[ApprovalState, dict[ApprovalEvent, ApprovalState]] = {
    _S.PENDING: {_E.APPROVE: _S.APPROVED, _E.DENY: _S.DENIED, _E.EXPIRE: _S.EXPIRED,
                 _E.THREAD_ENDED: _S.CANCELLED},
    _S.APPROVED: {},
    _S.DENIED: {},
    _S.EXPIRED: {},
    _S.CANCELLED: {},
}


def close(state: str, event: ApprovalEvent) -> ApprovalState:
    """The state a parked message in `state` takes on `event`; raises
    `IllegalTransition` for one already closed."""
    return step("approval", TRANSITIONS, ApprovalState(state), event)


@dataclass(frozen=True, slots=True)
class Decision:
    """A decision as received: from an operator (`client` None, `by` the key id) or
    from a client on `thread`; `payload_sha256` as the decider stated it (None:
    not stated, which only an operator may do)."""

    approval: str
    approve: bool
    by: str
    client: str | None = None
    thread: str | None = None
    payload_sha256: str | None = None
    reason: str = ""


def new_approval_id() -> str:
    """Opaque and unguessable: 128 random bits."""
    return secrets.token_hex(16)


def payload_sha256(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def judge(row: ApprovalRow | None, decision: Decision, now: float) -> str | None:
    """None if `decision` may stand on `row`; otherwise why not (for the log)."""
    if row is None:
        return "no such approval"
    if row.state != "pending":
        return f"approval already {row.state}"
    if now >= row.deadline:
        return "approval expired"
    if decision.client is None:
        if OPERATOR not in row.approvers:
            return "operators may not decide on this gate"
    else:
        if CLIENT not in row.approvers:
            return "clients may not decide on this gate"
        if decision.client != row.owner:
            return "decision from a client that does not own the thread"
        if decision.thread != row.conversation:
            return "decision on another thread"
    if decision.approve:
        stated = decision.payload_sha256
        if stated is None:
            if decision.client is not None:
                return "approval without the payload hash"
        elif not secrets.compare_digest(stated.lower().encode(), row.payload_sha256.encode()):
            return "payload hash does not match"
    return None


def decision_from(el: object, client: str, thread: str) -> Decision:
    """A client's core `approve`/`deny` (already valid against core.xsd)."""
    from lxml import etree

    assert isinstance(el, etree._Element)
    kids = {c.tag: (c.text or "").strip() for c in el}
    return Decision(
        approval=kids.get(_C + "approval", ""),
        approve=el.tag == APPROVE,
        by=client,
        client=client,
        thread=thread,
        payload_sha256=kids.get(_C + "payload-sha256"),
    )


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def approval_required(row: ApprovalRow) -> bytes:
    """The core `approval-required` payload for `row`'s owner: the exact payload
    bytes it would approve (as text) and their SHA-256."""
    expires = iso_time(row.deadline)
    return (
        f'<approval-required xmlns="{NS_CORE}"><approval>{row.id}</approval>'
        f"<listener>{escape_text(row.listener)}</listener>"
        f"<payload>{escape_text(row.payload.decode())}</payload>"
        f"<payload-sha256>{row.payload_sha256}</payload-sha256>"
        f"<expires>{expires}</expires></approval-required>"
    ).encode()
