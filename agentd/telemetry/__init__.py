"""Telemetry: the conversation view built from the journal (`conversation_tree`).

Nothing here imports OpenTelemetry: an organism without a `telemetry:` section
never loads it.
"""

from agentd.telemetry._conversation import Node, conversation_tree

__all__ = ["Node", "conversation_tree"]
