"""Hostile XML is refused by the hardened parser before it can cost anything, and
canonicalisation makes equivalent envelopes identical."""

from __future__ import annotations

import base64
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._xml import MAX_DEPTH, c14n, parse_untrusted

ENV = "https://xml-pipeline.org/ns/envelope/v1"
BIG = 20 * 1024 * 1024

BILLION_LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol9 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
]>
<lolz>&lol9;</lolz>"""

QUADRATIC = (
    b'<?xml version="1.0"?><!DOCTYPE k [<!ENTITY a "'
    + b"x" * 50_000
    + b'">]><k>'
    + b"&a;" * 50_000
    + b"</k>"
)

XXE = b"""<?xml version="1.0"?>
<!DOCTYPE r [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<r>&xxe;</r>"""

EXTERNAL_DTD = b'<?xml version="1.0"?><!DOCTYPE r SYSTEM "http://127.0.0.1:1/evil.dtd"><r/>'


def code_of(data: bytes, **kw: object) -> HuhCode:
    with pytest.raises(Rejection) as info:
        parse_untrusted(data, **kw)  # type: ignore[arg-type]
    return info.value.code


@pytest.mark.parametrize(
    "data",
    [BILLION_LAUGHS, XXE, EXTERNAL_DTD, b"<!DOCTYPE x><x/>"],
    ids=["billion-laughs", "external-entity", "external-dtd", "bare-doctype"],
)
def test_any_doctype_is_rejected(data: bytes) -> None:
    assert code_of(data) is HuhCode.MALFORMED


def test_quadratic_blowup_is_rejected() -> None:
    assert code_of(QUADRATIC) is HuhCode.MALFORMED
    # Larger variants are refused on size alone, before libxml2 sees a byte.
    assert code_of(QUADRATIC, max_bytes=len(QUADRATIC) - 1) is HuhCode.TOO_LARGE


def test_entity_declaration_hidden_in_utf16_is_rejected() -> None:
    assert code_of(XXE.decode().encode("utf-16")) is HuhCode.MALFORMED


def utf7(document: str) -> bytes:
    """`document` in UTF-7, declared: no `<`, `&`, `=` or namespace URI in its bytes
    past the declaration (only the declaration and base64)."""
    body = base64.b64encode(document.encode("utf-16-be")).rstrip(b"=")
    return b'<?xml version="1.0" encoding="UTF-7"?>+' + body + b"-"


PRIV = "https://xml-pipeline.org/ns/privileged/v1"


@pytest.mark.parametrize("document", [
    XXE.decode().split("?>", 1)[1],  # a DOCTYPE the byte scan cannot see
    "<a>" * (MAX_DEPTH + 20) + "</a>" * (MAX_DEPTH + 20),  # nor this depth
    f'<message xmlns="{ENV}"><meta><from>alice</from><thread>{uuid.uuid4()}</thread>'
    f'<p:privileged xmlns:p="{PRIV}"><p:key-id>ops</p:key-id></p:privileged></meta>'
    '<add xmlns="urn:t"><a>1</a></add></message>',  # nor a privileged element
])
def test_a_declared_encoding_other_than_utf8_cannot_hide_content(document: str) -> None:
    """Every check on the raw bytes must see what libxml2 parses: the bytes are read
    as UTF-8 whatever the declaration says, so UTF-7 (or EBCDIC) content is text
    outside any element and the document is malformed."""
    assert code_of(utf7(document)) is HuhCode.MALFORMED
    assert code_of(document.encode("cp037")) is HuhCode.MALFORMED
    with pytest.raises(Rejection):
        parse_envelope(utf7(document))


def test_a_declaration_naming_another_encoding_reads_the_bytes_as_utf8() -> None:
    """Harmless declarations still parse; the text is decoded as UTF-8."""
    root = parse_untrusted('<?xml version="1.0" encoding="ISO-8859-1"?><a>\u00e9</a>'
                           .encode())
    assert root.text == "\u00e9"


def test_depth_ten_thousand_is_rejected() -> None:
    deep = b"<a>" * 10_000 + b"</a>" * 10_000
    assert code_of(deep, max_bytes=len(deep)) is HuhCode.MALFORMED


def test_depth_just_over_the_limit_is_rejected_and_at_the_limit_accepted() -> None:
    ok = b"<a>" * MAX_DEPTH + b"</a>" * MAX_DEPTH
    parse_untrusted(ok)
    over = b"<a>" * (MAX_DEPTH + 1) + b"</a>" * (MAX_DEPTH + 1)
    assert code_of(over) is HuhCode.MALFORMED


def test_twenty_mib_text_is_rejected_as_too_large() -> None:
    assert code_of(b"<a>" + b"x" * BIG + b"</a>") is HuhCode.TOO_LARGE


def test_twenty_mib_attribute_is_rejected_as_too_large() -> None:
    assert code_of(b'<a b="' + b"x" * BIG + b'"/>') is HuhCode.TOO_LARGE


def test_malformed_and_empty_input_are_malformed() -> None:
    assert code_of(b"<a><b></a>") is HuhCode.MALFORMED
    assert code_of(b"") is HuhCode.MALFORMED
    assert code_of(b"\x00<a/>") is HuhCode.MALFORMED


def test_repair_is_opt_in() -> None:
    assert code_of(b"<a><b>1</a>") is HuhCode.MALFORMED
    assert parse_untrusted(b"<a><b>1</a>", repair=True).tag == "a"


def test_repair_never_enables_entities() -> None:
    assert code_of(XXE, repair=True) is HuhCode.MALFORMED


def test_oversize_envelope_is_too_large() -> None:
    with pytest.raises(Rejection) as info:
        parse_envelope(b"<message>" + b" " * (256 * 1024) + b"</message>")
    assert info.value.code is HuhCode.TOO_LARGE


# ---- canonicalisation ----------------------------------------------------------


def _variant(thread: str, prefix: str, ws: list[str], attr_order: bool) -> bytes:
    p = f"{prefix}:" if prefix else ""
    decl = f' xmlns:{prefix}="{ENV}"' if prefix else f' xmlns="{ENV}"'
    attrs = ['q:y="2"', 'q:x="1"'] if attr_order else ['q:x="1"', 'q:y="2"']
    return (
        f"<{p}message{decl}>{ws[0]}<{p}meta>{ws[1]}<{p}from>alice</{p}from>{ws[2]}"
        f"<{p}thread>{thread}</{p}thread>{ws[3]}</{p}meta>{ws[4]}"
        f'<add xmlns="urn:t" xmlns:q="urn:q" {" ".join(attrs)}><a>1</a></add>{ws[5]}'
        f"</{p}message>"
    ).encode()


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.sampled_from(["", "e", "env", "x1"]),
    ws=st.lists(st.sampled_from(["", " ", "\n", "\t  \n"]), min_size=6, max_size=6),
    attr_order=st.booleans(),
)
def test_equivalent_envelopes_canonicalise_identically(
    prefix: str, ws: list[str], attr_order: bool
) -> None:
    thread = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"
    reference = parse_envelope(_variant(thread, "", [""] * 6, False))
    env = parse_envelope(_variant(thread, prefix, ws, attr_order))
    assert (env.sender, env.to, env.thread, env.key) == (
        reference.sender,
        reference.to,
        reference.thread,
        reference.key,
    )
    assert c14n(env.payload) == c14n(reference.payload)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=50))
def test_built_envelopes_are_already_canonical(text: str) -> None:
    from agentd._core import Answer

    clean = "".join(
        ch for ch in text if ch in "\t\n\r" or (ord(ch) >= 0x20 and ch not in "\ufffe\uffff")
    )
    data = build_envelope("core", str(uuid.uuid4()), Answer(clean).to_bytes(), to="alice")
    assert c14n(parse_untrusted(data)) == data
