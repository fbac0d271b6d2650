"""How the configuration becomes the options of the kernel and the pump, in one
place for the daemon and the test harness alike."""

from __future__ import annotations

from agentd._xml import ShapeLimits
from agentd.config import BusConfig, OrganismConfig
from agentd.kernel import KernelOptions, Retention


def envelope_shape(bus: BusConfig) -> ShapeLimits:
    """The shape every envelope is held to (`bus.max_attributes`, `bus.max_elements`)."""
    return ShapeLimits(bus.max_attributes, bus.max_elements)


def kernel_retention(config: OrganismConfig) -> dict[str, Retention]:
    """journal.retention as the default ("*"), with per-profile overrides."""
    policy = {"*": config.journal.retention}
    for name, profile in config.profiles.items():
        if profile.retention is not None:
            policy[name] = profile.retention
    return policy


def kernel_options(config: OrganismConfig) -> KernelOptions:
    """The kernel's options for `config` (the rest keep the kernel's defaults)."""
    j = config.journal
    return KernelOptions(
        synchronous=j.synchronous,
        commit_interval_s=j.commit_interval_ms / 1000,
        commit_max_entries=j.commit_max_entries,
        retention=kernel_retention(config),
        sweep_interval_s=j.sweep_interval_s,
        max_outbox_per_client=j.max_outbox_per_client,
        full_sync_profiles=frozenset(
            name for name, p in config.profiles.items() if p.synchronous == "FULL"
        ),
    )
