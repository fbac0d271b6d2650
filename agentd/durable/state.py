"""Handler state: small string storage scoped to (listener, conversation).

`StateBook` is the daemon's in-memory mirror of the kernel's `handler_state` table,
loaded once at start: a handler's `get` is a dict read, never a kernel round trip.
A handler sees its slice through a `StateView` (`meta.state`), made on first use
only, so a handler that never touches it costs nothing. Writes go to the view's
overlay; the pump applies them (`StateBook.apply`, with the matching kernel ops in
the same transaction as the handler's output) only when the handler returned, so
its output and its state commit together or not at all.

Invariants: a slice never exceeds `max_bytes` (keys plus values, UTF-8); a listener
sees only its own slice of the conversation it serves; a conversation's slices
leave with it (`drop`).
"""

from __future__ import annotations

from collections.abc import Iterable

from agentd._errors import AgentdError

DEFAULT_MAX_BYTES = 64 * 1024
_DELETED = None


class StateLimitExceeded(AgentdError, ValueError):
    """`state.set` would take the slice over `pump.max_state_bytes_per_thread`."""


def _size(key: str, value: str) -> int:
    return len(key.encode()) + len(value.encode())


def _growth(key: str, new: str | None, old: str | None) -> int:
    """How many bytes a slice grows by when `key` goes from `old` to `new` (None:
    absent)."""
    return (0 if new is None else _size(key, new)) - (0 if old is None else _size(key, old))


class StateBook:
    """Every slice: (listener, conversation) -> {key: value}."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._slices: dict[tuple[str, str], dict[str, str]] = {}
        self._sizes: dict[tuple[str, str], int] = {}
        self._by_conversation: dict[str, set[str]] = {}

    def __len__(self) -> int:
        """Conversations with state."""
        return len(self._by_conversation)

    def __contains__(self, conversation: object) -> bool:
        return conversation in self._by_conversation

    def load(self, rows: Iterable[tuple[str, str, str, str]]) -> None:
        """(listener, conversation, key, value) rows read from the kernel."""
        for listener, conversation, key, value in rows:
            self._put(listener, conversation, key, value)

    def slice(self, listener: str, conversation: str) -> dict[str, str]:
        return self._slices.get((listener, conversation), {})

    def size(self, listener: str, conversation: str) -> int:
        return self._sizes.get((listener, conversation), 0)

    def apply(self, view: StateView) -> list[tuple[str, str | None]]:
        """Make `view`'s writes part of the book; returns them, (key, value or None
        for a delete), for the caller's kernel transaction. Raises
        `StateLimitExceeded` (and drops the writes) if they no longer fit: a view
        checked its writes against the slice as it was when the handler started, and
        calls on other frames of the conversation may have written since."""
        changes = list(view.overlay.items())
        entries = self.slice(view.listener, view.conversation)
        size = self.size(view.listener, view.conversation)
        for key, value in changes:
            size += _growth(key, value, entries.get(key))
        if size > self.max_bytes:
            view.overlay.clear()
            raise StateLimitExceeded(
                f"state of listener {view.listener} would be {size} bytes, over the limit "
                f"of {self.max_bytes} (pump.max_state_bytes_per_thread), with the writes "
                "of calls that finished first")
        for key, value in changes:
            if value is _DELETED:
                self._delete(view.listener, view.conversation, key)
            else:
                self._put(view.listener, view.conversation, key, value)
        view.overlay.clear()
        return changes

    def drop(self, conversation: str) -> bool:
        """Forget a conversation's slices; True if it had any."""
        listeners = self._by_conversation.pop(conversation, None)
        if listeners is None:
            return False
        for listener in listeners:
            self._slices.pop((listener, conversation), None)
            self._sizes.pop((listener, conversation), None)
        return True

    def _put(self, listener: str, conversation: str, key: str, value: str) -> None:
        where = (listener, conversation)
        entries = self._slices.setdefault(where, {})
        old = entries.get(key)
        self._sizes[where] = self._sizes.get(where, 0) + _growth(key, value, old)
        entries[key] = value
        self._by_conversation.setdefault(conversation, set()).add(listener)

    def _delete(self, listener: str, conversation: str, key: str) -> None:
        where = (listener, conversation)
        entries = self._slices.get(where)
        if entries is None or key not in entries:
            return
        self._sizes[where] -= _size(key, entries.pop(key))
        if not entries:
            del self._slices[where]
            del self._sizes[where]
            listeners = self._by_conversation[conversation]
            listeners.discard(listener)
            if not listeners:
                del self._by_conversation[conversation]


class StateView:
    """What a handler sees as `meta.state`: its listener's slice of the conversation
    it serves, with its own uncommitted writes on top."""

    __slots__ = ("_book", "_size", "conversation", "listener", "overlay")

    def __init__(self, book: StateBook, listener: str, conversation: str) -> None:
        self._book = book
        self.listener = listener
        self.conversation = conversation
        self.overlay: dict[str, str | None] = {}
        self._size = book.size(listener, conversation)

    def get(self, key: str, default: str | None = None) -> str | None:
        if key in self.overlay:
            value = self.overlay[key]
            return default if value is None else value
        return self._book.slice(self.listener, self.conversation).get(key, default)

    def set(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("state keys and values are strings")
        old = self.get(key)
        size = self._size + _growth(key, value, old)
        if size > self._book.max_bytes:
            raise StateLimitExceeded(
                f"state of listener {self.listener} would be {size} bytes, over the "
                f"limit of {self._book.max_bytes} (pump.max_state_bytes_per_thread)")
        self._size = size
        self.overlay[key] = value

    def delete(self, key: str) -> None:
        old = self.get(key)
        if old is not None:
            self._size -= _size(key, old)
        self.overlay[key] = _DELETED

    @property
    def dirty(self) -> bool:
        return bool(self.overlay)
