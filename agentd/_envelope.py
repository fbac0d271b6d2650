"""Parsing and building the universal envelope.

`parse_envelope` is the single entry for envelope bytes from anywhere: a client's
frame and a handler's re-entering output go through it alike. `build_envelope`
writes exclusive-C14N bytes directly from a template, so that what agentd emits is
canonical without a second serialisation pass.

Invariants of a parsed `Envelope`:
- nothing in it is in the privileged namespace, at any depth, element or attribute
  (`PrivilegedOnBus`, a security event for the caller to report);
- no element of the envelope itself carries an attribute (its schema declares
  none), so the schema validator never sees a tree whose errors grow with its
  attributes; a payload may, until it is validated: no payload schema declares
  an attribute either, and `payload_has_attributes` lets validation refuse them
  first, at the cost of one look;
- its shape is within the `ShapeLimits` it was parsed with, if any.

`parse_built_envelope` is the pump's cheaper entry for envelopes it built itself
around payload bytes a serializer wrote: agentd's own (an `@xmlify` object a handler
returned, a core payload) or lxml's C14N of an element the pump parsed out of a
handler's raw output. The same hardened parse, limits and privileged-namespace
check, and the same invariants, but instead of the envelope schema (which would
only re-check what the pump chose: sender, thread, the envelope's structure) it
checks what it did not choose, the `to` a handler named and the payload's
namespace. Bytes as a client or a handler wrote them never take it.

`adopt_envelope` is the same entry without the parse, for a payload element parsed
strictly out of a handler's raw output (or a peer's call, re-addressed): the bytes built
around that element's C14N are held to the same size, shape and privileged-
namespace checks, and the element is the tree a strict parse of them would give
(exclusive C14N of a strictly parsed element reads back as the same elements,
attributes and text; only namespace declarations nothing uses are dropped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lxml import etree

from agentd._errors import HuhCode, Rejection
from agentd._schemas import NS_ENV, NS_PRIV, schema
from agentd._xml import DEFAULT_MAX_BYTES, ShapeLimits, escape_text, parse_untrusted

NIL_THREAD = "00000000-0000-0000-0000-000000000000"
_THREAD_RE = re.compile(
    rb"<thread>\s*([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\s*</thread>"
)
_MESSAGE = "{" + NS_ENV + "}message"
_TO = "{" + NS_ENV + "}to"
_IN_ENV = "{" + NS_ENV + "}"
_XML_SPACE = " \t\r\n"
# The envelope schema's `name` type (sender and recipient).
_NAME = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}:)?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_ENV_SCHEMA = schema(NS_ENV)
# A namespace URI in the bytes may be spelled with character references, so only
# bytes holding neither the URI nor `&` are known to be free of it without a look
# (one byte: memchr, the cheapest scan there is).
_PRIV_URI = NS_PRIV.encode()
# Relative to the element asked (for a document's root: the whole document).
_HAS_PRIV = etree.XPath(
    "boolean(descendant-or-self::*[namespace-uri()=$ns]"
    " | descendant-or-self::*/@*[namespace-uri()=$ns])", smart_strings=False
)
# Attributes on the envelope's own elements: message, meta, from/to/thread.
_ENVELOPE_ATTRIBUTES = etree.XPath(
    "boolean(/*/@* | /*/*[1]/@* | /*/*[1]/*[namespace-uri()=$env]/@*)", smart_strings=False
)
_HAS_ATTRIBUTES = etree.XPath("boolean(descendant-or-self::*/@*)")
# Namespace declarations are the only `=` of a typical envelope, and an envelope
# needs two (its own namespace and its payload's): with no more `=` than that it
# has no attribute. Above `_FEW_DECLARATIONS` declarations, a count of `=` no longer
# tells declarations from attributes (text can say "xmlns"), so the tree is asked.
_LEAST_DECLARATIONS = 2
_FEW_DECLARATIONS = 8


@dataclass(slots=True)
class Envelope:
    sender: str
    to: str | None
    thread: str
    payload: etree._Element
    # The bytes may hold attributes besides namespace declarations (False: they do not).
    attributed: bool = False

    @property
    def key(self) -> str:
        """The routing key: the payload's (namespace URI, local name), in Clark form."""
        return self.payload.tag

    def payload_has_attributes(self) -> bool:
        return self.attributed and bool(_HAS_ATTRIBUTES(self.payload))


class PrivilegedOnBus(Rejection):
    """Something in the privileged namespace reached the main bus."""

    def __init__(self) -> None:
        super().__init__(HuhCode.UNROUTABLE, "privileged namespace on the main bus")


def parse_envelope(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, shape: ShapeLimits | None = None
) -> Envelope:
    """Hardened parse + envelope validation. Raises `Rejection` with the huh code.
    `shape`: the bus's bound on the envelope's shape; the pump passes it for every
    envelope that enters (a client's, a handler's output). Without it (an envelope
    read back from the journal, a client reading the daemon's frames) no shape is
    imposed, as no size is beyond `max_bytes`."""
    root = parse_untrusted(data, max_bytes=max_bytes, shape=shape)
    if (_PRIV_URI in data or b"&" in data) and _HAS_PRIV(root, ns=NS_PRIV):
        raise PrivilegedOnBus()
    if root.tag != _MESSAGE:
        raise Rejection(HuhCode.INVALID_ENVELOPE, f"root element is {root.tag!r}")
    attributed = may_have_attributes(data)
    if attributed and _ENVELOPE_ATTRIBUTES(root, env=NS_ENV):
        raise Rejection(HuhCode.INVALID_ENVELOPE, "attribute on an envelope element")
    if not _ENV_SCHEMA.validate(root):
        raise Rejection(HuhCode.INVALID_ENVELOPE, _first_error(), _no_namespace(root))
    sender, to, thread = _addressing(root)
    return Envelope(sender, to, thread, root[1], attributed)


