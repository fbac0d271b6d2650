"""One bus connection's decisions, sans I/O: `BusSession` takes events in (a frame
received, the result of authentication, the outbox loaded, a delivery from the pump,
a submission's result, the socket's write buffer filling or draining, a timer, a
shutdown, the peer gone) and hands actions out (`Authenticate`, `LoadOutbox`,
`Submit`, `Close`, `PauseReading`, `ResumeReading`, `SetTimer`, `Acknowledge`,
`ResumeStream`). Frames to send are
pulled with `frames_to_send()`, so frames queued in one loop turn leave together.
No socket, task or clock lives here: the adapter passes `now` in.

The connection's state machine is the table `TRANSITIONS`; `transition()` raises
`IllegalTransition` on an event the current state does not allow:

    AUTHENTICATING -> REPLAYING -> OPEN -> DRAINING -> CLOSED
          |               |          |
          +---------------+----------+--> CLOSED (refused, timeout, withdrawn,
                                               overflow, peer gone)

Invariants:
- Nothing is read after the first frame until the client has authenticated and its
  outbox has been queued, so outbox frames go out in order before any new frame;
  deliveries that arrive meanwhile are held and follow the outbox (minus the ones
  the outbox already holds).
- Reading pauses while `max_inflight` envelopes are unanswered or while the frames
  waiting for the socket reach `read_pause_bytes`; frames waiting beyond
  `send_queue_limit` (a client that does not read) close the connection with 1008.
  Frames that carry an `outbox_id` are durable in the kernel's outbox, so dropping
  the queue loses none of them.
- A frame refused for what it is (malformed, invalid, too large, unroutable) is
  charged to the client's bucket by its size; while that leaves the bucket in debt,
  reading pauses until it is paid (the socket's backpressure holds the sender), so
  a client's flood of hostile frames costs its own rate, not the others' latency.
- Every outbox frame leaves stamped with its delivery seq (`<d:seq>`, its outbox
  id). A client that acknowledges delivery (a `<d:seq>` in its auth frame, or a
  core `ack`) keeps its frames in the outbox until it acknowledges a seq at or past
  them (`Acknowledge`), and a resume skips what its auth frame says it has; for
  any other client a frame leaves the outbox once written to its socket.
- Once CLOSED, a session emits nothing and queues nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from agentd import _metrics as metrics
from agentd._core import Huh
from agentd._delivery import ack_seq, might_be_control, resume_of, stamp
from agentd._envelope import build_envelope, parse_envelope, thread_hint
from agentd._errors import HuhCode, Rejection
from agentd._schemas import NS_ENV, NS_STREAM
from agentd._states import step
from agentd.bus._auth import auth_ok_frame
from agentd.bus._limits import InflightWindow, TokenBucket

# Replayed outbox ids (the newest) whose live delivery may still come after the
# replay: the rows the writer committed while the replay read. Beyond, a duplicate at
# worst (never a loss), and an idle connection holds at most this many ints.
REPLAY_WINDOW = 256
# Frames written and not yet acknowledged that a connection remembers; beyond, the
# oldest is forgotten here (it stays in the outbox: resent at the next login, a
# duplicate the client drops, never a loss).
ACK_WINDOW = 1024
# A core `ack` is a small envelope: anything longer goes to the pump as any frame.
MAX_ACK_BYTES = 1024
CLOSE_AUTH_FAILED = 4401
CLOSE_AUTH_TIMEOUT = 4408
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
AUTH_FAILED_REASON = "authentication failed"
AUTH_TIMEOUT_REASON = "authentication timeout"
GOING_AWAY_REASON = "going away"
OVERFLOW_REASON = "send queue overflow"

# One write hands the socket at most this much (an answer usually follows its
# `accepted` within the same loop turn, so most batches are two frames).
BATCH_BYTES = 256 * 1024

_CORE_HEAD = f'<message xmlns="{NS_ENV}"><meta><from>core</from>'.encode()
_STREAM_URI = NS_STREAM.encode()
_ACCEPTED = b"</meta><accepted "
_ACCEPTED_WITHIN = len(_CORE_HEAD) + 400  # the bytes it must lie within (searched in place)
_RATE_LIMITED = Huh.of(HuhCode.RATE_LIMITED).to_bytes()
# A frame refused for what it is costs its sender one more token per KiB: the work
# of refusing it (parsing it to the error) grows with its size, and it is the
# sender's rate, not the others' latency, that pays for it.
REFUSAL_BYTES_PER_TOKEN = 1024
_BAD_INPUT = frozenset({
    HuhCode.MALFORMED, HuhCode.INVALID_ENVELOPE, HuhCode.INVALID_PAYLOAD,
    HuhCode.TOO_LARGE, HuhCode.UNROUTABLE,
})


def is_accepted_frame(data: bytes) -> bool:
    """True for the pump's `accepted` envelopes (the only frames that do not answer
    an envelope). `from` = core is reserved, so a listener cannot fake this."""
    return data.startswith(_CORE_HEAD) and data.find(_ACCEPTED, 0, _ACCEPTED_WITHIN) >= 0


# ---- the state machine ---------------------------------------------------------------


class ConnState(Enum):
    AUTHENTICATING = "authenticating"  # waiting for the first frame
    REPLAYING = "replaying"  # authenticated; the outbox is being queued
    OPEN = "open"
    DRAINING = "draining"  # server shutting down: no more reads, sends flush
    CLOSED = "closed"  # a close was sent or the peer is gone: nothing more in or out


class ConnEvent(Enum):
    AUTH_OK = "auth-ok"
    AUTH_REFUSED = "auth-refused"
    AUTH_TIMEOUT = "auth-timeout"
    REPLAYED = "replayed"
    SHUTDOWN = "shutdown"
    GO_AWAY = "go-away"
    WITHDRAWN = "withdrawn"
    OVERFLOW = "overflow"
    PEER_GONE = "peer-gone"


_S, _E = ConnState, ConnEvent
TRANSITIONS: dict[ConnState, dict[ConnEvent, ConnState]] = {
    _S.AUTHENTICATING: {
        _E.AUTH_OK: _S.REPLAYING,
        _E.AUTH_REFUSED: _S.CLOSED,
        _E.AUTH_TIMEOUT: _S.CLOSED,
        _E.GO_AWAY: _S.CLOSED,
        _E.PEER_GONE: _S.CLOSED,
    },
    _S.REPLAYING: {
        _E.REPLAYED: _S.OPEN,
        _E.SHUTDOWN: _S.REPLAYING,  # remembered; the replay finishes first
        _E.GO_AWAY: _S.CLOSED,
        _E.WITHDRAWN: _S.CLOSED,
        _E.OVERFLOW: _S.CLOSED,
        _E.PEER_GONE: _S.CLOSED,
    },
    _S.OPEN: {
        _E.SHUTDOWN: _S.DRAINING,
        _E.GO_AWAY: _S.CLOSED,
        _E.WITHDRAWN: _S.CLOSED,
        _E.OVERFLOW: _S.CLOSED,
        _E.PEER_GONE: _S.CLOSED,
    },
    _S.DRAINING: {
        _E.GO_AWAY: _S.CLOSED,
        _E.WITHDRAWN: _S.CLOSED,
        _E.OVERFLOW: _S.CLOSED,
        _E.PEER_GONE: _S.CLOSED,
    },
    _S.CLOSED: {
        _E.PEER_GONE: _S.CLOSED,  # the socket goes away after our close frame
    },
}


def transition(state: ConnState, event: ConnEvent) -> ConnState:
    return step("connection", TRANSITIONS, state, event)


# ---- actions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Authenticate:
    """Check the first frame against the clients file; answer with `auth_result`."""

    frame: bytes


@dataclass(frozen=True, slots=True)
class LoadOutbox:
    """Fetch the client's undelivered outbox; answer with `outbox_loaded`."""


