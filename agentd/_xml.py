"""Hardened XML parsing and exclusive C14N.

Every byte string that comes from outside the trusted zone (a client frame, a
handler's raw output, an LLM reply) is parsed here and nowhere else. The parser
never loads a DTD, never expands an entity, never touches the network, and the
input is bounded in size before libxml2 sees it and in depth after. A DOCTYPE is
refused outright: there is no legitimate use for one on this bus.

Repair (`recover=True`) exists only for handler and LLM output, never for client
envelopes: a client is told its XML is malformed; a model's sloppy output is given a
second chance before it is validated like anything else.
"""

from __future__ import annotations

from lxml import etree

from agentd._errors import HuhCode, Rejection

MAX_DEPTH = 64
DEFAULT_MAX_BYTES = 256 * 1024


def _make_parser(recover: bool) -> etree.XMLParser:
    return etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        remove_comments=True,
        remove_pis=True,
        collect_ids=False,
        recover=recover,
    )


_STRICT = _make_parser(recover=False)
_RECOVER = _make_parser(recover=True)

# True when an element exists at depth MAX_DEPTH + 1; evaluated in C.
_TOO_DEEP = etree.XPath("boolean(/" + "/*" * (MAX_DEPTH + 1) + ")")


def parse_untrusted(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, repair: bool = False
) -> etree._Element:
    """Parse hostile bytes into an element tree, or raise `Rejection`.

    Cost before rejection is O(len(data)) with a small constant: the size check and
    the DOCTYPE scan happen before libxml2 builds anything.
    """
    if len(data) > max_bytes:
        raise Rejection(HuhCode.TOO_LARGE, f"{len(data)} bytes > {max_bytes}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise Rejection(HuhCode.MALFORMED, "DOCTYPE or entity declaration")
    if b"\x00" in data:
        # NUL is never legal in XML 1.0; it also rules out UTF-16/32, whose
        # encodings would hide a DOCTYPE from the byte scan above.
        raise Rejection(HuhCode.MALFORMED, "NUL byte (only UTF-8 is accepted)")
    try:
        root = etree.fromstring(data, _RECOVER if repair else _STRICT)
    except etree.XMLSyntaxError as exc:
        raise Rejection(HuhCode.MALFORMED, str(exc)) from None
    except ValueError as exc:  # e.g. unicode strings with encoding declaration
        raise Rejection(HuhCode.MALFORMED, str(exc)) from None
    if root is None:
        raise Rejection(HuhCode.MALFORMED, "empty document")
    docinfo = root.getroottree().docinfo
    if docinfo.doctype or docinfo.internalDTD is not None:
        raise Rejection(HuhCode.MALFORMED, "DOCTYPE")
    # A document with at most MAX_DEPTH tags cannot nest deeper; skip the walk then.
    if data.count(b"<") > MAX_DEPTH and _TOO_DEEP(root):
        raise Rejection(HuhCode.MALFORMED, f"nesting deeper than {MAX_DEPTH}")
    return root


def c14n(element: etree._Element) -> bytes:
    """Exclusive C14N 1.0 without comments, of `element` and its subtree."""
    return etree.tostring(element, method="c14n", exclusive=True, with_comments=False)


def escape_text(value: str) -> str:
    """Escape character data exactly as C14N does (so templates emit C14N form)."""
    if "&" in value:
        value = value.replace("&", "&amp;")
    if "<" in value:
        value = value.replace("<", "&lt;")
    if ">" in value:
        value = value.replace(">", "&gt;")
    if "\r" in value:
        value = value.replace("\r", "&#xD;")
    return value
