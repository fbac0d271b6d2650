"""A model's native tool call, decided: the payload for the listener it named, or
that call's error result. Pure: no pump, no I/O.

The call's tool name is looked up in the agent's own table (never guessed back from
the name), its arguments must be a JSON object, and the payload they shape must pass
the listener's XSD; any failure is an error result naming the reason, so nothing that
fails goes out. What passes is addressed to that listener by name: it re-enters the
pump as the agent's untrusted output, validated and routed again like any call.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lxml import etree

from agentd._xmlify import XmlSpec
from agentd.llm import ToolCall, ToolResult
from agentd.llm.tools import Shape, payload_xml, shape_of_xsd, tool_name
from agentd.platform._history import ASSISTANT, RESULT, Turn

_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)
MAX_REASON = 300  # characters of a schema's reason given back to the model


@dataclass(frozen=True, slots=True)
class PeerTool:
    listener: str
    spec: XmlSpec
    shape: Shape


@dataclass(frozen=True, slots=True)
class AddressedCall:
    """A call that passed: its payload, for the listener `to`, under its call id;
    `ref`, the name the pump carries it under (`call_ref`)."""

    call_id: str
    to: str
    payload: bytes
    ref: str = ""


def call_ref(reply: int, index: int) -> str:
    """The ref of call `index` of the task's reply number `reply`: the platform's own
    name for it (never the model's id, which may repeat), the same when the reply is
    read back from the durable history."""
    return f"{reply}.{index}"


def peer_tools(peers: Iterable[tuple[str, XmlSpec]]) -> dict[str, PeerTool]:
    """Tool name -> peer, from (listener, payload spec) pairs (first spec wins)."""
    table: dict[str, PeerTool] = {}
    for listener, spec in peers:
        name = tool_name(listener)
        if name not in table:
            table[name] = PeerTool(listener, spec, shape_of_xsd(spec.xsd))
    return table


def decide(call: ToolCall, tools: Mapping[str, PeerTool], ref: str = ""
           ) -> AddressedCall | ToolResult:
    """The payload `call` asks for, addressed to its listener, or its error result."""
    peer = tools.get(call.name)
    if peer is None:
        known = ", ".join(sorted(tools)) or "none"
        return _error(call, f"there is no tool named {call.name!r} (your tools: {known})")
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError as exc:
        return _error(call, f"the arguments are not JSON ({exc})")
    if not isinstance(arguments, dict):
        return _error(call, "the arguments must be a JSON object")
    try:
        payload = payload_xml(peer.shape, arguments)
        element = etree.fromstring(payload, _PARSER)
    except (ValueError, etree.XMLSyntaxError) as exc:
        return _error(call, f"the arguments do not match the tool's schema: {exc}")
    schema = peer.spec.schema
    if not schema.validate(element):
        reason = schema.error_log.last_error.message if schema.error_log else "invalid"
        return _error(call, "the arguments do not match the tool's schema: "
                      + reason[:MAX_REASON])
    return AddressedCall(call.id, peer.listener, payload, ref)


def _error(call: ToolCall, reason: str) -> ToolResult:
    return ToolResult(call.id, f"error: {reason}", is_error=True)


def open_calls(turns: Sequence[Turn], last: int, tools: Mapping[str, PeerTool]
               ) -> list[AddressedCall]:
    """The native calls of reply `last` in a task's history (with their refs) that have
    no result in `turns`: what an agent, in process or isolated, finds open after a
    restart."""
    reply = sum(1 for t in turns[:last + 1] if t.kind == ASSISTANT)
    done = {t.call_id for t in turns[last + 1:] if t.kind == RESULT and t.call_id}
    decided = (decide(c, tools, call_ref(reply, i)) for i, c in enumerate(turns[last].calls))
    return [d for d in decided if isinstance(d, AddressedCall) and d.call_id not in done]
