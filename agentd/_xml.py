"""Hardened XML parsing and exclusive C14N.

Every byte string that comes from outside the trusted zone (a client frame, a
handler's raw output, an LLM reply) is parsed here and nowhere else. The parser
never loads a DTD, never expands an entity, never touches the network, and the
input is bounded in size and shape before libxml2 sees it and in depth after. A
DOCTYPE is refused outright: there is no legitimate use for one on this bus.

The shape bound (`ShapeLimits`: attributes on one element, elements in one document)
is checked on the bytes, before the parse: libxml2 spends time quadratic in the
attributes of one element (duplicate checks) and a schema validator reports one
error per bad attribute, so a document of many attributes or elements must be
refused before either sees it. Every check here is a scan of the bytes or of the
tree in C, linear in the input.

Repair (`recover=True`) exists only for handler and LLM output, never for client
envelopes: a client is told its XML is malformed; a model's sloppy output is given a
second chance before it is validated like anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
        # Bytes are UTF-8, whatever the document declares: every check made on the raw
        # bytes before the parse (DOCTYPE, shape, depth, privileged namespace) must see
        # what libxml2 parses. A declared UTF-7 or EBCDIC would hide all of it.
        encoding="utf-8",
    )


@dataclass(frozen=True, slots=True)
class ShapeLimits:
    """The most attributes on one element (namespace declarations count: they are
    attributes to the parser) and the most elements in one document."""

    max_attributes: int = 64
    max_elements: int = 10_000
    # A start tag with more than `max_attributes` attributes. Each repetition can
    # match one way only (a quoted value cannot hold its quote, a name stops at `=`),
    # and no match crosses a `<` outside a value, so a search is linear in the bytes.
    _crowded_tag: re.Pattern[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = rb"""<[^\s<>/!?]+(?:\s+[^\s<>=/]+\s*=\s*(?:"[^"]*"|'[^']*')){%d}""" % (
            self.max_attributes + 1
        )
        object.__setattr__(self, "_crowded_tag", re.compile(pattern))

    def check_bytes(self, data: bytes, tags: int) -> bool:
        """Refuse `data` (raise `Rejection` too-large) if its bytes show too many
        attributes on one element or too many elements. `tags` is the count of `<`.
        Returns True when the element count must still be checked on the tree: the
        bytes hold comments or CDATA, whose text may contain `<`."""
        # Each attribute takes at least 5 bytes (` a=""`): short input needs no count.
        if (
            len(data) > 5 * self.max_attributes
            and data.count(b"=") > self.max_attributes
            and self._crowded_tag.search(data)
        ):
            raise Rejection(HuhCode.TOO_LARGE, f"more than {self.max_attributes} attributes")
        if tags <= self.max_elements:
            return False
        starts = tags - data.count(b"</") - data.count(b"<?")
        if starts <= self.max_elements:
            return False
        if b"<!" in data:
            return True
        raise Rejection(HuhCode.TOO_LARGE, f"more than {self.max_elements} elements")

    def check_tree(self, root: etree._Element) -> None:
        if int(_COUNT_ELEMENTS(root)) > self.max_elements:
            raise Rejection(HuhCode.TOO_LARGE, f"more than {self.max_elements} elements")


DEFAULT_SHAPE = ShapeLimits()

_STRICT = _make_parser(recover=False)
_RECOVER = _make_parser(recover=True)

# True when an element exists at depth MAX_DEPTH + 1; evaluated in C.
_TOO_DEEP = etree.XPath("boolean(/" + "/*" * (MAX_DEPTH + 1) + ")")
_COUNT_ELEMENTS = etree.XPath("count(//*)")


def parse_untrusted(
    data: bytes,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    shape: ShapeLimits | None = None,
    repair: bool = False,
) -> etree._Element:
    """Parse hostile bytes into an element tree, or raise `Rejection`.

    Cost before rejection is O(len(data)) with a small constant: the size check, the
    shape check (when `shape` is given: envelopes have one, an operator's journal
    does not) and the DOCTYPE scan happen before libxml2 builds anything.
    """
    if len(data) > max_bytes:
        raise Rejection(HuhCode.TOO_LARGE, f"{len(data)} bytes > {max_bytes}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise Rejection(HuhCode.MALFORMED, "DOCTYPE or entity declaration")
    if b"\x00" in data:
        # NUL is never legal in XML 1.0; it also rules out UTF-16/32, whose
        # encodings would hide a DOCTYPE from the byte scan above.
        raise Rejection(HuhCode.MALFORMED, "NUL byte (only UTF-8 is accepted)")
    tags = data.count(b"<")
    count_on_tree = shape is not None and shape.check_bytes(data, tags)  # before the parse
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
    if tags > MAX_DEPTH and _TOO_DEEP(root):
        raise Rejection(HuhCode.MALFORMED, f"nesting deeper than {MAX_DEPTH}")
    if count_on_tree:
        assert shape is not None
        shape.check_tree(root)
    return root


def c14n(element: etree._Element) -> bytes:
    """Exclusive C14N 1.0 without comments, of `element` and its subtree. Raises
    `Rejection` (invalid-payload) for a tree that has no canonical form (a relative
    namespace URI, which a handler's or a model's output may carry)."""
    try:
        return etree.tostring(element, method="c14n", exclusive=True, with_comments=False)
    except etree.C14NError as exc:
        raise Rejection(HuhCode.INVALID_PAYLOAD, f"no canonical form: {exc}") from None


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