class Submit(NamedTuple):
    """Hand one envelope to the pump; answer with `submitted` or `submit_failed`.
    A named tuple, not a frozen dataclass as the other actions: one is made for
    every envelope, and a tuple is made with no `object.__setattr__` per field."""

    thread: str
    data: bytes
    stream: bool = False  # the envelope asks for previews on its thread


@dataclass(frozen=True, slots=True)
class ResumeStream:
    """The client asks for a stream's buffered partials from `from_seq` on."""

    stream: str
    from_seq: int


@dataclass(frozen=True, slots=True)
class Close:
    """Send a close frame with `code` and `reason`."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Acknowledge:
    """These outbox frames reached the client: remove them from its outbox."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PauseReading:
    pass


@dataclass(frozen=True, slots=True)
class ResumeReading:
    pass


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Call `tick` at loop time `at` (the oldest in-flight envelope's expiry)."""

    at: float


Action = (
    Authenticate | LoadOutbox | Submit | Close | PauseReading | ResumeReading | SetTimer
    | Acknowledge | ResumeStream
)
_NOTHING: tuple[Action, ...] = ()
PAUSE, RESUME, LOAD_OUTBOX = PauseReading(), ResumeReading(), LoadOutbox()


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """The per-connection bounds, shared by every session of one server."""

    max_inflight: int
    inflight_ttl_s: float
    send_queue_limit: int
    read_pause_bytes: int


# ---- the session -------------------------------------------------------------------------


class BusSession:
    """One connection's state and decisions. Each public method is an event and
    returns the actions to carry out, in order (an empty tuple when there is none:
    the common case on the hot path allocates nothing)."""

    __slots__ = (
        "_delivered",
        "_held",
        "_limits",
        "_owed_until",
        "_paused",
        "_replayed",
        "_shutdown",
        "_unacked",
        "bucket",
        "client",
        "close_code",
        "inflight",
        "peak_queued_bytes",
        "queued_bytes",
        "sendq",
        "state",
        "streams",
        "threads",
        "writable",
    )

    def __init__(self, limits: SessionLimits) -> None:
        self._limits = limits
        self.state = ConnState.AUTHENTICATING
        self.client = ""
        self.close_code: int | None = None
        self.inflight = InflightWindow(limits.max_inflight, limits.inflight_ttl_s)
        self.bucket: TokenBucket | None = None
        self.writable = True  # the socket's write buffer is below its high-water mark
        self.queued_bytes = 0
        self.peak_queued_bytes = 0
        self._paused = False  # reading paused (AUTHENTICATING reads the first frame)
        self._owed_until = 0.0  # reading paused until then: a costly refusal's debt
        self._shutdown = False  # asked to shut down while REPLAYING
        # The containers below exist only while in use: an idle connection costs what
        # websockets and TLS cost, plus this object.
        self.sendq: deque[tuple[bytes, int | None]] | None = None  # frames to write
        self._held: list[tuple[str, bytes, int | None]] | None = None  # while REPLAYING
        # Outbox rows the replay sent whose live delivery may still come, in id order:
        # the replay's read sees a row once the writer has committed it, the pump
        # delivers it once the daemon has heard of that commit, which may be after the
        # replay ended. The pump delivers a client's rows in id order, so a delivery
        # of id k means none below k is still to come.
        self._replayed: deque[int] | None = None
        self.threads: dict[str, None] | None = None  # recent threads, for affinity
        # Acknowledged delivery: None while the client does not acknowledge; else the
        # outbox ids written to this socket and not acknowledged, in order.
        self._unacked: deque[int] | None = None
        self._delivered = 0  # the seq the client said it has at login
        self.streams = False  # its auth frame asked for previews (`<s:stream/>`)

    def _to(self, event: ConnEvent) -> None:
        self.state = transition(self.state, event)

    @property
    def reading(self) -> bool:
        """Whether the adapter may hand this session the next frame."""
        return not self._paused

    def owns_thread(self, thread: str) -> bool:
        return self.threads is not None and thread in self.threads

    # ---- authentication and replay ----------------------------------------------------

    def frame_received(self, data: bytes, now: float) -> Sequence[Action]:
        state = self.state
        if state is ConnState.OPEN:
            return self._envelope(data, now)
        if state is ConnState.AUTHENTICATING:
            self._paused = True  # nothing more until the client is known
            return (Authenticate(data),)
        return _NOTHING  # DRAINING or CLOSED: not submitted; the client resends

    def auth_result(
        self, who: tuple[str, str] | None, bucket: TokenBucket | None = None,
        delivered: int | None = None, streams: bool = False,
    ) -> Sequence[Action]:
        """`who` is (client, session token), or None when refused. `bucket` is the
        client's rate limit, shared by its connections. `delivered`: the last
        delivery seq the client says it received (its auth frame's `<d:seq>`), None
        for a client that does not acknowledge."""
        if who is None:
            return self._close(ConnEvent.AUTH_REFUSED, CLOSE_AUTH_FAILED, AUTH_FAILED_REASON)
        self._to(ConnEvent.AUTH_OK)
        self.client, token = who
        self.bucket = bucket
        if delivered is not None:
            self._unacked = deque()
            self._delivered = delivered
        self.streams = streams
        self._enqueue(auth_ok_frame(self.client, token), None)
        return (PAUSE, LOAD_OUTBOX)

    def auth_timed_out(self) -> Sequence[Action]:
        return self._close(ConnEvent.AUTH_TIMEOUT, CLOSE_AUTH_TIMEOUT, AUTH_TIMEOUT_REASON)

    def outbox_loaded(self, pending: Sequence[tuple[int, str, bytes]]) -> Sequence[Action]:
        """Queue the client's outbox (outbox_id, thread, frame), then what was
        delivered meanwhile, then open."""
        if self.state is not ConnState.REPLAYING:
            return _NOTHING  # closed while the outbox was read
        actions: list[Action] = []
        if self._delivered:
            # The client has these already (the socket died before it acknowledged).
            have = tuple(i for i, _, _ in pending if i <= self._delivered)
            if have:
                actions.append(Acknowledge(have))
                pending = pending[len(have):]
        replayed = set()
        for outbox_id, _thread, frame in pending:
            replayed.add(outbox_id)
            overflow = self._enqueue(frame, outbox_id)
            if overflow:
                return (*actions, *overflow)  # the rest stays in the outbox
        held, self._held = self._held or [], None
        self._to(ConnEvent.REPLAYED)
        delivered = set()
        for thread, data, held_id in held:
            if held_id is not None and held_id <= self._delivered:
                actions.append(Acknowledge((held_id,)))
            elif held_id is None or held_id not in replayed:
                actions.extend(self.deliver(thread, data, held_id))
            else:
                delivered.add(held_id)  # its live delivery came: sent once, above
        # Their live delivery may still come (see deliver), but only for rows committed
        # while the replay read: the newest. The rest came to no connection long ago.
        live = [i for i, _, _ in pending if i not in delivered][-REPLAY_WINDOW:]
        self._replayed = deque(live) if live else None
        if self.state is ConnState.CLOSED:
            return tuple(actions)  # the held frames overflowed the queue
        if self._shutdown:
            self._to(ConnEvent.SHUTDOWN)
            return tuple(actions)
        actions.extend(self._update_reading())
        return tuple(actions)

    # ---- envelopes in ----------------------------------------------------------------

    def _envelope(self, data: bytes, now: float) -> Sequence[Action]:
        thread = thread_hint(data)
        bucket = self.bucket
        if bucket is not None and not bucket.take(now):
            metrics.envelopes_rejected.labels(HuhCode.RATE_LIMITED.value).inc()
            self._enqueue(build_envelope("core", thread, _RATE_LIMITED, to=self.client), None)
            return self._update_reading()
        if len(data) <= MAX_ACK_BYTES and might_be_control(data):
            control = self._control_in(data)
            if type(control) is int:
                return self.acknowledged(control)
            if type(control) is tuple:
                return (ResumeStream(*control),)
        threads = self.threads
        if threads is None:
            threads = self.threads = {}
        threads.pop(thread, None)  # most recent last
        threads[thread] = None
        if len(threads) > max(1024, 4 * self._limits.max_inflight):
            del threads[next(iter(threads))]
        # Counted before submitting: the answer may arrive before submit returns.
        self.inflight.submitted(thread, now)
        # `<s:stream/>` in its meta asks for previews on this thread (a look at the
        # bytes: the mark only ever reaches the client's own conversation).
        submit = Submit(thread, data, _STREAM_URI in data)
        if self.inflight.full:
            return (submit, *self._update_reading())
        return (submit,)

    def _control_in(self, data: bytes) -> int | tuple[str, int] | None:
        """The seq of the client's own core `ack {seq}`, or (stream, from-seq) of its
        `resume`; else None (anything else, a forged `from` included, goes to the
        pump and is judged there)."""
        try:
            env = parse_envelope(data, max_bytes=MAX_ACK_BYTES)
        except Rejection:
            return None
        if env.sender != self.client or env.to is not None:
            return None
        seq = ack_seq(env)
        return seq if seq is not None else resume_of(env)

    def acknowledged(self, seq: int) -> Sequence[Action]:
        """The client has every frame up to delivery seq `seq`: the ones written on
        this connection leave the outbox. Its first `ack` also asks for acknowledged
        delivery from then on."""
        unacked = self._unacked
        if unacked is None:
            self._unacked = deque()
            return _NOTHING
        ids: list[int] = []
        while unacked and unacked[0] <= seq:
            ids.append(unacked.popleft())
        return (Acknowledge(tuple(ids)),) if ids else _NOTHING

    def submitted(
        self, thread: str, result: object, now: float, size: int = 0
    ) -> Sequence[Action]:
        """The pump took the envelope (of `size` bytes) counted under `thread`;
        `result` may name the thread it really went to (a broken envelope's hint is
        wrong), or the code it was refused with."""
        bucket = self.bucket
        if bucket is not None and getattr(result, "code", None) in _BAD_INPUT:
            bucket.charge(size / REFUSAL_BYTES_PER_TOKEN, now)
            ready = bucket.ready_at()
            if ready > now:
                self._owed_until = ready
        real = getattr(result, "thread", thread)
        if real == thread:
            return self._update_reading() if self._owed_until else _NOTHING
        # The answer came on another thread, so release the slot counted under the
        # hint, and count the envelope under its real thread if the pump took it.
        self.inflight.answered(thread)
        if getattr(result, "accepted", False):
            self.inflight.submitted(real, now)
        return self._update_reading()

    def submit_failed(self, thread: str) -> Sequence[Action]:
        self.inflight.answered(thread)
        return self._update_reading()

    def tick(self, now: float) -> tuple[int, Sequence[Action]]:
        """Release in-flight threads unanswered for longer than their TTL; (how many
        were released, actions)."""
        released = self.inflight.expire(now)
        if self._owed_until and now >= self._owed_until:
            self._owed_until = 0.0
        return released, self._update_reading()

    def next_deadline(self) -> float | None:
        """When `tick` may release a slot or a debt that keeps reading paused."""
        deadline = self.inflight.oldest_deadline() if self.inflight.full else None
        owed = self._owed_until
        if owed and (deadline is None or owed < deadline):
            return owed
        return deadline

    # ---- frames out -------------------------------------------------------------------

    def deliver(self, thread: str, data: bytes, outbox_id: int | None) -> Sequence[Action]:
        """One frame from the pump for this connection."""
        state = self.state
        if state is ConnState.REPLAYING:
            if self._held is None:
                self._held = []
            self._held.append((thread, data, outbox_id))
            return _NOTHING
        if state is ConnState.CLOSED or state is ConnState.AUTHENTICATING:
            return _NOTHING
        replayed = self._replayed
        if replayed is not None and outbox_id is not None:
            while replayed and replayed[0] < outbox_id:
                replayed.popleft()  # no live delivery is still to come for those
            if replayed and replayed[0] == outbox_id:
                replayed.popleft()
                if not replayed:
                    self._replayed = None
                return _NOTHING  # the replay sent it already
            if not replayed:
                self._replayed = None
        answered = not is_accepted_frame(data) and self.inflight.answered(thread)
        overflow = self._enqueue(data, outbox_id)
        if overflow:
            return overflow
        if answered or (not self._paused and self.queued_bytes >= self._limits.read_pause_bytes):
            return self._update_reading()
        return _NOTHING

    def _enqueue(self, data: bytes, outbox_id: int | None) -> Sequence[Action]:
        sendq = self.sendq
        if sendq is None:
            sendq = self.sendq = deque()
        size = self.queued_bytes + len(data)
        if size > self._limits.send_queue_limit:
            return self._close(ConnEvent.OVERFLOW, CLOSE_POLICY, OVERFLOW_REASON)
        sendq.append((data, outbox_id))
        self.queued_bytes = size
        if size > self.peak_queued_bytes:
            self.peak_queued_bytes = size
        return _NOTHING

    @property
    def sending(self) -> bool:
        """Frames are queued and the socket takes them."""
        return bool(self.sendq) and self.writable and self.state is not ConnState.CLOSED

    def frames_to_send(self) -> list[tuple[bytes, int | None]]:
        """Up to `BATCH_BYTES` of queued frames, oldest first, for one write; nothing
        while the socket's buffer is full. Each is (the bytes to write, the outbox id
        that leaves the outbox once written or None): an outbox frame is stamped
        with its delivery seq, and for a client that acknowledges it stays in the
        outbox until acknowledged."""
        sendq = self.sendq
        if not sendq or not self.writable:
            return []
        if len(sendq) == 1:
            batch = [sendq.popleft()]
            size = len(batch[0][0])
        else:
            batch = []
            size = 0
            while sendq and size < BATCH_BYTES:
                item = sendq.popleft()
                batch.append(item)
                size += len(item[0])
        self.queued_bytes -= size
        if not sendq:
            self.sendq = None  # an idle connection keeps no queue
        unacked = self._unacked
        out: list[tuple[bytes, int | None]] = []
        for data, outbox_id in batch:
            if outbox_id is None:
                out.append((data, None))
            elif unacked is None:
                out.append((stamp(data, outbox_id), outbox_id))
            else:
                out.append((stamp(data, outbox_id), None))
                unacked.append(outbox_id)
                if len(unacked) > ACK_WINDOW:
                    unacked.popleft()
        return out

    def write_paused(self) -> None:
        """The socket's write buffer passed its high-water mark."""
        self.writable = False

    def write_resumed(self) -> Sequence[Action]:
        self.writable = True
        return self._update_reading()

    def sent(self) -> Sequence[Action]:
        """A batch from `frames_to_send` was written: reading may resume."""
        if self._paused and self.state is ConnState.OPEN:
            return self._update_reading()
        return _NOTHING

    # ---- flow control ------------------------------------------------------------------

    def _update_reading(self) -> Sequence[Action]:
        limits = self._limits
        pause = (
            self.state is not ConnState.OPEN
            or self.inflight.full
            or self.queued_bytes >= limits.read_pause_bytes
            or self._owed_until > 0.0
        )
        if pause == self._paused:
            return _NOTHING
        self._paused = pause
        if not pause:
            return (RESUME,)
        deadline = self.next_deadline()
        return (PAUSE,) if deadline is None else (PAUSE, SetTimer(deadline))

    # ---- endings -------------------------------------------------------------------------

    def shutdown(self) -> Sequence[Action]:
        """The server is closing: stop reading, keep sending (see `go_away`)."""
        if self.state is ConnState.REPLAYING:
            self._shutdown = True
            return _NOTHING
        if self.state is ConnState.OPEN:
            self._to(ConnEvent.SHUTDOWN)
            return self._update_reading()
        return _NOTHING

    def go_away(self, code: int = CLOSE_GOING_AWAY) -> Sequence[Action]:
        """The server's drain is over: close with `code` (1001 when it shuts down)."""
        if self.state is ConnState.CLOSED:
            return _NOTHING
        return self._close(ConnEvent.GO_AWAY, code, GOING_AWAY_REASON)

    def withdraw(self) -> Sequence[Action]:
        """The client's access was withdrawn (removed, or given a new secret)."""
        return self._close(ConnEvent.WITHDRAWN, CLOSE_AUTH_FAILED, AUTH_FAILED_REASON)

    def peer_gone(self) -> list[tuple[bytes, int]]:
        """The peer closed or the socket was lost. Returns the durable frames still
        queued (frame, outbox_id), for another connection of the client."""
        self._to(ConnEvent.PEER_GONE)
        leftover = [(d, i) for d, i in self.sendq or () if i is not None]
        self._drop_queue()
        return leftover

    def _close(self, event: ConnEvent, code: int, reason: str) -> Sequence[Action]:
        self._to(event)
        self.close_code = code
        self._paused = True
        self._drop_queue()
        return (Close(code, reason),)

    def _drop_queue(self) -> None:
        self.sendq = None
        self._held = None
        self.queued_bytes = 0


def choose_session(sessions: Sequence[BusSession], thread: str) -> int:
    """Which of a client's sessions (oldest first) an answer on `thread` goes to: the
    first that sent on that thread recently, else the newest."""
    for i, session in enumerate(sessions):
        if session.owns_thread(thread) and session.state is not ConnState.CLOSED:
            return i
    return len(sessions) - 1
