"""How the configuration becomes the options of the kernel and the pump, in one
place for the daemon and the test harness alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentd._errors import ConfigError
from agentd._secrets import SecretFileError, read_secret_file
from agentd._xml import ShapeLimits
from agentd.config import BusConfig, OrganismConfig
from agentd.kernel import KernelOptions, Retention

if TYPE_CHECKING:
    from agentd.pump import PumpOptions


def envelope_shape(bus: BusConfig) -> ShapeLimits:
    """The shape every envelope is held to (`bus.max_attributes`, `bus.max_elements`)."""
    return ShapeLimits(bus.max_attributes, bus.max_elements)


def pump_options(config: OrganismConfig) -> PumpOptions:
    """The pump's options for `config`, handed to `Pump` whole."""
    from agentd.pump import PumpOptions  # late: `agentd.cli` needs only the kernel's

    return PumpOptions(
        pump=config.pump,
        max_envelope_bytes=config.bus.max_envelope_bytes,
        shape=envelope_shape(config.bus),
        meta=config.meta,
        gateways=frozenset(g.name for g in config.gateways if g.export),
    )


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
        dsn=kernel_dsn(config),
        lease=config.name if config.kernel.backend == "postgres" else None,
    )


def kernel_dsn(config: OrganismConfig) -> str | None:
    """The postgres backend's DSN (read from `kernel.dsn_file` if given); None for
    sqlite. The file holds a password: read as every secret file is (owned by us,
    not readable by others, no link). Raises ConfigError if it fails or is empty."""
    k = config.kernel
    if k.backend != "postgres":
        return None
    if k.dsn is not None:
        return k.dsn
    assert k.dsn_file is not None  # the section's rules
    try:
        dsn = read_secret_file(k.dsn_file, "kernel.dsn_file").decode("utf-8").strip()
    except (SecretFileError, UnicodeDecodeError) as exc:
        raise ConfigError([str(exc)]) from None
    if not dsn:
        raise ConfigError([f"kernel.dsn_file: {k.dsn_file} is empty; write the "
                           "database's DSN there (postgresql://...)"])
    return dsn
