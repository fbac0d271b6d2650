"""Tools: the built-in kinds a listener declares with `tool:` (files, commands,
HTTP, WASM, timers, MCP servers), each confined to what its configuration allows,
and the small demo tools (calculator, echo, relay) used by the demo organism and
the tests. Loading describes a `tool:` block (`describe_tool`: plain values); the
daemon's wiring builds the handlers from those (`tool_handlers`)."""

from agentd._errors import Denied
from agentd.tools.kinds import KINDS, LoadedTool, ToolUnavailable, describe_tool, tool_handlers

__all__ = ["KINDS", "Denied", "LoadedTool", "ToolUnavailable", "describe_tool", "tool_handlers"]
