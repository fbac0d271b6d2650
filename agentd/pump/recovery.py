"""Recovery after a restart: frames rebuilt from the kernel's thread table, and the
journal's pending messages resumed through the same checks as live traffic.

Delivery is at least once: a resumed message reaches its handler with
`redelivered=True`. A message that can no longer be resumed (its frame, profile,
route or responder is gone, or it no longer validates) is marked handled rather
than retried forever.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from agentd._envelope import parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._routing import Listener, Profile
from agentd._threads import Frame, ThreadRegistry, log_ids
from agentd.kernel import Kernel, ThreadRow
from agentd.pump.admission import INTENT, intent_message, response_spec, to_holder, validate
from agentd.pump.batch import APPROVED, REQUEST, split_kind
from agentd.pump.message import CORE, Message, MsgKind

log = logging.getLogger("agentd.pump")

_APPROVED_KIND = APPROVED + "/"


def rebuild_frames(rows: Iterable[ThreadRow], profiles: Mapping[str, Profile]) -> dict[str, Frame]:
    """Frames for the active thread rows whose profile and ancestors still exist."""
    by_uuid = {r.uuid: r for r in rows}
    frames: dict[str, Frame] = {}

    def conversation_of(uuid: str) -> str:
        # The root's UUID, the one the client knows, for the log line.
        while (row := by_uuid.get(uuid)) is not None and row.parent:
            uuid = row.parent
        return uuid

    def build(uuid: str) -> Frame | None:
        if uuid in frames:
            return frames[uuid]
        row = by_uuid.get(uuid)
        if row is None:
            return None
        profile = profiles.get(row.profile)
        if profile is None:
            log.warning("profile %s no longer exists %s", row.profile,
                        log_ids(conversation_of(uuid), uuid))
            return None
        parent = build(row.parent) if row.parent else None
        if row.parent and parent is None:
            return None
        frame = Frame(row.uuid, row.path, parent, row.owner, profile)
        frame.persisted = True
        frame.ref = row.call_ref
        if parent is not None:
            parent.children += 1
        frames[uuid] = frame
        return frame

    for uuid in by_uuid:
        build(uuid)
    return frames


def resume(
    kind: str, thread: str, data: bytes | None, handlers: str,
    frames: Mapping[str, Frame], listeners: Mapping[str, Listener],
) -> Message | None:
    """The message a pending journal entry stands for, or None if it cannot resume."""
    frame = frames.get(thread)
    if frame is None or data is None:
        return None
    base, hops, ref = split_kind(kind)
    if base == APPROVED:  # routed as any request; the pump knows it was approved
        base = REQUEST
    try:
        env = parse_envelope(data, max_bytes=max(len(data), 1))
        if base == REQUEST and env.key == INTENT:
            sender = listeners.get(env.sender) if env.sender != frame.owner else None
            msg = intent_message(env, data, env.sender, sender, frame)
        elif base == REQUEST:
            names = set(handlers.split(",")) if handlers else set()
            targets = tuple(t for t in frame.profile.table.resolve(env.key, env.to)
                            if t.name in names and not t.retired)
            if not targets:
                raise Rejection(HuhCode.UNROUTABLE, "route gone after restart")
            spec = frame.profile.table.specs[env.key]
            validate(spec, env)
            msg = Message(MsgKind.REQUEST, env.sender, frame, env.payload, targets, spec, data)
        else:
            if env.sender == CORE:
                spec = None
            else:
                responder = listeners.get(env.sender)
                if responder is None:
                    raise Rejection(HuhCode.UNROUTABLE, "responder gone after restart")
                spec = response_spec(responder, env)
            msg = to_holder(env, data, env.sender, frame, spec)
    except Rejection as rej:
        log.warning("recovered message refused %s: %s", frame.log_ids, rej.detail)
        return None
    msg.hops = hops
    msg.ref = ref
    return msg


async def recover(kernel: Kernel, listeners: Mapping[str, Listener],
                  profiles: Mapping[str, Profile], registry: ThreadRegistry
                  ) -> list[tuple[Message, bool]]:
    """Rebuild the registry's frames from `kernel` and return the pending messages to
    queue again, in journal order, each with whether a human approved it at its
    listener's gate (entries that cannot resume are marked handled)."""
    frames = rebuild_frames(await kernel.threads(state="active"), profiles)
    for frame in frames.values():
        registry.add(frame)
    resumed: list[tuple[Message, bool]] = []
    for entry in await kernel.pending_messages():
        msg = resume(entry.kind, entry.thread, entry.payload, entry.handler, frames, listeners)
        if msg is None:
            log.warning("journal entry %d cannot be resumed; marking it handled", entry.seq)
            tx = kernel.transaction()
            tx.delivered(entry.seq)
            await kernel.commit(tx)
            continue
        msg.seq = entry.seq
        msg.redelivered = True
        resumed.append((msg, entry.kind.startswith(_APPROVED_KIND)))
    return resumed
