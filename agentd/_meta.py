"""Meta introspection on the main bus (seed: Introspection (Meta)).

A client may ask, in the `core` namespace, what its own profile can reach: the list
of capabilities, and a capability's schema or example. Each kind of question is
off unless its `meta.allow_*` flag is set; a disabled question, and a question
about a listener outside the client's profile, get the same `huh unroutable` as a
route that does not exist. Prompts are never given out here.
"""

from __future__ import annotations

from lxml import etree

from agentd._errors import HuhCode, Rejection
from agentd._routing import Profile
from agentd._schemas import NS_CORE
from agentd._xml import escape_text
from agentd.config import MetaConfig

_C = "{" + NS_CORE + "}"
LIST, SCHEMA, EXAMPLE = _C + "list-capabilities", _C + "request-schema", _C + "request-example"
QUESTIONS = frozenset({LIST, SCHEMA, EXAMPLE})


def answer(flags: MetaConfig, profile: Profile, question: etree._Element) -> bytes:
    """The core payload answering `question` (already valid against core.xsd), as
    C14N bytes; `Rejection(unroutable)` when it may not be answered."""
    tag = question.tag
    table = profile.table
    if tag == LIST and flags.allow_list_capabilities:
        parts = [f'<capabilities xmlns="{NS_CORE}">']
        for name in sorted(table.listeners):
            if table.listeners[name].retired:
                continue
            listed = table.listeners[name]
            parts.append(
                f"<capability><name>{name}</name>"
                f"<description>{escape_text(listed.description)}</description>"
            )
            parts.extend(f"<payload>{escape_text(s.clark)}</payload>" for s in listed.payload_specs)
            parts.append("</capability>")
        parts.append("</capabilities>")
        return "".join(parts).encode()
    if tag in (SCHEMA, EXAMPLE):
        allowed = flags.allow_schema_requests if tag == SCHEMA else flags.allow_example_requests
        name = (question[0].text or "").strip()
        lst = table.listeners.get(name)
        if allowed and lst is not None and not lst.retired:
            if tag == SCHEMA:
                items = "".join(f"<xsd>{escape_text(s.xsd)}</xsd>" for s in lst.payload_specs)
                return f'<schema xmlns="{NS_CORE}"><name>{name}</name>{items}</schema>'.encode()
            items = "".join(
                f"<xml>{escape_text(s.example.decode())}</xml>" for s in lst.payload_specs
            )
            return f'<example xmlns="{NS_CORE}"><name>{name}</name>{items}</example>'.encode()
    raise Rejection(HuhCode.UNROUTABLE, f"meta question {tag} not allowed")
