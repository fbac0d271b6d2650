"""What the MCP tests share: an organism with one `tool: {kind: mcp}` listener, and
closing the servers a test started."""

from __future__ import annotations

import json
import textwrap


def mcp_organism(name: str, tool: dict[str, object], description: str = "") -> str:
    """An organism whose only listener is `name` with this `tool:` block (kind mcp),
    every listener permitted to the `public` profile."""
    keys = "\n".join(f"      {k}: {json.dumps(v)}" for k, v in tool.items())
    said = f"\n    description: {json.dumps(description)}" if description else ""
    return textwrap.dedent("""\
        organism: {name: mcp-tests}
        pump: {handler_timeout_s: 30}
        profiles:
          public: {listeners: all}
        listeners:
        """) + f"  - name: {name}{said}\n    tool:\n      kind: mcp\n{keys}\n"


