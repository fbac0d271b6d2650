"""Reading a model's reply: which parts are tool calls, which part is prose.

Models wrap payloads in prose and code fences, forget namespaces, leave a closing
tag out. The parser finds candidate elements (any element declaring a namespace,
and any element named like one of the agent's tools), cuts each out of the text
and parses it with the hardened parser, repairing only when the strict parse fails
(this is model output: the one kind of input agentd ever repairs).

Each candidate then becomes one of:
- a call: a payload of one of the agent's tools (a peer's route, or its own root
  for blind self-iteration) that validates against that tool's schema; a call
  written without its namespace gets the tool's namespace when the name is
  unambiguous (an element without a namespace that is never closed is a mention
  in prose, not a call);
- a notice (a local `huh`, fed back to the model next turn): malformed XML, or a
  tool payload that fails its schema (with the error and the tool's example);
- a pass-through call: a namespaced element of no tool of this agent. It is sent
  anyway, so that the pump refuses it (`huh unroutable`, and a peer-violation
  security event when it is a real route outside the peers); the agent is not
  the judge of its own permissions;
- an unfold: core `unfold` {`segment`}, answered by the platform itself (the
  segment is expanded for the next call); nothing is sent;
- an intent: core `intent` {text}, valid against the core schema, is a call too
  (the pump's semantic router picks and fills the tool);
- prose: an element that is an echo of a known result type, or of the core
  namespace, or anything without a namespace that is not a tool name.

`<think>...</think>` sections are dropped first: reasoning is not action.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from agentd._errors import Rejection
from agentd._schemas import NS_CORE, schema
from agentd._xml import c14n, parse_untrusted
from agentd.platform._prompts import Tool, ToolCatalogue

_START = re.compile(
    r"<([A-Za-z_][A-Za-z0-9_.\-]*(?::[A-Za-z_][A-Za-z0-9_.\-]*)?)((?:\s[^<>]*?)?)(/?)>"
)
_THINK = re.compile(r"<think(?:ing)?>.*?(?:</think(?:ing)?>|\Z)", re.DOTALL | re.IGNORECASE)
_EMPTY_FENCE = re.compile(r"```[A-Za-z0-9_+\-]*\s*```")
_ANSWER_WRAP = re.compile(r"\A\s*<answer>(.*)</answer>\s*\Z", re.DOTALL)
_XMLNS = re.compile(r"""\bxmlns\s*=\s*["']([^"']*)["']""")
MAX_CANDIDATE_BYTES = 256 * 1024
MAX_CANDIDATES = 128  # elements read from one reply (calls, notices, unfolds)
_INTENT = "{" + NS_CORE + "}intent"
_CORE_SCHEMA = schema(NS_CORE)


@dataclass(frozen=True)
class ParsedReply:
    calls: tuple[bytes, ...]  # C14N payload elements, in the order written
    notices: tuple[str, ...]  # local `huh`s for the model, one per refused candidate
    text: str  # the prose that remains
    unfolds: tuple[int, ...] = ()  # segments asked back with core `unfold`
    # The listener each call is addressed to ("": routed by its key alone: an intent,
    # or an element of no tool of this agent, which the pump refuses).
    to: tuple[str, ...] = ()

    @property
    def is_answer(self) -> bool:
        return not self.calls and not self.notices and not self.unfolds


_TAG = re.compile(
    r"<(/?)([A-Za-z_][A-Za-z0-9_.\-]*(?::[A-Za-z_][A-Za-z0-9_.\-]*)?)(?:\s[^<>]*?)?(/?)>"
)


def _ends(text: str) -> dict[int, int]:
    """For each element opened in `text` (by the start index of its tag), the index
    just past its closing tag, nesting of the same name counted; an element never
    closed has no entry. One pass over the text with a stack per name: a reply of
    many unclosed openers costs its length, not its length times their number (a
    scan to the end per opener froze the daemon for seconds on 50 KB)."""
    ends: dict[int, int] = {}
    open_at: dict[str, list[int]] = {}
    for m in _TAG.finditer(text):
        closing, name, selfclosing = m.group(1), m.group(2), m.group(3)
        if closing:
            stack = open_at.get(name)
            if stack:
                ends[stack.pop()] = m.end()
        elif not selfclosing:
            open_at.setdefault(name, []).append(m.start())
    return ends


_UNFOLD = "{" + NS_CORE + "}unfold"
_UNFOLD_HELP = ("huh invalid-payload: core unfold takes one <segment> with the number of a "
                "segment of this task.")


def _unfold(el: Any) -> tuple[str, str]:
    """('unfold', segment id) for `<unfold xmlns=core><segment>N</segment></unfold>`."""
    kids = [c for c in el if isinstance(c.tag, str)]
    if len(kids) != 1 or kids[0].tag != "{" + NS_CORE + "}segment":
        return "notice", _UNFOLD_HELP
    text = (kids[0].text or "").strip()
    if not text.isdigit() or len(text) > 9:
        return "notice", _UNFOLD_HELP
    return "unfold", text


def _example(tool: Tool) -> str:
    return tool.spec.example.decode()


def parse_reply(text: str, catalogue: ToolCatalogue) -> ParsedReply:
    text = _THINK.sub("", text)
    calls: list[bytes] = []
    to: list[str] = []
    notices: list[str] = []
    unfolds: list[int] = []
    prose: list[str] = []
    pos = 0
    ends: dict[int, int] | None = None
    taken = 0
    for m in _START.finditer(text):
        if m.start() < pos:
            continue  # inside a candidate already taken
        if taken == MAX_CANDIDATES:  # more is a flood, not a plan: the rest is not read
            notices.append(f"huh too-large: your reply holds more than {MAX_CANDIDATES} "
                           "elements; the rest was not read and nothing of it was sent.")
            break
        name, attrs, selfclosing = m.group(1), m.group(2) or "", m.group(3)
        local = name.rpartition(":")[2]
        declared = _XMLNS.search(attrs)
        if (declared is None and "xmlns" not in attrs and local not in catalogue.by_local
                and local != "unfold"):
            continue
        if selfclosing:
            end: int | None = m.end()
        else:
            if ends is None:
                ends = _ends(text)
            end = ends.get(m.start())
        closed = end is not None
        if not closed and declared is None and "xmlns" not in attrs:
            continue  # "<add>" mentioned in prose, never closed: not a call
        end = len(text) if end is None else end
        fragment = text[m.start():end]
        try:
            outcome = _candidate(fragment, name, local, declared, closed, catalogue)
        except Rejection as exc:  # e.g. a relative namespace URI: no canonical form
            outcome = ("notice", f"huh {exc.code.value}: your <{local}> element was not "
                                 f"sent ({exc.detail or 'not a valid payload'}).")
        if outcome is None:
            continue  # prose after all
        prose.append(text[pos:m.start()])
        pos = end
        taken += 1
        kind, value = outcome
        if kind == "call":
            payload, addressee = value if isinstance(value, tuple) else (value, "")
            calls.append(payload.encode() if isinstance(payload, str) else payload)
            to.append(addressee)
        elif kind == "unfold":
            unfolds.append(int(value))
        else:
            notices.append(str(value))
    prose.append(text[pos:])
    remaining = _EMPTY_FENCE.sub("", "".join(prose)).strip()
    wrapped = _ANSWER_WRAP.match(remaining)
    if wrapped is not None:
        remaining = wrapped.group(1).strip()
    return ParsedReply(tuple(calls), tuple(notices), remaining, tuple(unfolds), tuple(to))


def _candidate(
    fragment: str,
    name: str,
    local: str,
    declared: re.Match[str] | None,
    closed: bool,
    catalogue: ToolCatalogue,
) -> tuple[str, Any] | None:
    """('call', (c14n bytes, to)) | ('call', c14n bytes) | ('notice', text) | None (not
    a call: leave as prose). A tool's payload is addressed to its listener; when
    several of the agent's tools take it, the element's `to` attribute says which."""
    tool: Tool | None = None
    if declared is None and ":" not in name and local == "unfold" and not (
            catalogue.by_local.get(local)):
        # core unfold written without its namespace: the platform's own payload.
        fragment = re.sub(r"\A<unfold", f'<unfold xmlns="{NS_CORE}"', fragment)
    elif declared is None and ":" not in name:
        tools = catalogue.by_local.get(local, ())
        if len(tools) != 1:
            if tools:
                names = ", ".join(f"{t.spec.namespace}" for t in tools)
                return "notice", (
                    f"huh invalid-payload: <{local}> is ambiguous without its namespace "
                    f"(one of {names}); write the xmlns attribute."
                )
            return None
        tool = tools[0]
        # Repair: the tool's namespace, declared as the default on the element.
        fragment = re.sub(
            rf"\A<{re.escape(name)}", f'<{name} xmlns="{tool.spec.namespace}"', fragment
        )
    raw = fragment.encode()
    if len(raw) > MAX_CANDIDATE_BYTES:
        return "notice", f"huh too-large: your <{local}> element is larger than allowed."
    try:
        el = parse_untrusted(raw)
    except Rejection:
        try:
            el = parse_untrusted(raw, repair=True)
        except Rejection as exc:
            return "notice", (
                f"huh malformed: your <{local}> element is not well-formed XML "
                f"({exc.detail or exc.code.value}); nothing was sent."
            )
    if not isinstance(el.tag, str):
        return None
    key = el.tag
    if tool is None:
        tool = catalogue.by_key.get(key)
    if key == _UNFOLD:
        return _unfold(el)
    if tool is None and key == _INTENT:
        # Semantic routing: the agent says what it needs; the pump picks the tool.
        return ("call", c14n(el)) if _CORE_SCHEMA.validate(el) else (
            "notice", "huh invalid-payload: an <intent> holds one <text> element."
        )
    if tool is None:
        if key in catalogue.result_keys or key.startswith("{" + NS_CORE + "}"):
            return None  # an echo of a result, or of a notice: prose
        if not key.startswith("{"):
            return None
        return "call", c14n(el)  # not ours to judge: the pump refuses it
    peers = catalogue.peers_of.get(key, (tool.peer,))
    named = el.attrib.pop("to", None)
    if named is not None and named not in peers:
        return "notice", (f"huh invalid-payload: your <{tool.spec.tag}> call was not sent: "
                          f"to=\"{named}\" is none of your tools that take it "
                          f"({', '.join(peers)}).")
    if named is None and len(peers) > 1:
        return "notice", (f"huh invalid-payload: your <{tool.spec.tag}> call was not sent: "
                          f"several of your tools take it ({', '.join(peers)}); write "
                          f"to=\"NAME\" on the element to say which.")
    if not tool.spec.schema.validate(el):
        error = tool.spec.schema.error_log.last_error
        detail = error.message.rstrip(".") if error is not None else "does not match the schema"
        return "notice", (
            f"huh invalid-payload: your <{tool.spec.tag}> call for {tool.peer} was not sent: "
            f"{detail}." + ("" if closed else " (The element was not closed.)")
            + f" A valid call looks like: {_example(tool)}"
        )
    return "call", (c14n(el), named or peers[0])
