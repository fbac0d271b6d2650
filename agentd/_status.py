"""The daemon's `status` answers, read from what it runs: the organism's counts
(routing, threads, queue, kernel writer, bus, isolation, gateways, MCP, waits)
and the kernel's backend, role and lease. Reads only: nothing here changes state
or writes the database."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from agentd._operator import mcp_status
from agentd._wiring import kernel_dsn
from agentd.kernel import KernelUnavailable, read_lease

if TYPE_CHECKING:
    from agentd._routing import Routing
    from agentd.config import OrganismConfig
    from agentd.isolation import IsolationPools
    from agentd.kernel import Kernel
    from agentd.pump import Pump


class ObservedDaemon(Protocol):
    """The daemon as its status reads it (`agentd._daemon.Daemon`)."""

    config: OrganismConfig
    role: str
    started: float
    kernel: Kernel | None
    pump: Pump | None
    routing: Routing | None
    isolation: IsolationPools
    bus: Any
    federation: Any


def organism_status(daemon: ObservedDaemon) -> dict[str, Any]:
    """The `status` counts; a standby waiting for the lease runs nothing else yet."""
    config = daemon.config
    head = {"organism": config.name,
            "uptime_s": round(time.time() - daemon.started, 1),
            "config_sha256": config.digest}
    kernel, pump, routing = daemon.kernel, daemon.pump, daemon.routing
    if kernel is None or pump is None or routing is None:
        return head
    return {
        **head,
        "routing_version": routing.version,
        "listeners": sorted(routing.listeners),
        "threads": len(pump.registry),
        "queue_depth": pump.queue_depth,
        "kernel_healthy": kernel.healthy,
        "kernel_writer_pid": kernel.writer_pid,
        "kernel_writer_restarts": kernel.writer_restarts,
        "db_bytes": kernel.db_size_bytes(),
        "bus_connections": daemon.bus.connections if daemon.bus is not None else 0,
        "isolation": daemon.isolation.status(),
        "gateways": daemon.federation.status() if daemon.federation is not None else [],
        **mcp_status(),
        "approvals_pending": len(pump.waits.parked),
        "approvals_parked_bytes": pump.waits.parked_bytes,
        "timers_pending": len(pump.waits.timers),
    }


async def kernel_status(daemon: ObservedDaemon) -> dict[str, Any]:
    """`kernel: {backend, role, lease: {holder, epoch, since}}` for `status`. The
    holder's own lease is known here; a standby asks the database who holds it."""
    from agentd.oob import format_time

    config = daemon.config
    backend = config.kernel.backend
    doc: dict[str, Any] = {"backend": backend, "role": daemon.role, "lease": None}
    if backend != "postgres":
        return doc
    k = daemon.kernel
    if k is not None:
        held: tuple[str, int, float] | None = (k.lease_holder, k.lease_epoch, k.lease_since)
    else:
        try:
            held = await asyncio.wait_for(asyncio.to_thread(
                read_lease, kernel_dsn(config) or "", config.name), 10)
        except (KernelUnavailable, TimeoutError) as exc:
            doc["lease"] = {"error": str(exc) or "the database did not answer"}
            return doc
    if held is not None:
        doc["lease"] = {"holder": held[0], "epoch": held[1], "since": format_time(held[2])}
    return doc
