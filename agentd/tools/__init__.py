"""Tools: the built-in kinds a listener declares with `tool:` (files, commands,
HTTP, WASM, timers, MCP servers), each confined to what its configuration allows,
and the small demo tools (calculator, echo, relay) used by the demo organism and
the tests."""

from agentd._errors import Denied
from agentd.tools.kinds import BUILDERS, Tool, ToolUnavailable, build_tool

__all__ = ["BUILDERS", "Denied", "Tool", "ToolUnavailable", "build_tool"]
