"""The conversation view: a client's thread as a tree, rebuilt from the journal.

Pure: journal entries of the thread and of the frames under it go in, nested
nodes come out; no exporter, no live state. A node is a dict
`{"kind", "from", "to", "listener", "outcome", "duration_ms", "children"}` plus,
where they apply, `backend`, `model`, `tokens`, `attempts`, `code`. The nesting
follows who acted: a message a listener sends while it handles a message is a
child of that handling (its hop); a reply from a listener ends its hop (outcome
and duration); an LLM call is a child of its agent's hop.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from agentd.kernel import JournalEntry

Node = dict[str, Any]

_HUH_CODE = re.compile(rb"<code>([A-Za-z0-9_.-]{1,64})</code>")
_APPROVAL = ("approval", "parked", "decision", "approved")


def _node(kind: str, sender: str | None, to: str | None, listener: str | None, ts: float
          ) -> Node:
    return {"kind": kind, "from": sender, "to": to, "listener": listener, "outcome": None,
            "duration_ms": None, "children": [], "_start": ts}


def _ms(start: float, end: float) -> float:
    return round(max(0.0, end - start) * 1000, 3)


def _huh_code(entry: JournalEntry) -> str | None:
    if not entry.tag.endswith("}huh") or entry.payload is None:
        return None
    found = _HUH_CODE.search(entry.payload)
    return found.group(1).decode() if found else "huh"


def _audit_fields(entry: JournalEntry) -> dict[str, Any]:
    try:
        fields = json.loads(entry.payload or b"{}")
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


class _Tree:
    """Hops still being handled, by listener (the newest last): where the next
    message a listener sends, or its LLM call, belongs."""

    def __init__(self, thread: str, agents: frozenset[str], remote: frozenset[str],
                 content: bool = False) -> None:
        self.content = content
        self.root = _node("conversation", None, None, None, 0.0)
        self.root["thread"] = thread
        self.open: dict[str, list[Node]] = {}
        self.agents = agents
        self.remote = remote
        self.first: float | None = None
        self.last = 0.0

    def hop_of(self, listener: str) -> Node:
        hops = self.open.get(listener)
        return hops[-1] if hops else self.root

    def close(self, listener: str, ts: float, outcome: str) -> None:
        hops = self.open.get(listener)
        if hops:
            hop = hops.pop()
            hop["outcome"] = outcome
            hop["duration_ms"] = _ms(hop["_start"], ts)

    def add(self, entry: JournalEntry) -> None:
        ts = entry.ts
        if self.first is None:
            self.first = ts
            self.root["from"] = entry.sender
            self.root["to"] = entry.handler or None
        self.last = max(self.last, ts)
        head = entry.kind.split("/", 1)[0]
        if entry.direction == "in" and head in ("request", "reply", "approved"):
            self._message(entry, head)
        elif entry.direction == "in" and head in ("parked", "decision"):
            node = _node("approval", entry.sender, entry.handler or None, None, ts)
            node["outcome"] = head
            self.hop_of(entry.sender)["children"].append(node)
        elif entry.direction == "out":
            code = _huh_code(entry)
            node = _node("reply", entry.sender, entry.handler, entry.sender, ts)
            node["outcome"] = "huh" if code else "ok"
            if code:
                node["code"] = code
            self.hop_of(entry.sender)["children"].append(node)
            self.close(entry.sender, ts, code or "ok")
        elif entry.direction in ("audit", "security"):
            self._audit(entry)

    def _message(self, entry: JournalEntry, head: str) -> None:
        ts, sender, to = entry.ts, entry.sender, entry.handler
        parent = self.hop_of(sender)
        if head == "reply":
            # A listener's answer: the end of its hop, delivered to the one that asked.
            code = _huh_code(entry)
            node = _node("result", sender, to, sender, ts)
            node["outcome"] = code or "ok"
            if code:
                node["code"] = code
            parent["children"].append(node)
            self.close(sender, ts, code or "ok")
            if not self.open.get(to):  # the receiver is not handling anything: a new hop
                hop = _node("hop", sender, to, to, ts)
                self.root["children"].append(hop)
                self.open.setdefault(to, []).append(hop)
            return
        if to in self.remote:
            kind = "federation"
        elif sender in self.agents:
            kind = "tool"
        else:
            kind = "hop"
        hop = _node(kind, sender, to, to, ts)
        if head == "approved":
            hop["outcome"] = "approved"
        parent["children"].append(hop)
        for name in to.split(","):
            self.open.setdefault(name, []).append(hop)

    def _audit(self, entry: JournalEntry) -> None:
        kind = entry.kind.removeprefix("llm.")
        fields = _audit_fields(entry)
        if kind == "llm-call":
            node = _node("llm", entry.handler, fields.get("backend"), entry.handler, entry.ts)
            node["outcome"] = fields.get("outcome")
            node["backend"] = fields.get("backend")
            node["model"] = fields.get("model")
            if "input_tokens" in fields:
                node["tokens"] = {"input": fields.get("input_tokens", 0),
                                  "output": fields.get("output_tokens", 0)}
            if "attempts" in fields:
                node["attempts"] = fields["attempts"]
            if "latency_ms" in fields:
                node["duration_ms"] = fields["latency_ms"]
            if "error" in fields:
                node["code"] = fields["error"]
            if self.content and isinstance(fields.get("content"), dict):
                node["content"] = fields["content"]
        elif any(word in kind for word in _APPROVAL):
            node = _node("approval", entry.sender, entry.handler or None, entry.handler or None,
                         entry.ts)
            node["outcome"] = kind
        elif "timer" in kind:
            node = _node("timer", entry.sender, entry.handler or None, entry.handler or None,
                         entry.ts)
            node["outcome"] = kind
        else:
            node = _node("security" if entry.direction == "security" else "event",
                         entry.sender or None, entry.handler or None, None, entry.ts)
            node["outcome"] = kind
        self.hop_of(entry.handler)["children"].append(node)

    def finish(self, state: str | None) -> Node:
        for hops in self.open.values():
            for hop in hops:
                if hop["outcome"] is None:
                    hop["outcome"] = "open"
        if self.first is not None:
            self.root["duration_ms"] = _ms(self.first, self.last)
        self.root["outcome"] = state
        _strip(self.root)
        return self.root


def _strip(node: Node) -> None:
    node.pop("_start", None)
    for child in node["children"]:
        _strip(child)


def conversation_tree(thread: str, entries: Iterable[JournalEntry], *, state: str | None = None,
                      agents: Iterable[str] = (), remote: Iterable[str] = (),
                      content: bool = False) -> Node:
    """The tree of `thread` from its journal `entries` (those of the thread and of
    the frames under it, in commit order). `agents`: the listeners that are LLM
    agents (their requests are tool calls); `remote`: listeners served by a peer
    organism (federation hops). `state`: the thread's state, the root's outcome.
    `content`: an LLM call's prompt and completion, where its record kept them
    (`telemetry.capture_content`), as the node's `content`."""
    tree = _Tree(thread, frozenset(agents), frozenset(remote), content)
    for entry in entries:
        if entry.kind != "meta":
            tree.add(entry)
    return tree.finish(state)
