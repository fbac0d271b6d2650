"""How a tool carries bytes in XML: as UTF-8 text when XML can hold them exactly,
else as base64. XML 1.0 cannot carry NUL and most C0 controls, and turns a carriage
return into a newline on parse, so text with any of them travels as base64."""

from __future__ import annotations

import base64
from enum import Enum

from agentd._xmlify import ILLEGAL_XML_CHAR


class Encoding(Enum):
    UTF8 = "utf-8"
    BASE64 = "base64"


def as_base64(data: bytes) -> tuple[Encoding, str]:
    return Encoding.BASE64, base64.b64encode(data).decode("ascii")


def as_xml_text(data: bytes) -> tuple[Encoding, str]:
    """`data` as text if it is UTF-8 that XML gives back byte for byte, else base64."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return as_base64(data)
    if ILLEGAL_XML_CHAR.search(text) or "\r" in text:
        return as_base64(data)
    return Encoding.UTF8, text


def xml_safe(text: str) -> str:
    """Text with the characters XML cannot carry replaced by U+FFFD."""
    return ILLEGAL_XML_CHAR.sub("\ufffd", text)
