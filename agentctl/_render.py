"""How agentctl shows a daemon's `<result>`.

`--json`: the result's JSON value by the rules of `agentd.oob._results` (typed
collections, stable shapes). Human output: that same value as an indented,
YAML-like outline; a text result (a schema, an example, a prompt) as it is.
"""

from __future__ import annotations

from typing import Any

from lxml import etree

from agentd.oob import result_to_json

__all__ = ["render_text", "render_trace", "result_to_json", "result_to_text"]


def result_to_text(result: etree._Element | None) -> str:
    return render_text(result_to_json(result))


def render_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    lines: list[str] = []
    _outline(value, 0, lines)
    return "\n".join(lines)


def _scalar(value: Any) -> str | None:
    """One-line form of a scalar or an empty collection; None when it needs lines."""
    if isinstance(value, str):
        return None if "\n" in value else value
    if value == [] or value == {}:
        return "(none)"
    if isinstance(value, dict | list):
        return None
    return "null" if value is None else str(value)


def _outline(value: Any, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    if isinstance(value, dict):
        for key, item in value.items():
            label = "text" if key == "#text" else key
            _entry(f"{pad}{label}:", item, depth, lines)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                # YAML style: the mapping's first key shares the line with the dash.
                start = len(lines)
                _outline(item, depth + 1, lines)
                lines[start] = f"{pad}- " + lines[start][len(pad) + 2:]
            else:
                _entry(f"{pad}-", item, depth, lines)
    else:
        text = str(value)
        lines.extend(f"{pad}{line}" for line in text.splitlines() or [""])


def _entry(head: str, item: Any, depth: int, lines: list[str]) -> None:
    one = _scalar(item)
    if one is not None:
        lines.append(f"{head} {one}" if one else head)
    elif isinstance(item, str):
        lines.append(f"{head} |")
        lines.extend(f"{'  ' * (depth + 1)}{line}" for line in item.splitlines())
    else:
        lines.append(head)
        _outline(item, depth + 1, lines)


def render_trace(value: Any) -> str:
    """`agentctl trace`: one line a node, indented by depth: kind, from -> to,
    [listener], outcome, duration, and the LLM call's backend, model and tokens."""
    if not isinstance(value, dict) or not isinstance(value.get("root"), dict):
        return render_text(value)
    lines = [f"thread {value.get('thread', '')}"]
    _trace_node(value["root"], 0, lines)
    return "\n".join(lines)


def _content_lines(content: dict[str, Any], indent: str, lines: list[str]) -> None:
    """An LLM call's messages (`trace --content`): the role, then each part's text."""
    if content.get("system"):
        lines.extend(f"{indent}system: {line}" for line in str(content["system"]).splitlines())
    for message in [*(content.get("input") or []), *(content.get("output") or [])]:
        if not isinstance(message, dict):
            continue
        role = message.get("role", "?")
        for part in message.get("parts") or []:
            if not isinstance(part, dict):
                continue
            text = part.get("content", part.get("response", part.get("arguments", "")))
            label = part.get("name") or part.get("type", "")
            head = f"{role} {label}" if label and label != "text" else str(role)
            for line in str(text).splitlines() or [""]:
                lines.append(f"{indent}{head}: {line}")


def _trace_node(node: dict[str, Any], depth: int, lines: list[str]) -> None:
    parts = [str(node.get("kind", "?")), f"{node.get('from') or '-'} -> {node.get('to') or '-'}"]
    if node.get("listener") and node.get("listener") != node.get("to"):
        parts.append(f"[{node['listener']}]")
    parts.append(str(node.get("outcome") or "-"))
    if node.get("duration_ms") is not None:
        parts.append(f"{node['duration_ms']:.1f} ms")
    if node.get("code"):
        parts.append(f"code={node['code']}")
    for key in ("backend", "model", "attempts"):
        if node.get(key) not in (None, ""):
            parts.append(f"{key}={node[key]}")
    tokens = node.get("tokens")
    if isinstance(tokens, dict):
        parts.append(f"tokens={tokens.get('input')}+{tokens.get('output')}")
    lines.append("  " * depth + "  ".join(parts))
    content = node.get("content")
    if isinstance(content, dict):
        _content_lines(content, "  " * (depth + 1) + "| ", lines)
    for child in node.get("children") or []:
        if isinstance(child, dict):
            _trace_node(child, depth + 1, lines)