def parse_built_envelope(
    data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, shape: ShapeLimits | None = None
) -> Envelope:
    """`parse_envelope` for bytes `build_envelope` wrote here around a serializer's
    payload (see the module's docstring). Raises `Rejection`."""
    root = parse_untrusted(data, max_bytes=max_bytes, shape=shape)
    _refuse_privileged(data, root)
    sender, to, thread = _addressing(root)
    return _built(data, root[1] if len(root) == 2 else None, sender, to, thread)


def adopt_envelope(
    data: bytes, payload: etree._Element, sender: str, to: str | None, thread: str, *,
    max_bytes: int = DEFAULT_MAX_BYTES, shape: ShapeLimits | None = None,
) -> Envelope:
    """`parse_built_envelope` of `data`, which `build_envelope(sender, thread,
    c14n(payload), to)` wrote around `payload`, an element parsed strictly (without
    repair) out of a handler's output or a peer's call: the same checks in the same
    order, the same
    `Envelope` or the same refusal, without parsing `data` again."""
    if len(data) > max_bytes:
        raise Rejection(HuhCode.TOO_LARGE, f"{len(data)} bytes > {max_bytes}")
    # C14N may move namespace declarations down to the elements that use them: the
    # shape is the built bytes', as a parse of them would see it.
    if shape is not None and shape.check_bytes(data, data.count(b"<")):
        shape.check_tree(payload)
    _refuse_privileged(data, payload)
    # What a parse would read back from the `<to>` that `build_envelope` wrote.
    return _built(data, payload, sender, to.strip(_XML_SPACE) if to else None, thread)


def _refuse_privileged(data: bytes, element: etree._Element) -> None:
    if (_PRIV_URI in data or b"&" in data) and _HAS_PRIV(element, ns=NS_PRIV):
        raise PrivilegedOnBus()


def _built(data: bytes, payload: etree._Element | None, sender: str, to: str | None,
           thread: str) -> Envelope:
    """The checks of what the pump did not choose in an envelope it built: the `to` a
    handler named and the payload's namespace."""
    if to is not None and not _NAME.fullmatch(to):
        raise Rejection(HuhCode.INVALID_ENVELOPE, "recipient is not a listener name")
    if payload is None or payload.tag[:1] != "{" or payload.tag.startswith(_IN_ENV):
        raise Rejection(HuhCode.INVALID_ENVELOPE, "payload is not one element of its own namespace")
    return Envelope(sender, to, thread, payload, may_have_attributes(data))


def _addressing(root: etree._Element) -> tuple[str, str | None, str]:
    """(from, to, thread) of a message's meta; names with the XML whitespace around
    them removed, as the schema's xs:token reads them."""
    meta = root[0]
    sender = (meta[0].text or "").strip(_XML_SPACE)
    if meta[1].tag == _TO:
        return sender, (meta[1].text or "").strip(_XML_SPACE), meta[2].text or ""
    return sender, None, meta[1].text or ""


def thread_hint(data: bytes) -> str:
    """The thread an envelope names, read before (or without) a parse: the first
    `<thread>` holding a canonical UUID in its first 4 KiB, else the nil thread. The
    bus counts a frame in flight under it, and a refusal of bytes that never became
    an `Envelope` is answered on it, so a client can tell its refusals apart."""
    m = _THREAD_RE.search(data, 0, 4096)
    return m.group(1).decode() if m else NIL_THREAD


def may_have_attributes(data: bytes) -> bool:
    """False if the bytes hold no attribute besides namespace declarations."""
    equals = data.count(b"=")
    if equals <= _LEAST_DECLARATIONS:
        return False
    declarations = data.count(b"xmlns")
    return equals > declarations or declarations > _FEW_DECLARATIONS


def _no_namespace(root: etree._Element) -> str | None:
    """What a client is told when its payload has no namespace of its own (written
    without `xmlns`, it inherits the envelope's or has none): the most common
    mistake of a hand-written envelope, named; None for any other invalid one."""
    last = root[-1] if len(root) else None
    if last is None or not isinstance(last.tag, str) or len(root) < 2:
        return None
    if last.tag[:1] == "{" and not last.tag.startswith(_IN_ENV):
        return None
    local = last.tag.rsplit("}", 1)[-1]
    return (f"The envelope is not valid: its payload <{local}> has no namespace of its "
            "own; give it the listener's (xmlns=\"...\").")


def _first_error() -> str:
    log = _ENV_SCHEMA.error_log
    return str(log.last_error) if log.last_error else "invalid envelope"


# The bytes of an envelope up to its thread, by (from, to): the same for every
# message between two parties. Cleared when full (names are few; clients bounded).
_HEADS: dict[tuple[str, str | None], bytes] = {}
_MAX_HEADS = 4096


def build_envelope(sender: str, thread: str, payload_c14n: bytes, to: str | None = None) -> bytes:
    """Envelope bytes in exclusive C14N form (payload must already be C14N)."""
    head = _HEADS.get((sender, to))
    if head is None:
        to_part = f"<to>{escape_text(to)}</to>" if to else ""
        head = (f'<message xmlns="{NS_ENV}"><meta><from>{escape_text(sender)}</from>'
                f"{to_part}<thread>").encode()
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[sender, to] = head
    return b"".join((head, thread.encode(), b"</thread></meta>", payload_c14n, b"</message>"))
