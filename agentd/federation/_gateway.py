"""A gateway's link to its peer, as values: the state machine, the backoff, and
which of two simultaneous links survives.

A gateway is DOWN (waiting to dial, or for the peer to dial), CONNECTING (our
dial: TLS, WebSocket and handshake under way), UP (one authenticated link), or
STOPPED (the daemon is stopping). Both sides may dial at once; when a second link
for the same peer authenticates, both organisms keep the one dialed by the
organism whose name sorts first (`keeps_link`), so they agree without talking.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentd._states import step

if TYPE_CHECKING:
    from agentd.config import OrganismConfig


class LinkState(enum.Enum):
    DOWN = "down"
    CONNECTING = "connecting"
    UP = "up"
    STOPPED = "stopped"


class LinkEvent(enum.Enum):
    DIAL = "dial"
    AUTHENTICATED = "authenticated"  # a link (dialed or accepted) passed the handshake
    FAILED = "failed"  # our dial failed (network, TLS, handshake)
    LOST = "lost"  # the up link closed
    STOP = "stop"


TRANSITIONS: Mapping[LinkState, Mapping[LinkEvent, LinkState]] = {
    LinkState.DOWN: {
        LinkEvent.DIAL: LinkState.CONNECTING,
        LinkEvent.AUTHENTICATED: LinkState.UP,
        LinkEvent.STOP: LinkState.STOPPED,
    },
    LinkState.CONNECTING: {
        LinkEvent.AUTHENTICATED: LinkState.UP,
        LinkEvent.FAILED: LinkState.DOWN,
        LinkEvent.STOP: LinkState.STOPPED,
    },
    LinkState.UP: {
        LinkEvent.AUTHENTICATED: LinkState.UP,  # a second link: `keeps_link` decides
        LinkEvent.FAILED: LinkState.UP,  # a redundant dial failed; the link stays
        LinkEvent.LOST: LinkState.DOWN,
        LinkEvent.STOP: LinkState.STOPPED,
    },
    LinkState.STOPPED: {
        LinkEvent.STOP: LinkState.STOPPED,
        LinkEvent.FAILED: LinkState.STOPPED,
        LinkEvent.LOST: LinkState.STOPPED,
    },
}


def transition(state: LinkState, event: LinkEvent) -> LinkState:
    return step("gateway link", TRANSITIONS, state, event)


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: the delay before dial number `attempt`
    (0 for the first retry), between half and all of `initial * 2**attempt`, never
    above `maximum`. `fraction` in [0, 1) is the caller's random draw."""

    initial: float = 0.5
    maximum: float = 30.0

    def delay(self, attempt: int, fraction: float) -> float:
        ceiling = min(self.maximum, self.initial * 2.0 ** min(attempt, 32))
        return ceiling * (0.5 + 0.5 * fraction)


def keeps_link(local: str, peer: str, dialed_by_local: bool) -> bool:
    """Of two authenticated links between `local` and `peer`, the one dialed by the
    organism whose name sorts first survives; both sides compute the same answer."""
    dialer = local if dialed_by_local else peer
    return dialer == min(local, peer)


def check_gateways(config: OrganismConfig) -> list[str]:
    """What the loader cannot see: each declared key parses."""
    from agentd.federation._identity import IdentityError, parse_public_line

    issues: list[str] = []
    for i, gateway in enumerate(config.gateways):
        try:
            parse_public_line(gateway.public_key)
        except IdentityError as exc:
            issues.append(f"gateways[{i}].public_key: {exc}")
    return issues
