"""Per-thread history (an agent's context buffer): append-only, one per frame.

A `Turn` is immutable. The store is keyed by the frame UUID the agent's task runs in
(tool results come back on that same frame), so a thread's history is exactly one
task's conversation. Only the platform appends; agents read their own thread only,
through the platform.

`InMemoryHistoryStore` serves in-process runs and tests. `KernelHistoryStore` writes
through to the kernel's context buffer (`Transaction.context_append`, committed by
the kernel's batching writer) and keeps a read cache, so a restarted daemon can read
a thread's history back from the database.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agentd.llm import ToolCall

if TYPE_CHECKING:
    from agentd.kernel import Kernel

log = logging.getLogger("agentd.platform.history")

# What a turn is: the task (layer 4), a reply of the model, a result that came back
# through the pump (a peer's response, a huh or an ack), or a notice the platform
# itself fed back (a call it refused before dispatch).
TASK, ASSISTANT, RESULT, NOTICE = "task", "assistant", "result", "notice"


@dataclass(frozen=True, slots=True)
class Turn:
    kind: str  # task | assistant | result | notice
    content: str
    source: str = ""  # for results: the sender (a peer's name, or "platform")
    xml: bool = False  # content is a C14N payload
    # For results: the journal seq of the message that carried it (0: none), the same
    # when that message is redelivered after a crash, so it is recorded once.
    seq: int = 0
    # Native tool calling: a reply's provider tool calls (their ids are durable with
    # it: a call id becomes at most one message); a result's call id and whether it
    # is an error result.
    calls: tuple[ToolCall, ...] = ()
    call_id: str = ""
    is_error: bool = False

    @property
    def native(self) -> bool:
        return bool(self.calls or self.call_id)

    @property
    def role_label(self) -> str:
        """The slot's role as stored by the kernel: `kind[:source][+xml][+call][@seq]`
        (`+call`: the content is JSON holding the text and the calls, or the result
        and its call id)."""
        label = f"{self.kind}:{self.source}" if self.source else self.kind
        return (label + ("+xml" if self.xml else "") + ("+call" if self.native else "")
                + (f"@{self.seq}" if self.seq else ""))

    def slot(self) -> tuple[str, bytes]:
        """(role label, content bytes) as the kernel stores the turn."""
        if not self.native:
            return self.role_label, self.content.encode()
        body: dict[str, Any] = {"text": self.content}
        if self.calls:
            body["calls"] = [[c.id, c.name, c.arguments] for c in self.calls]
        if self.call_id:
            body["call"], body["error"] = self.call_id, self.is_error
        return self.role_label, json.dumps(body, ensure_ascii=False).encode()

    @classmethod
    def from_slot(cls, role: str, content: bytes) -> Turn:
        role, at, seq = role.rpartition("@") if "@" in role else (role, "", "")
        if at and not seq.isdigit():  # not ours: keep the label whole
            role, seq = f"{role}@{seq}", ""
        native = role.endswith("+call")
        role = role.removesuffix("+call")
        xml = role.endswith("+xml")
        role = role.removesuffix("+xml")
        kind, _, source = role.partition(":")
        text = content.decode("utf-8", "replace")
        if not native:
            return cls(kind, text, source, xml, int(seq or 0))
        body = json.loads(text)
        calls = tuple(ToolCall(str(i), str(n), str(a)) for i, n, a in body.get("calls", ()))
        return cls(kind, str(body["text"]), source, xml, int(seq or 0), calls,
                   str(body.get("call", "")), bool(body.get("error", False)))


class HistoryStore(Protocol):
    def append(self, thread: str, turn: Turn) -> None: ...

    async def read(self, thread: str) -> Sequence[Turn]: ...

    def drop(self, thread: str) -> None: ...


class HistoryFull(Exception):
    """The thread's context buffer cannot take another turn."""


class InMemoryHistoryStore:
    def __init__(self, max_turns: int = 1000) -> None:
        self.max_turns = max_turns
        self._threads: dict[str, list[Turn]] = {}

    def append(self, thread: str, turn: Turn) -> None:
        turns = self._threads.setdefault(thread, [])
        if len(turns) >= self.max_turns:
            raise HistoryFull(f"more than {self.max_turns} turns")
        turns.append(turn)

    async def read(self, thread: str) -> Sequence[Turn]:
        return tuple(self._threads.get(thread, ()))

    def drop(self, thread: str) -> None:
        self._threads.pop(thread, None)

    def __len__(self) -> int:
        return len(self._threads)


class KernelHistoryStore:
    """Write-through to the kernel's context buffers; reads from a cache, falling back
    to the database (after a restart)."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel
        self._cache: dict[str, list[Turn]] = {}

    def append(self, thread: str, turn: Turn) -> None:
        from agentd.kernel import ContextLimitExceeded

        tx = self._kernel.transaction()
        try:
            tx.context_append(thread, *turn.slot())
            fut = self._kernel.commit(tx)
        except ContextLimitExceeded as exc:
            raise HistoryFull(str(exc)) from None
        fut.add_done_callback(_log_failure)
        self._cache.setdefault(thread, []).append(turn)

    async def read(self, thread: str) -> Sequence[Turn]:
        cached = self._cache.get(thread)
        if cached is not None:
            return tuple(cached)
        await self._kernel.flush()
        slots = await self._kernel.context(thread)
        turns = [Turn.from_slot(role, content) for _, role, content in slots]
        if turns:
            self._cache[thread] = turns
        return tuple(turns)

    def drop(self, thread: str) -> None:
        self._cache.pop(thread, None)
        tx = self._kernel.transaction()
        tx.context_drop(thread)
        self._kernel.commit(tx).add_done_callback(_log_failure)


def _log_failure(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("history write failed: %s", fut.exception())


def part_text(turn: Turn) -> str:
    """A turn as its segment keeps it (what relevance, summaries and unfold read):
    a reply's provider tool calls are written after its text."""
    if not turn.calls:
        return turn.content
    calls = "\n".join(f"[tool call {c.id}: {c.name} {c.arguments}]" for c in turn.calls)
    return f"{turn.content}\n{calls}" if turn.content else calls
