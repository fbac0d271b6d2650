"""Built-in tool kinds: from a listener's `tool:` block to a described tool, and from
that description to its handler.

A tool is a listener whose handler and classes agentd provides. Each kind lives in
its own module and exposes two steps:

- `describe(config, listener) -> Sequence[LoadedTool]`, called when the configuration
  is loaded (and again on reload): the host checks that can fail (a hash, a module
  that does not compile, a missing kernel mechanism that must not be degraded, an
  MCP server's list of tools) raise `ToolUnavailable`, which the loader reports at
  the `tool:` block's location. What it returns is a value: the classes, what the
  model reads, and `runs`, the checked settings the handler is built from. Nothing
  in it runs or holds a session, a descriptor or a thread.
- `handlers(loaded) -> list[Handler]`, called by the daemon's wiring
  (`Routing.build`, through `tool_handlers`) for the listeners it puts in service:
  the runtime objects, which cannot fail on a described tool.

At run time a tool is an ordinary handler: its output re-enters the pump as
untrusted input like any other. A refusal by its confinement raises
`agentd.tools.Denied`; the pump answers `huh denied` and journals a security event.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from agentd._core import Ack, Huh
from agentd._errors import AgentdError, HuhCode
from agentd._handler import HandlerMetadata, HandlerResponse

Handler = Callable[[Any, HandlerMetadata], Awaitable[HandlerResponse | None]]


@dataclass(frozen=True)
class LoadedTool:
    """One listener's worth of tool, as loaded: what it accepts, answers and tells the
    model, and what its handler is built from. A value, compared by value."""

    kind: str  # the `tool:` block's kind: which module builds the handler
    name: str  # the listener's name: the block's, or `BLOCK.TOOL` when it yields several
    payload_classes: tuple[type, ...]
    response_classes: tuple[type, ...]
    description: str  # for the tool prompt when the listener gives none
    # The kind's checked settings its handler is built from (for most kinds the
    # `tool:` block itself).
    runs: Any
    # Text from a third party (an MCP server's own tool description): shown to
    # agents only spotlighted, after the listener's `description`.
    third_party: str = ""
    # What identifies this tool's contract beyond its configuration (an MCP tool's
    # pin), so a reload lists the listener as changed when it differs.
    ref: str = ""


class ToolUnavailable(AgentdError):
    """A tool cannot be built as configured on this host: a configuration error."""


# kind -> the module that describes it and builds its handlers. Imported on first
# use, so an organism without tools pays nothing for them.
KINDS: dict[str, str] = {
    "file-read": "agentd.tools.files",
    "file-write": "agentd.tools.files",
    "file-list": "agentd.tools.files",
    "exec": "agentd.tools.exec",
    "http-fetch": "agentd.tools.http",
    "wasm": "agentd.tools.wasm",
    "timer": "agentd.tools.timer",
    "mcp": "agentd.mcp",
}


def _module(kind: str) -> ModuleType:
    name = KINDS[kind]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        raise ToolUnavailable(f"tool kind {kind!r} is not available in this "
                              "build of agentd") from None


def describe_tool(config: Any, listener: str) -> Sequence[LoadedTool]:
    """The tools one `tool:` block declares (load); `ToolUnavailable` if it cannot
    run here."""
    describe: Callable[[Any, str], Sequence[LoadedTool]] = _module(config.kind).describe
    return tuple(describe(config, listener))


def tool_handlers(specs: Iterable[LoadedTool]) -> dict[str, Handler]:
    """Listener name -> the handler of each described tool (the wiring). The tools of
    one kind are built in one call, so the listeners of one `tool:` block share what
    they run on (an MCP server's session)."""
    by_kind: dict[str, list[LoadedTool]] = {}
    for spec in specs:
        by_kind.setdefault(spec.kind, []).append(spec)
    built: dict[str, Handler] = {}
    for kind, same in by_kind.items():
        handlers: Sequence[Handler] = _module(kind).handlers(same)
        built.update((spec.name, _answering(h)) for spec, h in zip(same, handlers, strict=True))
    return built


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
