"""Provider tool names for listener names, for native tool calling.

Providers accept tool names matching `^[a-zA-Z0-9_-]{1,64}$`; listener names may
also hold `.` (an MCP server's `NAME.TOOL`) and `:` (a peer organism's
`GATEWAY:LISTENER`). The mapping is fixed (`.` -> `__`, `:` -> `--`) so an operator
can read a tool name back; a name with any other character, or longer than 64
characters once mapped, has no tool name, and two peers of one agent that map to
one tool name are refused at load (`tool_names`), so the way back is a lookup in
the agent's own table, never a guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

NATIVE, XML, AUTO = "native", "xml", "auto"  # agent.tool_calling
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_LISTENER = re.compile(r"[A-Za-z0-9_.:\-]+")


class ToolNameError(ValueError):
    """A listener name that cannot be offered as a provider tool, with why."""


def tool_name(listener: str) -> str:
    """The provider tool name of `listener` (`ToolNameError` if it has none)."""
    if not _LISTENER.fullmatch(listener):
        raise ToolNameError(
            f"listener {listener!r} cannot be a provider tool: its name may hold letters, "
            "digits, '_', '-', '.' and ':' only (or set agent.tool_calling: xml)")
    name = listener.replace(".", "__").replace(":", "--")
    if not TOOL_NAME.fullmatch(name):
        raise ToolNameError(
            f"listener {listener!r} cannot be a provider tool: its tool name {name!r} has "
            f"{len(name)} characters, at most 64 are allowed (rename it, or set "
            "agent.tool_calling: xml)")
    return name


def tool_names(peers: Iterable[str]) -> dict[str, str]:
    """Tool name -> listener for one agent's peers; `ToolNameError` naming the first
    peer without a tool name, or two peers that map to one."""
    table: dict[str, str] = {}
    for peer in dict.fromkeys(peers):
        name = tool_name(peer)
        other = table.get(name)
        if other is not None:
            raise ToolNameError(
                f"peers {other!r} and {peer!r} both map to the provider tool name {name!r} "
                "('.' becomes '__', ':' becomes '--'): rename one, or set "
                "agent.tool_calling: xml")
        table[name] = peer
    return table
