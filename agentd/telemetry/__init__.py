"""Telemetry: OpenTelemetry traces when configured (`configure`, `tracer`), and
the conversation view built from the journal (`conversation_tree`).

Nothing here imports OpenTelemetry until `configure` is given a `telemetry:`
section: an organism without one never loads it.
"""

from typing import Any

from agentd.telemetry import _tracing
from agentd.telemetry._conversation import Node, conversation_tree
from agentd.telemetry._tracing import OFF, configure, secret_values, shutdown, trace_id_of


def tracer() -> Any:
    """The tracer in force: `OFF` (every call a no-op) unless configured."""
    return _tracing.TRACER


__all__ = ["OFF", "Node", "configure", "conversation_tree", "secret_values", "shutdown",
           "trace_id_of", "tracer"]
