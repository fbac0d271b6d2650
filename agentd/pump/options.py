"""What a pump runs with, as one value: the `pump:` section and the limits and flags
it takes from the rest of the configuration (the bus's envelope limits, `meta:`,
the exported gateways). Built once from the loaded configuration
(`agentd._wiring.pump_options`) and handed to the `Pump` whole; a reload changes
only what `Pump.reload` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agentd._xml import DEFAULT_SHAPE, ShapeLimits
from agentd.config import MetaConfig, PumpConfig


@dataclass(frozen=True)
class PumpOptions:
    """`pump`: the `pump:` section. `max_envelope_bytes` and `shape`: what any
    envelope is held to (the bus's limits), client input and handler output alike.
    `meta`: which meta questions clients may ask (all off by default). `gateways`:
    the clients that are peer organisms exporting listeners; their call is answered
    by the reply alone, so they are never sent `approval-required`."""

    pump: PumpConfig = field(default_factory=PumpConfig)
    max_envelope_bytes: int = 256 * 1024
    shape: ShapeLimits = DEFAULT_SHAPE
    meta: MetaConfig = field(default_factory=MetaConfig)
    gateways: frozenset[str] = frozenset()
