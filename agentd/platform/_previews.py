"""Previews of an agent's model text as it is written (streaming): whether the
client that owns a thread gets them, and the writer one model call's text goes to.
The platform opens one per call and hands it to the metered call as its sink."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from agentd.config import OrganismConfig
from agentd.platform._scope import ThreadScope


class PreviewWriter(Protocol):
    """Where one model call's text goes as it is written (a `TextSink`), closed when
    the call ends (`interrupted`: it failed after writing)."""

    def piece(self, text: str) -> None: ...

    def interrupted(self) -> None: ...

    def close(self, interrupted: bool = False) -> None: ...


# (owner client, client thread, agent, configured) -> a writer, or None: nobody asked
# for previews (`configured`: the agent's listener or the profile streams anyway).
PreviewOpener = Callable[[str, str, str, bool], PreviewWriter | None]


class Previews:
    """Which agents and profiles stream, and the opener the daemon bound (none: no
    client can ask for previews)."""

    def __init__(self, config: OrganismConfig) -> None:
        self.config = config
        self._opener: PreviewOpener | None = None
        self._streaming = frozenset(lst.name for lst in config.listeners
                                    if lst.agent is not None and lst.stream)

    def bind(self, opener: PreviewOpener | None) -> None:
        self._opener = opener

    def open(self, agent: str, thread: str,
             resolve: Callable[[str], ThreadScope | None] | None) -> PreviewWriter | None:
        """The writer for `agent`'s next model call on `thread`, or None: no opener
        bound, a thread no client owns, or nobody asked."""
        opener, scope = self._opener, None
        if opener is None:
            return None
        scope = resolve(thread) if resolve is not None else None
        if scope is None or not scope.owner:
            return None
        profile = self.config.profiles.get(scope.profile)
        configured = agent in self._streaming or (profile is not None and profile.stream)
        return opener(scope.owner, scope.conversation, agent, configured)
