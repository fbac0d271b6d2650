"""The deterministic extract: a fold summary that keeps every fact.

Used with `summarizer: extractive`, when the summarizer backend fails, and to
complete a model's summary with the facts it dropped. Facts are URLs, file paths,
numbers and identifiers (names with an underscore, a dot, a digit, inner capitals
or dashes between word parts; UUIDs and hex digests). The extract is the opening
of the text (its first sentence, bounded) followed by every distinct fact in the
order it first appears, so each fact of the original is in it verbatim.

Pure: text in, text out; the same text always gives the same extract.
"""

from __future__ import annotations

import re

_TAG = re.compile(r"<[^<>]{0,400}>")
# Order matters: the first alternative that matches at a position wins.
# Linear in the text (it reads tool results and model replies, which are untrusted):
# a relative path starts only where a run of its characters starts, so a long run
# with a word boundary every few characters ("a--a--a--...") is scanned once, not
# once per boundary; leading dashes are matched, then dropped (`facts`), so the
# path is the one a match from the run's first word character would give.
_FACT = re.compile(
    r"""(?x)
    (?P<url>\b[a-zA-Z][a-zA-Z0-9+.\-]{1,15}://[^\s<>"'`\])}]+)
  | (?P<path>(?<!<)(?:~|\.{1,2})?(?:/[A-Za-z0-9_.\-@%+~]+)+/?
        | \b[A-Za-z]:\\[^\s<>"'`]+
        | (?<![A-Za-z0-9_\-])-*+\b[A-Za-z0-9_\-]++(?:/[A-Za-z0-9_.\-]+)+)
  | (?P<uuid>\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b)
  | (?P<ident>\b[A-Za-z_][A-Za-z0-9]*(?:[_.\-:][A-Za-z0-9_]+)+\b
        | \b[A-Za-z]+[0-9][A-Za-z0-9]*\b
        | \b[a-z]+[A-Z][A-Za-z0-9]*\b
        | \b[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*\b
        | \b[0-9a-fA-F]{16,}\b)
  | (?P<number>[-+]?(?<![\w.])(?:\d[\d,_]*)?\.?\d+(?:[eE][-+]?\d+)?%?)
    """
)
_SENTENCE = re.compile(r"(.{1,160}?[.!?])(?:\s|$)", re.DOTALL)
OPENING_CHARS = 160


def facts(text: str) -> list[str]:
    """Every distinct fact of `text`, in order of first appearance. XML markup is
    read too: a namespace URL or an attribute value is a fact like any other."""
    seen: dict[str, None] = {}
    for m in _FACT.finditer(text):
        value = m.group(0).rstrip(".,;:")
        if m.lastgroup == "path":
            value = value.lstrip("-")
        if value and value not in seen:
            seen[value] = None
    return list(seen)


def opening(text: str) -> str:
    """The first sentence of the text's prose (markup removed), at most 160 chars."""
    prose = " ".join(_TAG.sub(" ", text).split())
    m = _SENTENCE.match(prose)
    head = m.group(1) if m else prose[:OPENING_CHARS]
    return head if len(head) <= OPENING_CHARS else head[:OPENING_CHARS] + "…"


def extract(text: str) -> str:
    found = facts(text)
    head = opening(text)
    if not found:
        return head
    return f"{head}\nfacts: " + " | ".join(found)


def complete_with_facts(summary: str, original: str) -> str:
    """`summary` with every fact of `original` it lacks appended: a model's summary
    may paraphrase, it may not lose a number or a path."""
    missing = [f for f in facts(original) if f not in summary]
    if not missing:
        return summary
    return f"{summary.rstrip()}\nfacts: " + " | ".join(missing)
