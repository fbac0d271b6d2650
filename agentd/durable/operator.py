"""The operator's command on durable conversations: `end-thread THREAD`.

Ending a client's conversation is what releases what it holds: pending timers are
cancelled, handler state is dropped and parked messages are denied "not approved"
(the client is told), in one kernel batch. The idle collector never ends a
conversation that holds a timer or a parked message, so this command is how an
operator ends one before its timers fire or its approvals expire.

The thread argument is checked before anything is looked up; an unknown, ended or
non-root thread gets one generic refusal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

from lxml import etree

from agentd.oob import CommandFailed, result_element

END_THREAD = "end-thread"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ConversationEnder(Protocol):
    def end_conversation(self, thread: str) -> bool: ...


class Flushable(Protocol):
    async def flush(self) -> None: ...


async def end_thread(pump: ConversationEnder, kernel: Flushable | None,
                     args: Mapping[str, str]) -> etree._Element:
    """Run `end-thread`: answered once the conversation's end is durable."""
    thread = args.get("thread", "")
    if not _UUID.fullmatch(thread) or not pump.end_conversation(thread):
        raise CommandFailed("invalid", "no active conversation with that thread")
    if kernel is not None:
        await kernel.flush()
    return result_element(END_THREAD, {"thread": thread, "ended": True})
