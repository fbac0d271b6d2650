"""Six-layer context assembly with spotlighting and `validate_no_override`.

    1 core context      immutable  system role   the registry's layer 1
    2 characteristics   immutable  system role   the registry's layer 2
    3 shared context    read-only  user role     organism-wide facts
    4 delegated context per task   user role     the task payload (XML)
    5 working memory    per task   user/assist.  results, notices; the model's replies
    6 long-term memory  persistent user role     recalled memories

Invariants kept here:
- Only layers 1-2 are ever in the system slot, and they are the registry's text
  byte for byte (checked on every assembly).
- Every fragment of layers 3-6 that did not come from the model is wrapped in a data
  block delimited by markers carrying a per-call random nonce; inside, the marker
  characters and chat role tags / special tokens are neutralised, so no text can
  close a block, open another, or pose as a system turn. The model's own earlier
  replies (layer 5, assistant role) are neutralised the same way but not wrapped.
- A keyed fact declared in a higher layer (`@fact KEY: VALUE` in layers 1-2, the
  shared facts of layer 3, `@fact` lines of the task) cannot be redefined by a
  lower one: the offending line (or keyed entry) is dropped and reported as a
  security event for the journal.
- Phrases typical of injection ("ignore previous instructions", ...) are left in
  place (they are data, in a data block) but reported as security events.

Everything here is pure: strings in, strings and events out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import lru_cache

from agentd.llm import ChatMessage, Role, ToolCall, ToolResult
from agentd.platform._prompts import FACT_LINE, AgentPrompt, PromptRegistry, fact_key


class Layer(IntEnum):
    CORE = 1
    CHARACTERISTICS = 2
    SHARED = 3
    DELEGATED = 4
    WORKING = 5
    LONG_TERM = 6


OPEN, CLOSE = "\u27e6", "\u27e7"  # the spotlight brackets: never left in untrusted text
_QL, _QR = "\u2039", "\u203a"  # what a neutralised role tag's angle brackets become


@dataclass(frozen=True)
class SecurityEvent:
    kind: str  # fact-override | injection-suspected | role-tag | marker | override-violation
    layer: Layer
    source: str
    detail: str


@dataclass(frozen=True)
class Fragment:
    """One piece of layers 3-6, already prepared (neutralised, facts enforced)."""

    layer: Layer
    content: str
    source: str  # platform-chosen label: "task", "result:calculator.add", "memory", ...
    role: Role = "user"  # "assistant" only for the model's own replies (layer 5)
    # A schema-checked payload (a task, a result), neutralised as XML: its element
    # names come from the schema, not from whoever wrote the payload.
    xml: bool = False
    # Native tool calling: the provider tool calls of a reply; the call a result
    # answers (its content then goes back as that call's tool result).
    calls: tuple[ToolCall, ...] = ()
    call_id: str = ""
    is_error: bool = False

    @property
    def nbytes(self) -> int:
        """UTF-8 bytes of what the fragment puts in a request (its calls included)."""
        return len(self.content.encode()) + sum(
            len(c.id) + len(c.name) + len(c.arguments.encode()) + 32 for c in self.calls)


@dataclass(frozen=True)
class Prepared:
    content: str
    events: tuple[SecurityEvent, ...] = ()
    facts: Mapping[str, str] = field(default_factory=dict)  # new `@fact`s it declared


@dataclass(frozen=True)
class AssembledContext:
    agent: str
    system: str
    messages: tuple[ChatMessage, ...]
    nonce: str
    layers: tuple[tuple[Layer, ...], ...]  # the layers in each message, for audit
    # The contents of the XML fragments (see Fragment.xml): validated as XML, so a
    # payload field named like a chat role (`<user>`) is not taken for a role tag.
    xml_bodies: frozenset[str] = frozenset()


# ---- neutralisation -----------------------------------------------------------------

_LT, _GT = r"(?:<|&lt;)", r"(?:>|&gt;)"
_SPECIAL_TOKEN = re.compile(rf"{_LT}\|([^|<>&\n]{{0,40}})\|{_GT}")
_ROLE_TAG = re.compile(
    rf"{_LT}(/?)[ \t]*(system|assistant|user|human|developer|tool|instructions?|im_start|"
    rf"im_end|start_header_id|end_header_id|eot_id)\b([^<>\n]{{0,80}}?){_GT}",
    re.IGNORECASE,
)
_LLAMA = re.compile(rf"\[(/?)INST\]|{_LT}{_LT}(/?)SYS{_GT}{_GT}", re.IGNORECASE)
_TURN_PREFIX = re.compile(
    r"(?im)^([ \t>#*]*)(system|assistant|human|developer)([ \t]*):"
)
_XML_SPLIT = re.compile(r"(<[^<>]*>)")

_INJECTION = re.compile(
    r"\b(?:ignore|disregard|forget|override)\b[^\n.]{0,40}?\b(?:previous|prior|above|earlier|"
    r"preceding|all|your|the)\b[^\n.]{0,30}?\b(?:instructions?|prompts?|rules|directions|"
    r"guidelines|constraints)\b"
    r"|\byou are now\b|\bnew (?:system )?instructions?\s*:"
    r"|\b(?:reveal|print|show|repeat|output)\b[^\n.]{0,20}\b(?:system prompt|instructions)\b",
    re.IGNORECASE,
)


def _one_pass(text: str, hits: list[str]) -> str:
    if OPEN in text or CLOSE in text:
        hits.append("marker")
        text = text.replace(OPEN, "[").replace(CLOSE, "]")
    if "|" in text:
        new = _SPECIAL_TOKEN.sub(lambda m: f"{_QL}¦{m.group(1)}¦{_QR}", text)
        if new != text:
            hits.append("role-tag")
            text = new
    if "<" in text or "&lt;" in text:
        new = _ROLE_TAG.sub(lambda m: f"{_QL}{m.group(1)}{m.group(2)}{m.group(3)}{_QR}", text)
        if new != text:
            hits.append("role-tag")
            text = new
    upper = text.upper()
    if "INST" in upper or "SYS" in upper:
        new = _LLAMA.sub(lambda m: "(INST)" if m.group(0).startswith("[") else "(SYS)", text)
        if new != text:
            hits.append("role-tag")
            text = new
    if ":" in text:
        new = _TURN_PREFIX.sub(r"\1\2 (quoted)\3:", text)
        if new != text:
            hits.append("role-tag")
            text = new
    return text


def _neutralise_text(text: str, hits: list[str]) -> str:
    """Passes until nothing changes: one replacement can complete another pattern
    (`<|<<SYS>>|>` becomes `<|(SYS)|>`). Each pass removes angle brackets or
    bracketed tokens, so this ends; the bound is a guard."""
    for _ in range(8):
        found: list[str] = []
        new = _one_pass(text, found)
        hits.extend(found)
        if not found:
            return new
        text = new
    return text.replace("<", _QL).replace("&lt;", _QL).replace("|", "¦")


def neutralise(text: str, *, xml: bool = False) -> tuple[str, list[str]]:
    """`text` with markers and role tags made inert, and the kinds of what was found.
    For XML, only character data is touched: element structure is schema-checked."""
    hits: list[str] = []
    if not xml:
        return _neutralise_text(text, hits), hits
    parts = _XML_SPLIT.split(text)
    for i in range(0, len(parts), 2):  # even indexes are character data
        if parts[i]:
            parts[i] = _neutralise_text(parts[i], hits)
    return "".join(parts), hits


# ---- keyed facts ------------------------------------------------------------------

_ASSIGN = r"[ \t]*(?:::=|:=|=|:|\bis\b(?:[ \t]+now)?|\bequals\b|\bshould be\b|\bbecomes\b)[ \t]*"


@lru_cache(maxsize=256)
def _redefinition(keys: frozenset[str]) -> re.Pattern[str] | None:
    if not keys:
        return None
    alternatives = "|".join(
        r"[\s_.\-]*".join(re.escape(part) for part in key.split("_")) for key in sorted(keys)
    )
    return re.compile(
        rf"(?<![A-Za-z0-9])(?:@fact[ \t]+)?(?P<key>{alternatives})(?![A-Za-z0-9]){_ASSIGN}"
        r"(?P<value>[^\n<]*)",
        re.IGNORECASE,
    )


def _same_value(a: str, b: str) -> bool:
    def norm(s: str) -> str:
        return re.sub(r"[^a-z0-9]+", "", s.lower())

    na, nb = norm(a), norm(b)
    return bool(nb) and na.startswith(nb)


def _strip_lines(text: str, pattern: re.Pattern[str], protected: Mapping[str, str],
                 removed: list[str]) -> str:
    out: list[str] = []
    for line in text.split("\n"):
        offending = [
            m for m in pattern.finditer(line)
            if not _same_value(m["value"], protected[fact_key(m["key"])])
        ]
        if offending:
            key = fact_key(offending[0]["key"])
            removed.append(key)
            line = f"[removed by the platform: a line redefining the fact {key}]"
        out.append(line)
    return "\n".join(out)


def _strip_redefinitions(
    text: str, protected: Mapping[str, str], removed: list[str], *, xml: bool = False
) -> str:
    """Drop each line that redefines a protected fact (for XML, each line of
    character data: the element structure stays)."""
    pattern = _redefinition(frozenset(protected))
    if pattern is None or pattern.search(text) is None:
        return text
    if not xml:
        return _strip_lines(text, pattern, protected, removed)
    parts = _XML_SPLIT.split(text)
    for i in range(0, len(parts), 2):
        if parts[i]:
            parts[i] = _strip_lines(parts[i], pattern, protected, removed)
    return "".join(parts)


def prepare(
    text: str,
    *,
    layer: Layer,
    source: str,
    protected: Mapping[str, str],
    xml: bool = False,
) -> Prepared:
    """Neutralise untrusted `text`, drop redefinitions of `protected` facts, spot
    injection phrases; collect the `@fact` lines it declares itself (kept, and
    protected from the layers below if the caller wishes)."""
    content, hits = neutralise(text, xml=xml)
    events: list[SecurityEvent] = []
    for kind in dict.fromkeys(hits):
        events.append(SecurityEvent(kind, layer, source, f"{kind} neutralised"))
    match = _INJECTION.search(content)
    if match is not None:
        events.append(
            SecurityEvent("injection-suspected", layer, source, match.group(0)[:80])
        )
    removed: list[str] = []
    content = _strip_redefinitions(content, protected, removed, xml=xml)
    for key in dict.fromkeys(removed):
        events.append(
            SecurityEvent("fact-override", layer, source, f"attempt to redefine {key!r} dropped")
        )
    segments = _XML_SPLIT.split(content)[0::2] if xml else [content]
    facts = {
        fact_key(m["key"]): m["value"]
        for segment in segments for m in FACT_LINE.finditer(segment)
        if fact_key(m["key"]) not in protected
    }
    return Prepared(content, tuple(events), facts)


def prepare_keyed(
    entries: Iterable[tuple[str | None, str]],
    *,
    layer: Layer,
    source: str,
    protected: Mapping[str, str],
) -> tuple[list[tuple[str | None, str]], list[SecurityEvent]]:
    """Keyed entries (shared facts, keyed memories): an entry whose key a higher layer
    defined is dropped whole (and reported); the others are prepared as text."""
    kept: list[tuple[str | None, str]] = []
    events: list[SecurityEvent] = []
    for key, value in entries:
        if key is not None and fact_key(key) in protected:
            if _same_value(value, protected[fact_key(key)]):
                continue  # restating a fact is not redefining it; it is already there
            events.append(SecurityEvent(
                "fact-override", layer, source, f"keyed entry redefining {fact_key(key)!r} dropped"
            ))
            continue
        prepared = prepare(value, layer=layer, source=source, protected=protected)
        events.extend(prepared.events)
        kept.append((key, prepared.content))
    return kept, events


# ---- assembly -----------------------------------------------------------------------

_SOURCE_SAFE = re.compile(r"[^A-Za-z0-9_.:\-]")


def block(fragment: Fragment, nonce: str) -> str:
    source = _SOURCE_SAFE.sub("_", fragment.source)[:80]
    return (
        f"{OPEN}data:{nonce} layer={int(fragment.layer)} source={source}{CLOSE}\n"
        f"{fragment.content}\n{OPEN}/data:{nonce}{CLOSE}"
    )


def assemble(
    prompt: AgentPrompt,
    *,
    nonce: str,
    task: Fragment,
    shared: Sequence[Fragment] = (),
    working: Sequence[Fragment] = (),
    memories: Sequence[Fragment] = (),
) -> AssembledContext:
    """Lay out the six layers: the system slot holds layers 1-2; the first user
    message holds layers 3, 4 and 6 (in priority order, each in its data block);
    then layer 5 turn by turn, the model's replies as assistant messages.

    A reply's provider tool calls ride on its assistant message, and their results
    (each in its data block) on the next user message, under their call ids. A
    call is never shown without its result nor a result without its call (a
    provider refuses both): a result whose call is not in the reply just before it
    is shown as text, and a call left without a result gets an error result."""
    first = [*shared, task, *memories]
    messages: list[ChatMessage] = [
        ChatMessage("user", "\n\n".join(block(f, nonce) for f in first))
    ]
    layers: list[tuple[Layer, ...]] = [tuple(dict.fromkeys(f.layer for f in first))]
    pending: list[Fragment] = []
    open_calls: dict[str, None] = {}  # the calls of the last reply, not yet answered

    def flush() -> None:
        results: list[ToolResult] = []
        texts: list[str] = []
        for f in pending:
            if f.call_id and f.call_id in open_calls:
                del open_calls[f.call_id]
                results.append(ToolResult(f.call_id, block(f, nonce), f.is_error))
            else:
                texts.append(block(f, nonce))
        results += [ToolResult(c, block(Fragment(
            Layer.WORKING, "error: this call was not made", "platform"), nonce), True)
            for c in open_calls]
        open_calls.clear()
        if texts or results:
            messages.append(ChatMessage("user", "\n\n".join(texts), results=tuple(results)))
            layers.append((Layer.WORKING,))
        pending.clear()

    for fragment in working:
        if fragment.role == "assistant":
            if pending or open_calls:
                flush()
            if messages[-1].role == "assistant":  # two replies in a row: keep alternation
                pending.append(Fragment(Layer.WORKING, "(no result yet)", "platform"))
                flush()
            messages.append(ChatMessage("assistant", fragment.content, fragment.calls))
            open_calls.update(dict.fromkeys(c.id for c in fragment.calls))
            layers.append((Layer.WORKING,))
        else:
            pending.append(fragment)
    if pending or open_calls:
        flush()
    if messages[-1].role == "assistant":
        pending.append(Fragment(Layer.WORKING, "(continue)", "platform"))
        flush()
    xml_bodies = frozenset(f.content for f in (*first, *working) if f.xml)
    return AssembledContext(
        prompt.agent, prompt.system_prompt, tuple(messages), nonce, tuple(layers), xml_bodies
    )


# ---- validate_no_override -------------------------------------------------------------

# One compiled pattern for every call: the nonce is captured and compared, not
# compiled in (a pattern per nonce would be compiled on every call).
_BLOCKS = re.compile(
    rf"{OPEN}data:([0-9a-f]+) layer=([0-9]+) source=[A-Za-z0-9_.:\-]*{CLOSE}\n(.*?)\n"
    rf"{OPEN}/data:\1{CLOSE}",
    re.DOTALL,
)


def validate_no_override(
    ctx: AssembledContext,
    registry: PromptRegistry,
    protected: Mapping[str, str],
) -> list[str]:
    """Every way the assembled context could let a lower layer pose as a higher one;
    empty when it is sound. Run on every assembly, before the call."""
    problems: list[str] = []
    if not registry.matches(ctx.agent, ctx.system):
        problems.append("layers 1-2 differ from the prompt registry")
    nonce = ctx.nonce
    if not re.fullmatch(r"[0-9a-f]{16,64}", nonce):
        problems.append("missing or weak spotlight nonce")
        return problems
    blocks = _BLOCKS
    redefinition = _redefinition(frozenset(protected))
    for i, msg in enumerate(ctx.messages):
        where = f"message {i} ({msg.role})"
        if msg.role not in ("user", "assistant"):
            problems.append(f"{where}: a lower layer in the {msg.role!r} role")
            continue
        if msg.role == "user":
            bodies: list[str] = []
            rest: list[str] = []
            pos = 0
            for result in msg.results:  # each one data block, whole
                m = blocks.fullmatch(result.content)
                if m is None or m.group(1) != nonce:
                    problems.append(f"{where}: a tool result outside a data block")
                else:
                    bodies.append(m.group(3))
            for m in blocks.finditer(msg.content):
                if m.group(1) != nonce:
                    continue  # not this call's block: what it holds counts as outside
                if int(m.group(2)) < Layer.SHARED:
                    problems.append(f"{where}: a data block claims layer {m.group(2)}")
                rest.append(msg.content[pos:m.start()])
                pos = m.end()
                bodies.append(m.group(3))
            rest.append(msg.content[pos:])
            if "".join(rest).strip():
                problems.append(f"{where}: content outside the data blocks")
        else:
            bodies = [msg.content]
        for body in bodies:
            if OPEN in body or CLOSE in body:
                problems.append(f"{where}: a spotlight marker inside untrusted content")
            if body in ctx.xml_bodies:  # character data only: the elements are the schema's
                _, hits = neutralise(body, xml=True)
            else:
                hits = []
                _neutralise_text(body, hits)
            if "role-tag" in hits:
                problems.append(f"{where}: a role tag inside untrusted content")
            if redefinition is not None:
                for m in redefinition.finditer(body):
                    if not _same_value(m["value"], protected[fact_key(m["key"])]):
                        problems.append(f"{where}: redefines the fact {fact_key(m['key'])!r}")
    return problems
