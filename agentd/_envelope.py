"""Parsing and building the universal envelope.

`parse_envelope` is the single entry for envelope bytes from anywhere: a client's
frame and a handler's re-entering output go through it alike. `build_envelope`
writes exclusive-C14N bytes directly from a template, so that what agentd emits is
canonical without a second serialisation pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from agentd._errors import HuhCode, Rejection
from agentd._schemas import NS_ENV, NS_PRIV, schema
from agentd._xml import DEFAULT_MAX_BYTES, escape_text, parse_untrusted

NIL_THREAD = "00000000-0000-0000-0000-000000000000"
_MESSAGE = "{" + NS_ENV + "}message"
_TO = "{" + NS_ENV + "}to"
_PRIV_PREFIX = "{" + NS_PRIV + "}"
_ENV_SCHEMA = schema(NS_ENV)


@dataclass(slots=True)
class Envelope:
    sender: str
    to: str | None
    thread: str
    payload: etree._Element

    @property
    def key(self) -> str:
        """The routing key: the payload's (namespace URI, local name), in Clark form."""
        return self.payload.tag


class PrivilegedOnBus(Rejection):
    """A payload in the privileged namespace reached the main bus."""

    def __init__(self) -> None:
        super().__init__(HuhCode.UNROUTABLE, "privileged namespace on the main bus")


def parse_envelope(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope:
    """Hardened parse + envelope validation. Raises `Rejection` with the huh code."""
    root = parse_untrusted(data, max_bytes=max_bytes)
    if root.tag != _MESSAGE or not _ENV_SCHEMA.validate(root):
        raise Rejection(HuhCode.INVALID_ENVELOPE, _first_error(root))
    meta = root[0]
    sender = meta[0].text.strip()
    if meta[1].tag == _TO:
        to: str | None = meta[1].text.strip()
        thread = meta[2].text
    else:
        to = None
        thread = meta[1].text
    payload = root[1]
    if isinstance(payload.tag, str) and payload.tag.startswith(_PRIV_PREFIX):
        raise PrivilegedOnBus()
    return Envelope(sender, to, thread, payload)


def _first_error(root: etree._Element) -> str:
    log = _ENV_SCHEMA.error_log
    if root.tag != _MESSAGE:
        return f"root element is {root.tag!r}"
    return str(log.last_error) if log.last_error else "invalid envelope"


def build_envelope(sender: str, thread: str, payload_c14n: bytes, to: str | None = None) -> bytes:
    """Envelope bytes in exclusive C14N form (payload must already be C14N)."""
    to_part = f"<to>{escape_text(to)}</to>" if to else ""
    head = (
        f'<message xmlns="{NS_ENV}"><meta><from>{escape_text(sender)}</from>{to_part}'
        f"<thread>{thread}</thread></meta>"
    ).encode()
    return head + payload_c14n + b"</message>"
