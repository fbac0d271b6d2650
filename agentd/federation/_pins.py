"""What we import from each gateway, pinned: the SHA-256 of each listener's schema
as first offered (kept in the state directory), the changed offers waiting for a
reload to accept them, and the security events of offers that are bad, differ
from their pin or from what the operator declared (`schema_pins`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agentd.federation._peers import Audit, GatewayLink
from agentd.federation._remote import Offer, RemoteCalls, load_pins, save_pins, weigh_offers

log = logging.getLogger("agentd.federation")


class SchemaPins:
    def __init__(self, state_dir: Path | None, outgoing: Mapping[str, RemoteCalls],
                 audit: Audit, on_pinned: Callable[[], None] | None) -> None:
        self.state_dir = state_dir
        self.on_pinned = on_pinned  # a first pin: the routing is to be reloaded
        self.audit = audit
        self.outgoing = outgoing
        self.pins = load_pins(state_dir) if state_dir is not None and outgoing else {}
        self.offered: dict[str, dict[str, Offer]] = {}  # changed offers, for a reload

    def offers(self, link: GatewayLink, calls: RemoteCalls, items: list[Any],
               local: Mapping[tuple[str, str], type]) -> None:
        """The peer's schemas for what we import: pin what is new (and ask for the
        routing to be reloaded), block what differs from its pin."""
        peer = link.config.name
        pins = self.pins.setdefault(peer, {})
        weighed = weigh_offers(link.config.import_, items, pins, local, link.config.schema_pins)
        for detail in weighed.bad:
            self.audit("federation-bad-offer", {"peer": peer, "detail": detail})
        for name, offer in weighed.mismatched.items():
            self.audit("federation-schema-mismatch", {
                "peer": peer, "listener": name, "declared": link.config.schema_pins[name],
                "offered": offer.digest})
        calls.imports.update(weighed.states)
        for name, offer in weighed.changed.items():
            self.offered.setdefault(peer, {})[name] = offer
            self.audit("federation-schema-changed", {
                "peer": peer, "listener": name, "pinned": pins[name].digest,
                "offered": offer.digest})
        for name, offer in weighed.new.items():
            log.info("federation gateway=%s: pinned %s sha256=%s", peer, name, offer.digest)
        pins.update(weighed.new)
        if weighed.new and self.state_dir is not None:
            save_pins(self.state_dir, self.pins)
            if self.on_pinned is not None:
                self.on_pinned()

    def accept(self) -> list[str]:
        """A reload accepts the changed schemas offered since the last one: they
        become the pins. Returns `GATEWAY:LISTENER` of each."""
        accepted = [f"{peer}:{name}" for peer, offers in self.offered.items() for name in offers]
        if not accepted or self.state_dir is None:
            return []
        for peer, offers in self.offered.items():
            self.pins.setdefault(peer, {}).update(offers)
            for name in offers:
                self.outgoing[peer].imports[name] = "pinned"
        self.offered = {}
        save_pins(self.state_dir, self.pins)
        return accepted
