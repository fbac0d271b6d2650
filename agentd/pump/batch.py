"""The durable writes of one step of the pump, and the journal rows it is made of.

A `Batch` is one kernel transaction plus the client frames to hand to `deliver`
once it commits: everything handling one message produces (its journal entries,
thread rows, outbox rows and the `delivered` mark of the handled message) commits
together or not at all. The pump opens a batch, passes it explicitly to whatever
adds to it, and commits it; with no kernel there is no batch (None) and client
frames are delivered at once.

Invariant: a client frame is shown to its client only after the transaction holding
its outbox row committed (so `accepted` always precedes what follows it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agentd._threads import Frame, ThreadState
from agentd.kernel import ThreadRow, Transaction
from agentd.pump.message import Message, MsgKind

log = logging.getLogger("agentd.pump")

# (client id, thread uuid, envelope bytes, outbox id) -> None; must not block. The
# outbox id is set for frames kept in the kernel's durable outbox until delivered.
DeliverFn = Callable[[str, str, bytes, "int | None"], None]

# Journal kinds of pump traffic: a request is routed by key, a reply goes to the
# holder of its frame; an approved request is a request a human approved at its
# listener's gate (recovery dispatches it; an unapproved request for a listener
# gated since is parked instead). The suffix is the message's hop count (kept
# across restarts).
REQUEST, REPLY, APPROVED = "request", "reply", "approved"


def journal_kind(to_holder: bool, hops: int) -> str:
    return f"{REPLY if to_holder else REQUEST}/{hops}"


def split_kind(kind: str) -> tuple[str, int, str]:
    """(base, hops, call ref) of a journal kind `base/hops[/ref]`."""
    base, _, rest = kind.partition("/")
    hops, _, ref = rest.partition("/")
    return base, int(hops or 0), ref


# Journal kinds by hop count, prebuilt (one is needed per journaled message).
_KINDS = {to_holder: tuple(journal_kind(to_holder, h) for h in range(64))
          for to_holder in (False, True)}
_STATE_VALUES = {state: state.value for state in ThreadState}  # Enum.value is slow


class Batch:
    __slots__ = ("after", "deliver", "post", "tx")

    def __init__(self, tx: Transaction, deliver: DeliverFn) -> None:
        self.tx = tx
        self.deliver = deliver
        self.post: list[tuple[str, str, bytes, int | None]] = []
        self.after: list[Callable[[], None]] | None = None  # run once committed

    def committed(self, exc: BaseException | None) -> None:
        """The kernel's callback: hand the batch's client frames to `deliver`."""
        if exc is not None:
            # Not acknowledged, so redelivered after a restart; the outbox rows did
            # not commit either, so nothing is shown to the client now.
            log.error("journal commit failed: %s", exc)
            return
        deliver = self.deliver
        for client, thread, data, oid in self.post:
            deliver(client, thread, data, oid)
        if self.after is not None:
            for callback in self.after:
                callback()


def journal_message(tx: Transaction, msg: Message, approved: bool = False) -> int:
    """Journal an admitted message as pending until handled; returns its seq.
    `approved`: a request released by its gate's approval."""
    to_holder = msg.kind is MsgKind.TO_HOLDER
    hops, targets = msg.hops, msg.targets
    kinds = _KINDS[to_holder]
    if approved:
        kind = f"{APPROVED}/{hops}"
    else:
        kind = kinds[hops] if hops < len(kinds) else journal_kind(to_holder, hops)
    if msg.ref:  # the call it starts or answers, kept for a restart
        kind = f"{kind}/{msg.ref}"
    return tx.journal(
        thread=msg.frame.uuid,
        direction="in",
        kind=kind,
        handler=targets[0].name if len(targets) == 1 else ",".join(t.name for t in targets),
        sender=msg.sender,
        tag=msg.payload.tag,
        payload=msg.envelope,
        profile=msg.frame.profile.name,
        pending=True,
    )


def journal_outgoing(batch: Batch, msg: Message) -> None:
    """A message for a client (the holder of a root frame): see `journal_to_client`."""
    frame = msg.frame
    journal_to_client(batch, frame, msg.sender, msg.payload.tag, msg.envelope)


def journal_to_client(batch: Batch, root: Frame, sender: str, tag: str, envelope: bytes
                      ) -> None:
    """An envelope for the client that owns `root`: journaled as sent and put in the
    client's durable outbox; handed over once the batch commits."""
    tx = batch.tx
    client, thread = root.owner, root.uuid
    tx.journal(thread=thread, direction="out", kind=REPLY, handler=client, sender=sender,
               tag=tag, payload=envelope, profile=root.profile.name)
    oid = tx.outbox_put(client, thread, envelope)
    batch.post.append((client, thread, envelope, oid))


def thread_row(frame: Frame) -> ThreadRow:
    now = time.time()
    profile = frame.profile
    parent = frame.parent
    # uuid, path, parent, owner, profile, table_version, state, created, updated, hops, ref
    return ThreadRow(frame.uuid, frame.path, parent.uuid if parent is not None else None,
                     frame.owner, profile.name, profile.table.version,
                     _STATE_VALUES[frame.state], now, now, 0, frame.ref)


def state_value(state: ThreadState) -> str:
    return _STATE_VALUES[state]
