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
- A frame's state changes only through `transition` (the table `TRANSITIONS`): a
  frame is active until its call ends once, as answered, failed or abandoned; an
  ended frame takes no further event, and asking it to is a bug that raises.
- Memory is bounded by the work in progress: a call's frame leaves the registry
  when the call ends, and a client's conversation with nothing in progress (no open
  call, nothing queued) is held "at rest", at most `max_resting` of them. When the
  set is full, the client holding the most conversations at rest loses its least
  recently used one (so a client opening conversations by the thousand pushes out
  its own, not another client's). A conversation pushed out of the rest set is ended
  as abandoned (what outlives it is the kernel's thread row), exactly as the idle
  collector would end it later.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from enum import Enum
from typing import TYPE_CHECKING

from agentd._states import step

if TYPE_CHECKING:
    from agentd._routing import Profile


class ThreadState(Enum):
    ACTIVE = "active"
    COMPLETED = "completed"
    FAILED = "failed"

    # Members are singletons: identity hashing is correct and, unlike Enum's own
    # (a Python call hashing the name), costs nothing on the hot path.
    __hash__ = object.__hash__


class ThreadEvent(Enum):
    ANSWERED = "answered"  # the callee answered (or acknowledged) the call
    FAILED = "failed"  # the callee failed: error, timeout, refused output
    ABANDONED = "abandoned"  # untouched for the idle period: collected

    __hash__ = object.__hash__


# state -> event -> next state; a missing entry is an illegal event.
TRANSITIONS: dict[ThreadState, dict[ThreadEvent, ThreadState]] = {
    ThreadState.ACTIVE: {
        ThreadEvent.ANSWERED: ThreadState.COMPLETED,
        ThreadEvent.FAILED: ThreadState.FAILED,
        ThreadEvent.ABANDONED: ThreadState.COMPLETED,
    },
    ThreadState.COMPLETED: {},
    ThreadState.FAILED: {},
}


def transition(state: ThreadState, event: ThreadEvent) -> ThreadState:
    """The state a frame in `state` moves to on `event`; raises `IllegalTransition`."""
    return step("frame", TRANSITIONS, state, event)


class Frame:
    __slots__ = (
        "call",
        "children",
        "owner",
        "parent",
        "path",
        "persisted",
        "profile",
        "ref",
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
        # The id the owning client's `step` frames give the call this frame runs
        # ("": none was shown, e.g. the client's own envelope, or after a restart).
        self.call = ""
        # The caller's reference of the call this frame runs ("": none), which every
        # message back to the caller about it carries (pump/message.py).
        self.ref = ""

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def holder(self) -> str:
        """Who receives messages delivered *to* this frame: its last path element."""
        return self.path[-1]

    @property
    def log_ids(self) -> str:
        """How logs name this frame: by its conversation's UUID (the one the client
        and `introspect thread` know), plus its own when it is a child."""
        return log_ids(self.root.uuid, self.uuid)

    def __repr__(self) -> str:  # never include the path: reprs end up in logs
        return f"<Frame {self.uuid} {self.state.value}>"


def log_ids(conversation: str, frame: str) -> str:
    """`thread=<client's thread UUID>`, and `frame=<UUID>` when `frame` is a child's.
    Every log line and audit record about a conversation names it this way."""
    if frame == conversation:
        return f"thread={conversation}"
    return f"thread={conversation} frame={frame}"


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


# Conversations held at rest by default: each costs a few hundred bytes, so the
# set stays within a few MB however many conversations the daemon has served.
MAX_RESTING = 10_000

EndHook = Callable[[str], None]


class ThreadRegistry:
    """The frames by UUID: those in progress, and client conversations at rest (a
    root frame with no open call and nothing queued, which its client may still
    continue). A frame leaves when its call ends (`end`), when it is dropped
    unfinished (`forget`: a conversation whose admission failed), or when it is
    pushed out of the rest set (`rest` returns it; the pump ends it)."""

    def __init__(self, max_resting: int = MAX_RESTING) -> None:
        self._frames: dict[str, Frame] = {}
        self._resting: dict[str, Frame] = {}
        # The same conversations by owner, least recently used first (see `rest`).
        self._resting_of: dict[str, OrderedDict[str, Frame]] = {}
        # The owners by how many they have at rest, and the most any has: who gives
        # one up when the set is full, found without scanning the owners.
        self._owners_with: dict[int, dict[str, None]] = {}
        self._most = 0
        self.max_resting = max_resting
        self._end_hooks: list[EndHook] = []

    def __len__(self) -> int:
        """Frames held: calls and conversations in progress, and those at rest."""
        return len(self._frames) + len(self._resting)

    @property
    def resting(self) -> int:
        """Conversations held at rest (never more than `max_resting`)."""
        return len(self._resting)

    @property
    def in_progress(self) -> int:
        """Frames with work in progress: open calls and busy conversations."""
        return len(self._frames)

    def __iter__(self) -> Iterator[Frame]:
        return iter([*self._frames.values(), *self._resting.values()])

    def get(self, uuid: str) -> Frame | None:
        frame = self._frames.get(uuid)
        return frame if frame is not None else self._resting.get(uuid)

    def on_end(self, hook: EndHook) -> None:
        """Call `hook(uuid)` whenever a frame ends (whatever the event), so what
        others keep per frame (an agent's task) can leave with it."""
        self._end_hooks.append(hook)

    def rest(self, root: Frame) -> list[Frame]:
        """`root`, a conversation with nothing in progress, is put at rest. Returns
        the conversations pushed out of the rest set (oldest first), for the caller
        to end."""
        uuid = root.uuid
        if self._frames.pop(uuid, None) is None and uuid not in self._resting:
            return []  # not held (already ended or forgotten)
        resting = self._resting
        resting[uuid] = root
        owner = root.owner
        mine = self._resting_of.get(owner)
        if mine is None:
            mine = self._resting_of[owner] = OrderedDict()
        held = len(mine)
        mine[uuid] = root
        if len(mine) > held:
            self._recount(owner, held, held + 1)
        else:
            mine.move_to_end(uuid)
        pushed: list[Frame] = []
        while len(resting) > self.max_resting:
            # A client at or over its fair share gives up its own least recently used
            # one (a client opening conversations by the thousand); one under it rests
            # at the expense of a client holding the most. Neither scans the clients.
            most = mine
            if len(mine) * len(self._resting_of) < self.max_resting:
                most = self._resting_of[next(iter(self._owners_with[self._most]))]
            frame = next(iter(most.values()))  # that client's least recently used
            self._unrest(frame)
            pushed.append(frame)
        return pushed

    def _recount(self, owner: str, old: int, new: int) -> None:
        """`owner` now has `new` conversations at rest instead of `old` (one apart)."""
        owners_with = self._owners_with
        if old:
            owners = owners_with[old]
            del owners[owner]
            if not owners:
                del owners_with[old]
                if old == self._most and new < old:  # `owner`, at `new`, holds the most
                    self._most = new
        if new:
            level = owners_with.get(new)
            if level is None:
                owners_with[new] = {owner: None}
            else:
                level[owner] = None
            if new > self._most:
                self._most = new

    def _unrest(self, frame: Frame) -> bool:
        """Take `frame` out of the rest set; whether it was there."""
        if self._resting.pop(frame.uuid, None) is None:
            return False
        mine = self._resting_of[frame.owner]
        del mine[frame.uuid]
        held = len(mine)
        self._recount(frame.owner, held + 1, held)
        if not held:
            del self._resting_of[frame.owner]
        return True

    def wake(self, root: Frame) -> None:
        """`root`'s client sent on it again: it is in progress, no longer at rest."""
        if self._unrest(root):
            self._frames[root.uuid] = root

    def add(self, frame: Frame) -> None:
        """Register a frame built elsewhere: a conversation once its first envelope
        passed every check, or a frame rebuilt from durable state (crash recovery)."""
        self._frames[frame.uuid] = frame

    def extend(self, parent: Frame, callee: str) -> Frame:
        """A child frame for a call from `parent`'s holder to `callee`; it inherits
        `parent`'s profile, so a chain can never widen its reach."""
        frame = Frame(new_uuid(), (*parent.path, callee), parent, parent.owner, parent.profile)
        self._frames[frame.uuid] = frame
        parent.children += 1
        return frame

    def end(self, frame: Frame, event: ThreadEvent) -> ThreadState:
        """The call `frame` stands for has ended by `event`: it takes its final state
        and leaves the registry. Raises `IllegalTransition` if it had already ended."""
        try:  # transition() inlined: this runs once per call on the hot path
            state = TRANSITIONS[frame.state][event]
        except KeyError:
            transition(frame.state, event)  # raises IllegalTransition
            raise
        frame.state = state
        uuid = frame.uuid
        if self._frames.pop(uuid, None) is not None:
            if frame.parent is not None:
                frame.parent.children -= 1
        else:
            self._unrest(frame)
        for hook in self._end_hooks:
            hook(uuid)
        return state

    def forget(self, frame: Frame) -> None:
        if self._frames.pop(frame.uuid, None) is None:
            self._unrest(frame)
