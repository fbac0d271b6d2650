"""What an agent's task may touch, shared by the platform and the agent loop (which
an isolated agent's worker runs without the rest of the platform): only its own
threads, and answers of a bounded size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentd._xml import escape_text
from agentd.tools.content import xml_safe

if TYPE_CHECKING:
    from agentd._threads import ThreadRegistry

MAX_ANSWER_CHARS = 60_000  # core:text allows 65536
# What an answer's text may take once escaped, in UTF-8: well inside the envelope
# limit (256 KiB), whatever the text holds ("&" becomes five bytes, a character four).
MAX_ANSWER_BYTES = 192 * 1024


def bounded_answer(text: str) -> str:
    """A model's final text as an answer the pump will take: characters XML forbids
    replaced (U+FFFD), cut to MAX_ANSWER_CHARS and to MAX_ANSWER_BYTES once escaped.
    An answer the pump refused went back to an agent whose task had ended, and the
    caller was never answered."""
    text = xml_safe(text)  # a model may write characters XML forbids
    cut = len(text) > MAX_ANSWER_CHARS
    if cut:
        text = text[:MAX_ANSWER_CHARS]
    size = len(escape_text(text).encode())
    while size > MAX_ANSWER_BYTES:
        cut = True
        text = text[: len(text) * MAX_ANSWER_BYTES // size - 1]
        size = len(escape_text(text).encode())
    return text + " [truncated]" if cut else text


class IsolationError(Exception):
    """An agent asked about a thread that is not one of its own tasks."""


@dataclass(frozen=True)
class ThreadScope:
    conversation: str  # the client conversation (root frame) the thread belongs to
    token_budget: int | None = None  # the conversation's budget (its profile's)
    owner: str = ""  # the client that owns the conversation
    profile: str = ""  # the conversation's profile


ThreadResolver = Callable[[str], ThreadScope | None]


def registry_resolver(registry: ThreadRegistry) -> ThreadResolver:
    """Scopes from the pump's thread registry: conversation = root frame, budget =
    the thread's profile `token_budget`. Platform-side only: agents never see it."""

    def resolve(uuid: str) -> ThreadScope | None:
        frame = registry.get(uuid)
        if frame is None:
            return None
        return ThreadScope(frame.root.uuid, frame.profile.token_budget, frame.root.owner,
                           frame.profile.name)

    return resolve
