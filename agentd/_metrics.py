"""Prometheus series (listed in docs/protocol.md). One registry per process; the pump and
transports increment pre-bound children so the hot path pays a dict-free increment."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

REGISTRY = CollectorRegistry(auto_describe=True)


# agentd_handler_seconds's bucket bounds (seconds).
HANDLER_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30)


class HotCounters(Collector):
    """Counters bumped once or more per message are plain ints, read at scrape time:
    a prometheus_client child increment takes a lock and costs ~0.3-1 us, a
    measurable share of a hop; a histogram observation takes two (~2 us a handler
    call). The event loop is their only writer; a scrape reads them between two
    of its steps."""

    def __init__(self) -> None:
        self.received = 0
        self.dispatch: dict[tuple[str, str], int] = {}
        # listener -> [sum, count in bucket 0, ..., count above the last bound]
        self.handler_seconds: dict[str, list[float]] = {}

    def handler_histogram(self, listener: str) -> list[float]:
        """The listener's agentd_handler_seconds cells, for `observe_handler`."""
        cells = self.handler_seconds.get(listener)
        if cells is None:
            cells = self.handler_seconds[listener] = [0.0] * (len(HANDLER_BUCKETS) + 2)
        return cells

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "agentd_envelopes_received", "Envelopes received from clients"
        )
        received.add_metric([], self.received)
        yield received
        dispatch = CounterMetricFamily(
            "agentd_dispatch", "Handler invocations by outcome", labels=["listener", "outcome"]
        )
        for (listener, outcome), value in sorted(self.dispatch.items()):
            dispatch.add_metric([listener, outcome], value)
        yield dispatch
        seconds = HistogramMetricFamily(
            "agentd_handler_seconds", "Handler run time", labels=["listener"])
        for listener, cells in sorted(self.handler_seconds.items()):
            buckets, total = [], 0.0
            for bound, count in zip((*HANDLER_BUCKETS, float("inf")), cells[1:], strict=True):
                total += count
                buckets.append((floatToGoString(bound), total))
            seconds.add_metric([listener], buckets, cells[0])
        yield seconds


def observe_handler(cells: list[float], seconds: float) -> None:
    """One handler run of `seconds` into a listener's `handler_histogram` cells."""
    cells[0] += seconds
    cells[bisect_left(HANDLER_BUCKETS, seconds) + 1] += 1


HOT = HotCounters()
REGISTRY.register(HOT)
envelopes_rejected = Counter(
    "agentd_envelopes_rejected",
    "Envelopes or outputs rejected, by huh code",
    ["code"],
    registry=REGISTRY,
)
queue_depth = Gauge("agentd_queue_depth", "Messages queued in the pump", registry=REGISTRY)
threads_active = Gauge("agentd_threads_active", "Frames in the thread registry", registry=REGISTRY)
security_events = Counter(
    "agentd_security_events", "Security events by kind", ["kind"], registry=REGISTRY
)
bus_connections = Gauge("agentd_bus_connections", "Open bus connections", registry=REGISTRY)
auth_failures = Counter("agentd_auth_failures", "Failed bus authentications", registry=REGISTRY)
bus_refused_unauthenticated = Counter(
    "agentd_bus_refused_unauthenticated",
    "Bus connections cut at once: too many unauthenticated ones (in all or from one address)",
    registry=REGISTRY,
)
oob_commands = Counter(
    "agentd_oob_commands", "Privileged commands", ["command", "outcome"], registry=REGISTRY
)
journal_commit_seconds = Histogram(
    "agentd_journal_commit_seconds",
    "Journal group-commit time",
    registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1),
)
llm_requests = Counter(
    "agentd_llm_requests", "LLM requests", ["backend", "outcome"], registry=REGISTRY
)
llm_latency = Histogram(
    "agentd_llm_latency_seconds", "LLM attempt latency, request sent to response read",
    ["backend", "outcome"], registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
)
llm_time_to_first_token = Histogram(
    "agentd_llm_time_to_first_token_seconds", "Time to a streamed LLM call's first chunk",
    ["backend"], registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
llm_tokens = Counter(
    "agentd_llm_tokens", "LLM tokens", ["agent", "backend", "kind"], registry=REGISTRY
)
db_size_bytes = Gauge("agentd_db_size_bytes", "Kernel database size", registry=REGISTRY)
kernel_healthy = Gauge(
    "agentd_kernel_healthy", "1 while journal writes succeed, 0 while they fail", registry=REGISTRY
)
kernel_writer_restarts = Gauge(
    "agentd_kernel_writer_restarts",
    "Kernel writer processes started again after one died, since the daemon started",
    registry=REGISTRY,
)
kernel_in_flight = Gauge(
    "agentd_kernel_in_flight",
    "Transactions handed to the kernel writer whose outcome is not known yet",
    registry=REGISTRY,
)
worker_restarts = Counter(
    "agentd_worker_restarts",
    "Isolated handler workers killed and replaced (crash, limit, timeout, recycle)",
    ["listener", "reason"],
    registry=REGISTRY,
)
workers = Gauge(
    "agentd_workers", "Isolated handler workers by state", ["listener", "state"], registry=REGISTRY
)
mcp_calls = Counter(
    "agentd_mcp_calls", "Calls to MCP server tools, by outcome", ["listener", "outcome"],
    registry=REGISTRY,
)
mcp_server_restarts = Counter(
    "agentd_mcp_server_restarts", "Sessions with an MCP server started again after one ended",
    ["server"], registry=REGISTRY,
)
approvals_pending = Gauge(
    "agentd_approvals_pending", "Messages parked at approval gates", registry=REGISTRY
)
approvals_total = Counter(
    "agentd_approvals",
    "Parked messages closed, by listener and outcome (approved, denied, expired, cancelled)",
    ["listener", "outcome"],
    registry=REGISTRY,
)
