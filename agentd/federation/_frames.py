"""The frames of one authenticated link, and how they share WebSocket messages.

A frame is one JSON object (`call`, `accepted`, `reply`, `ack`, ...), encoded as
UTF-8 without a newline (JSON escapes the ones inside strings, and every other
control character; text is not escaped to `\\uXXXX`, so an envelope of non-ASCII
text is not six times its size on the link). The frames queued for a
link while its writer was busy leave together, as one WebSocket message of lines
of at most `COALESCE_BYTES` (a frame bigger than that goes alone): under load a
call's `accepted`, another's `reply` and a third's `ack` cost one TLS record and
one `write` instead of three. A lone frame is sent the moment the writer runs.

A receiver handles each line of a message as if it had come alone: the same
checks, rate limit and refusals. `max_frame_bytes` bounds each frame (a longer
line closes the link, as a longer message would); a message holding several is
accepted up to `message_limit`, at least `COALESCE_BYTES`, so a peer may coalesce
whatever frame limit this side set. Each side tells the other its frame limit in
the handshake; a frame over the peer's is never sent (`FrameTooLarge`: the caller
answers the call or reply it held some other way), since the peer would close the
link on it and the frame would be sent again on the next one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

import orjson

COALESCE_BYTES = 16384


class FrameTooLarge(Exception):
    """A frame over the limit the peer announced: not sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"{size} bytes > the peer's {limit}")
        self.size, self.limit = size, limit


def message_limit(max_frame_bytes: int) -> int:
    """The largest WebSocket message a link takes: one frame, or frames that share it."""
    return max(max_frame_bytes, COALESCE_BYTES)


def encode(frame: dict[str, object]) -> bytes:
    """Compact UTF-8 JSON. Raises `orjson.JSONEncodeError` (a TypeError) for a value
    JSON cannot carry: a string with a lone surrogate, an integer over 64 bits."""
    return orjson.dumps(frame)


def encode_within(frame: dict[str, object], limit: int) -> bytes:
    """`encode`, or `FrameTooLarge` if the bytes are over `limit`."""
    data = encode(frame)
    if len(data) > limit:
        raise FrameTooLarge(len(data), limit)
    return data


def too_big(frame: str | bytes, max_frame_bytes: int) -> bool:
    """Whether one frame is over the limit (in UTF-8 bytes, as a message would be)."""
    if isinstance(frame, bytes):
        return len(frame) > max_frame_bytes
    return len(frame) * 4 > max_frame_bytes and len(frame.encode()) > max_frame_bytes


def lines(message: str | bytes) -> Iterator[str | bytes]:
    """The frames of one received message (a message without a newline is one)."""
    if isinstance(message, str):
        return iter(message.split("\n"))
    return iter(message.split(b"\n"))


class FrameQueue:
    """Frames for one link's writer, in order."""

    __slots__ = ("_frames", "_limit", "_ready")

    def __init__(self, limit: int = COALESCE_BYTES) -> None:
        self._frames: deque[bytes] = deque()
        self._ready = asyncio.Event()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, frame: bytes) -> None:
        self._frames.append(frame)
        self._ready.set()

    async def message(self) -> bytes:
        """The next message: the oldest frame and those queued behind it that fit."""
        frames = self._frames
        while not frames:
            self._ready.clear()
            await self._ready.wait()
        first = frames.popleft()
        if not frames:
            return first
        parts, size = [first], len(first)
        while frames and size + 1 + len(frames[0]) <= self._limit:
            frame = frames.popleft()
            parts.append(frame)
            size += 1 + len(frame)
        return b"\n".join(parts)
