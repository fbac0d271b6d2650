"""Built-in tool kinds: from a listener's `tool:` block to runnable tools.

A tool is a listener whose handler and classes agentd provides. Each kind lives in
its own module and exposes a builder `(config, listener_name) -> Sequence[Tool]`,
called once when the configuration is loaded (and again on reload); host checks
that can fail (a hash, a missing kernel mechanism that must not be degraded) raise
`ToolUnavailable`, which the loader reports at the `tool:` block's location.

At run time a tool is an ordinary handler: its output re-enters the pump as
untrusted input like any other. A refusal by its confinement raises
`agentd.tools.Denied`; the pump answers `huh denied` and journals a security event.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentd._core import Ack, Huh
from agentd._errors import AgentdError, HuhCode
from agentd._handler import HandlerMetadata, HandlerResponse

Handler = Callable[[Any, HandlerMetadata], Awaitable[HandlerResponse | None]]


@dataclass(frozen=True)
class Tool:
    """One listener's worth of tool: what it accepts, answers and runs."""

    payload_classes: tuple[type, ...]
    response_classes: tuple[type, ...]
    handler: Handler
    description: str  # for the tool prompt when the listener gives none
    # Non-empty when one `tool:` block yields several listeners (an MCP server's
    # tools): the listener is then named `NAME.SUFFIX`.
    suffix: str = ""
    # Text from a third party (an MCP server's own tool description): shown to
    # agents only spotlighted, after the listener's `description`.
    third_party: str = ""
    # What identifies this tool's contract beyond its configuration (an MCP tool's
    # pin), so a reload lists the listener as changed when it differs.
    ref: str = ""


class ToolUnavailable(AgentdError):
    """A tool cannot be built as configured on this host: a configuration error."""


# kind -> "module:builder". Imported on first use, so an organism without tools
# pays nothing for them.
BUILDERS: dict[str, str] = {
    "file-read": "agentd.tools.files:build_file_read",
    "file-write": "agentd.tools.files:build_file_write",
    "file-list": "agentd.tools.files:build_file_list",
    "exec": "agentd.tools.exec:build",
    "http-fetch": "agentd.tools.http:build",
    "wasm": "agentd.tools.wasm:build",
    "timer": "agentd.tools.timer:build",
    "mcp": "agentd.mcp:build",
}


def build_tool(config: Any, listener: str) -> Sequence[Tool]:
    """The tools one `tool:` block declares; `ToolUnavailable` if it cannot run here."""
    module_name, _, attribute = BUILDERS[config.kind].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ToolUnavailable(f"tool kind {config.kind!r} is not available in this "
                              "build of agentd") from None
    builder: Callable[[Any, str], Sequence[Tool]] = getattr(module, attribute)
    return [replace(tool, handler=_answering(tool.handler)) for tool in builder(config, listener)]


def _answering(handler: Handler) -> Handler:
    """A tool only ever answers; the one message it gets besides its requests is the
    pump's `huh` refusing its answer (over the envelope limit, say). Its caller must
    then hear that the call failed, not wait for an answer that will not come."""

    async def call(payload: Any, meta: HandlerMetadata) -> HandlerResponse | None:
        if isinstance(payload, Huh):
            code = HuhCode.TOO_LARGE if payload.code is HuhCode.TOO_LARGE else HuhCode.INTERNAL
            return HandlerResponse.error(code)
        if isinstance(payload, Ack):
            return None
        return await handler(payload, meta)

    return call
