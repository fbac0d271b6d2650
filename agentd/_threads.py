"""The thread registry: opaque UUIDs mapped privately to call-chain frames.

A frame is one call: `path` is the chain of callers ending with the frame's owner
(for a client's conversation, just the client id). A request sent from frame F to
listener L runs L in a new child frame `extend(F, L)`; L's `respond()` goes back to
F's owner on F. Every frame has its own random UUID, so any number of concurrent
conversations can share the same path (the reference implementation mapped
path->UUID one-to-one and broke here).

Invariants:
- A frame's profile is fixed at creation and never wider than its parent's
  (profile monotonicity); a child simply inherits its parent's profile object.
- Paths are never shown to handlers, agents or clients; only `introspect thread`
  (privileged) reveals one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from enum import Enum

from agentd._routing import Profile


class ThreadState(Enum):
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"


class ProfileEscalation(Exception):
    """A child frame asked for a profile wider than its parent's."""


class Frame:
    __slots__ = (
        "children",
        "owner",
        "parent",
        "path",
        "persisted",
        "profile",
        "root",
        "state",
        "touched",
        "uuid",
    )

    def __init__(
        self, uuid: str, path: tuple[str, ...], parent: Frame | None, owner: str, profile: Profile
    ) -> None:
        self.uuid = uuid
        self.path = path
        self.parent = parent
        self.owner = owner  # the client whose conversation this is
        self.profile = profile
        self.root: Frame = parent.root if parent is not None else self
        self.state = ThreadState.ACTIVE
        self.children = 0  # open child frames (calls in progress)
        self.touched = time.monotonic()
        self.persisted = False  # written to the kernel's thread table

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def holder(self) -> str:
        """Who receives messages delivered *to* this frame: its last path element."""
        return self.path[-1]

    def __repr__(self) -> str:  # never include the path: reprs end up in logs
        return f"<Frame {self.uuid} {self.state.value}>"


_pool = b""
_VARIANT = "89ab89ab89ab89ab"


def new_uuid() -> str:
    """A random (version 4) UUID. Random bytes are drawn from the OS 4 KiB at a time:
    `uuid.uuid4()` makes one getrandom() call per UUID, a measurable cost per hop."""
    global _pool
    if not _pool:
        _pool = os.urandom(4096)
    h = _pool[:16].hex()
    _pool = _pool[16:]
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{_VARIANT[int(h[16], 16)]}{h[17:20]}-{h[20:32]}"


class ThreadRegistry:
    def __init__(self) -> None:
        self._frames: dict[str, Frame] = {}

    def __len__(self) -> int:
        return len(self._frames)

    def __iter__(self) -> Iterator[Frame]:
        return iter(list(self._frames.values()))

    def get(self, uuid: str) -> Frame | None:
        return self._frames.get(uuid)

    def start(self, owner: str, profile: Profile, uuid: str | None = None) -> Frame:
        """A new conversation owned by the client `owner`."""
        frame = Frame(uuid or new_uuid(), (owner,), None, owner, profile)
        if frame.uuid in self._frames:
            raise ValueError("thread exists")
        self._frames[frame.uuid] = frame
        return frame

    def extend(self, parent: Frame, callee: str, profile: Profile | None = None) -> Frame:
        """A child frame for a call from `parent`'s holder to `callee`."""
        if profile is None:
            profile = parent.profile
        elif profile is not parent.profile and not profile.table.is_within(parent.profile.table):
            raise ProfileEscalation(f"{profile.name} is wider than {parent.profile.name}")
        frame = Frame(new_uuid(), (*parent.path, callee), parent, parent.owner, profile)
        self._frames[frame.uuid] = frame
        parent.children += 1
        return frame

    def complete(self, frame: Frame, state: ThreadState = ThreadState.COMPLETED) -> None:
        """The call `frame` stands for has ended; forget it unless calls are open under it."""
        if frame.state is ThreadState.ACTIVE:
            frame.state = state
        if frame.parent is not None and self._frames.pop(frame.uuid, None) is not None:
            frame.parent.children -= 1

    def restore(self, frame: Frame) -> None:
        """Re-insert a frame rebuilt from durable state (crash recovery)."""
        self._frames[frame.uuid] = frame

    def forget(self, frame: Frame) -> None:
        self._frames.pop(frame.uuid, None)

    def collect_idle(self, idle_s: float, now: float | None = None) -> int:
        """Drop frames untouched for `idle_s` seconds (abandoned conversations)."""
        now = time.monotonic() if now is None else now
        stale = [f for f in self._frames.values() if now - f.touched > idle_s]
        for f in stale:
            self._frames.pop(f.uuid, None)
        return len(stale)
