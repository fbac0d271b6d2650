"""Previews of a model's text for the client that owns the conversation: who wants
them, each model call's stream, and the core `partial` and `final` frames.

Previews are never validated against a listener's schema, journaled or routed: they
go straight to the owning client's connection (`send`, no outbox row) and are lost
with the daemon. The answer itself is unchanged (validated, journaled, delivered
once); a stream's `final` is sent when its model call ends, before the answer has
even been validated, so it always precedes the answer.

Invariants:
- `seq` counts from 1 without gaps within a stream; a coalesced piece takes one seq.
- A piece never waits for the client: while its connection is busy (`busy`: frames
  are still queued for it) pieces accumulate and leave as one partial with the
  next piece that finds it free, or at the end. A slow client gets fewer, longer
  pieces; the model is never held back and memory is bounded by the text.
- Each stream keeps the partials it sent, up to `buffer_bytes` of text (the oldest
  go first), for `resume {stream, from-seq}` after a reconnect: each buffered
  partial at or past `from-seq` is sent again once. Ended streams stay resumable
  until `KEPT_STREAMS` newer ones have started.
- `final` is sent only for a stream that sent a partial; an attempt the router
  gave up on mid-stream ends its stream `interrupted`, and the retry's text starts
  a new stream.
- A stream that sent a partial is recorded in the kernel (`record`: at its first
  partial, its last seq at most once a second, its end), so that after `kill -9`
  its client is told `final … interrupted` (the daemon's start puts one in its
  outbox, before the resumed task's new stream). Only that record is durable.
- Agent steps (core `step`: a tool call, its result, a wait, a tool's progress) go
  the same way to the same clients (`StepFrames`, the pump's `StepSink`): sent
  at once, never kept.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentd._core import Final, Partial
from agentd._envelope import build_envelope

if TYPE_CHECKING:
    from agentd._threads import Frame

SendFn = Callable[[str, str, bytes], None]  # (client, thread, envelope bytes)
BusyFn = Callable[[str], bool]  # is the client's connection still writing?
# (stream, client, thread, last seq sent; 0: the stream ended): the kernel's record
# of the streams in flight, so that after a crash each is told interrupted.
RecordFn = Callable[[str, str, str, int], None]
RECORD_EVERY_S = 1.0  # a live stream's last seq is recorded at most this often

BUFFER_BYTES = 256 * 1024
KEPT_STREAMS = 128  # at most 32 MiB of buffered previews for resumes
OPTED_IN_THREADS = 4096


class VisibleText:
    """The part of a model's text a client sees while it writes: markup is not
    shown. An element (`<think>…</think>`, a tool call's `<add …>…</add>`) is left
    out whole, nested ones included; a `<` that does not open a tag (`a < b`) is
    text. Pieces may split anywhere: an unfinished tag waits for the next piece."""

    __slots__ = ("depth", "tag")

    def __init__(self) -> None:
        self.depth = 0
        self.tag: list[str] | None = None  # inside `<...`, its characters so far

    def feed(self, text: str) -> str:
        out: list[str] = []
        tag = self.tag
        for ch in text:
            if tag is not None:
                tag.append(ch)
                if len(tag) == 2 and not (ch.isalpha() or ch in "/?!_"):
                    if self.depth == 0:
                        out.append("".join(tag))  # not a tag: `a < b`
                    tag = None
                elif ch == ">":
                    body = "".join(tag)
                    if body.startswith("</"):
                        self.depth = max(0, self.depth - 1)
                    elif not (body.endswith("/>") or body.startswith(("<?", "<!"))):
                        self.depth += 1
                    tag = None
            elif ch == "<":
                tag = [ch]
            elif self.depth == 0:
                out.append(ch)
        self.tag = tag
        return "".join(out)


class Stream:
    """One model call's previews (a `TextSink` for the router)."""

    __slots__ = ("_hub", "buffered", "client", "ended", "id", "pending", "recorded", "sent",
                 "seq", "thread")

    def __init__(self, hub: StreamHub, client: str, thread: str) -> None:
        self._hub = hub
        self.id = secrets.token_hex(8)
        self.client = client
        self.thread = thread
        self.seq = 0
        self.pending: list[str] = []
        self.sent: deque[tuple[int, str]] = deque()
        self.buffered = 0
        self.ended = False
        self.recorded = 0.0  # when its last seq was last recorded (monotonic)

    def piece(self, text: str) -> None:
        if self.ended or not text:
            return
        self.pending.append(text)
        if not self._hub.busy(self.client):
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        text = "".join(self.pending)
        self.pending = []
        self.seq += 1
        self._keep(self.seq, text)
        hub = self._hub
        hub.emit(self.client, self.thread, Partial(self.id, self.seq, text).to_bytes())
        if hub.record is not None:
            now = time.monotonic()
            if self.seq == 1 or now - self.recorded >= RECORD_EVERY_S:
                self.recorded = now
                hub.record(self.id, self.client, self.thread, self.seq)

    def end(self, interrupted: bool = False) -> None:
        """No more text: what waits goes out, then `final` if anything was sent."""
        if self.ended:
            return
        self.flush()
        self.ended = True
        if self.seq:
            hub = self._hub
            hub.emit(self.client, self.thread, Final(self.id, self.seq, interrupted).to_bytes())
            if hub.record is not None:
                hub.record(self.id, self.client, self.thread, 0)

    def _keep(self, seq: int, text: str) -> None:
        self.sent.append((seq, text))
        self.buffered += len(text)
        limit = self._hub.buffer_bytes
        while self.buffered > limit and len(self.sent) > 1:
            _, old = self.sent.popleft()
            self.buffered -= len(old)

    def resend(self, from_seq: int) -> int:
        count = 0
        for seq, text in list(self.sent):
            if seq >= from_seq:
                self._hub.emit(self.client, self.thread, Partial(self.id, seq, text).to_bytes())
                count += 1
        return count


class StreamWriter:
    """What one model call writes to: the current stream, a new one after an
    interruption (the router retries or fails over)."""

    __slots__ = ("_hub", "client", "current", "thread", "visible")

    def __init__(self, hub: StreamHub, client: str, thread: str) -> None:
        self._hub = hub
        self.client = client
        self.thread = thread
        self.current: Stream | None = None
        self.visible = VisibleText()

    def piece(self, text: str) -> None:
        text = self.visible.feed(text)
        if not text:
            return
        if self.current is None:
            self.current = self._hub.open(self.client, self.thread)
        self.current.piece(text)

    def interrupted(self) -> None:
        self.visible = VisibleText()  # the retry writes from the start
        if self.current is not None:
            self.current.end(interrupted=True)
            self.current = None

    def close(self, interrupted: bool = False) -> None:
        if self.current is not None:
            self.current.end(interrupted)
            self.current = None


class StreamHub:
    """The daemon's streams and who asked for them; `send` and `busy` are the bus's."""

    def __init__(self, send: SendFn, busy: BusyFn | None = None,
                 buffer_bytes: int = BUFFER_BYTES, record: RecordFn | None = None) -> None:
        self._send = send
        self._busy = busy
        self.record = record
        self.buffer_bytes = buffer_bytes
        self._sessions: dict[str, int] = {}  # client -> its connections that opted in
        self._threads: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._streams: OrderedDict[str, Stream] = OrderedDict()
        self.sent = 0  # frames emitted (for tests and benchmarks)

    # ---- who wants previews ----------------------------------------------------------

    def session_opened(self, client: str) -> None:
        """A connection of `client` opted in in its auth frame (`<s:stream/>`)."""
        self._sessions[client] = self._sessions.get(client, 0) + 1

    def session_closed(self, client: str) -> None:
        left = self._sessions.get(client, 0) - 1
        if left > 0:
            self._sessions[client] = left
        else:
            self._sessions.pop(client, None)

    def thread_opted_in(self, client: str, thread: str) -> None:
        """An envelope of `client` on `thread` carried `<s:stream/>` in its meta."""
        key = (client, thread)
        self._threads.pop(key, None)
        self._threads[key] = None
        if len(self._threads) > OPTED_IN_THREADS:
            self._threads.popitem(last=False)

    def wanted(self, client: str, thread: str) -> bool:
        return client in self._sessions or (client, thread) in self._threads

    # ---- streams --------------------------------------------------------------------

    def writer(self, client: str, thread: str) -> StreamWriter:
        return StreamWriter(self, client, thread)

    def open(self, client: str, thread: str) -> Stream:
        stream = Stream(self, client, thread)
        self._streams[stream.id] = stream
        while len(self._streams) > KEPT_STREAMS:
            _, old = next(iter(self._streams.items()))
            if not old.ended:
                break  # a live stream stays; the table shrinks when it ends
            self._streams.popitem(last=False)
        return stream

    def resume(self, client: str, stream_id: str, from_seq: int) -> int:
        """Send `client`'s buffered partials of `stream_id` at or past `from_seq`
        again; how many. Another client's stream, or one no longer kept: none."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.client != client:
            return 0
        return stream.resend(from_seq)

    def busy(self, client: str) -> bool:
        return self._busy is not None and self._busy(client)

    def emit(self, client: str, thread: str, body: bytes) -> None:
        self.sent += 1
        self._send(client, thread, build_envelope("core", thread, body, to=client))


class StepFrames:
    """The pump's `StepSink`: a conversation's steps reach its owner when previews
    are wanted there (`configured`: its profile, or a listener on the frame's path,
    streams without being asked), through the hub as partials do."""

    def __init__(self, hub: StreamHub, configured: Callable[[Frame], bool]) -> None:
        self._hub = hub
        self._configured = configured
        self.dropped = 0  # progress steps left out for a connection that was behind

    def wanted(self, frame: Frame) -> bool:
        root = frame.root
        return self._hub.wanted(root.owner, root.uuid) or self._configured(frame)

    def send(self, root: Frame, body: bytes, lossy: bool = False) -> None:
        """`lossy` (a tool's progress, which a server may send without end): left
        out while the owner's connection is behind, never queued behind it."""
        if lossy and self._hub.busy(root.owner):
            self.dropped += 1
            return
        self._hub.emit(root.owner, root.uuid, body)
