"""One gateway's live state (`GatewayLink`: the link's state machine applied, its
rate bucket, reply window and send queue) and what serving a peer's calls needs of
the daemon (`CallHost`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from websockets.asyncio.connection import Connection

from agentd._envelope import Envelope
from agentd.bus import TokenBucket
from agentd.config import GatewayConfig
from agentd.federation._frames import FrameQueue
from agentd.federation._gateway import LinkEvent, LinkState, transition
from agentd.federation._handshake import MIN_FRAME_LIMIT
from agentd.federation._identity import fingerprint
from agentd.federation._remote import Offer
from agentd.federation._replies import ReplyWindow

MAX_PENDING_REPLIES = 10_000  # replies sent and not yet acknowledged, per link

Audit = Callable[[str, Mapping[str, str]], None]


class CallHost(Protocol):
    """What serving a peer's calls needs of the daemon: the pump (as for any bus
    client, under the gateway's name) and the kernel's outbox of replies."""

    # A pump SubmitResult; `parsed`: `data` as parsed with the pump's limits.
    async def submit(self, client: str, data: bytes, parsed: Envelope, hops: int = 0,
                     traceparent: str = "") -> Any: ...

    async def thread_exists(self, thread: str, durable: bool) -> bool: ...

    async def pending(self, client: str) -> list[tuple[int, str, bytes]]: ...

    def delivered(self, client: str, outbox_id: int) -> None: ...

    def offers(self, names: list[str]) -> list[Offer]: ...  # local listeners, as offered

    def local_classes(self) -> Mapping[tuple[str, str], type]: ...  # payload roots here


@dataclass
class GatewayLink:
    """One gateway's live state (what `agentctl status` shows)."""

    config: GatewayConfig
    public_key: Ed25519PublicKey
    state: LinkState = LinkState.DOWN
    since: float = field(default_factory=time.time)
    attempts: int = 0  # failed dials since the last success
    connection: Connection | None = None
    dialed: bool = False  # whether the up link is one we dialed
    up_count: int = 0  # how many times a link came up
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    bucket: TokenBucket | None = None  # the peer's call rate, per link
    admitting: int = 0  # the peer's calls being admitted now
    replies: ReplyWindow = field(default_factory=lambda: ReplyWindow(MAX_PENDING_REPLIES))
    peer_max_frame: int = MIN_FRAME_LIMIT  # the largest frame the peer takes (its HELLO)
    sending: FrameQueue | None = None  # frames for the up link's writer
    offer_expected: bool = False  # our schema request is unanswered on the up link

    def apply(self, event: LinkEvent) -> None:
        new = transition(self.state, event)
        if new is not self.state:
            self.state, self.since = new, time.time()
        self.changed.set()

    def status(self, imports: Mapping[str, str] | None = None) -> dict[str, Any]:
        return {
            "imports": dict(imports or {}),
            "name": self.config.name,
            "state": self.state.value,
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since)),
            "direction": ("out" if self.dialed else "in") if self.state is LinkState.UP else "",
            "url": self.config.url or "",
            "failed_dials": self.attempts,
            # The largest frame the peer takes, from the last link's handshake.
            "peer_max_frame": self.peer_max_frame if self.up_count else None,
            "peer_key": fingerprint(self.public_key),
        }
