"""The trust boundary under hostile input: the privileged namespace at any depth,
the shape of an envelope bounded before it is parsed, and rejection that costs what
the bytes cost, not what their shape would cost a validator."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest

from agentd._envelope import PrivilegedOnBus, build_envelope, parse_envelope
from agentd._errors import HuhCode, Rejection
from agentd._xml import DEFAULT_SHAPE, ShapeLimits, parse_untrusted
from agentd._xmlify import spec_of
from agentd.client import frame_kind
from agentd.config import load_config
from agentd.pump import admission
from agentd.testing import Harness
from agentd.tools.calculator import Add

ORGANISM = Path(__file__).parent / "organisms" / "basic.yaml"
PRIV = "https://xml-pipeline.org/ns/privileged/v1"
ENV = "https://xml-pipeline.org/ns/envelope/v1"
ADD_NS = "https://xml-pipeline.org/ns/calculator/add/v1"
ADD = f'<add xmlns="{ADD_NS}"><a>2</a><b>3</b></add>'
THREAD = "6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f"


def message(payload: str, extensions: str = "", meta_attrs: str = "") -> bytes:
    return (
        f'<message xmlns="{ENV}"><meta{meta_attrs}><from>alice</from>'
        f"<thread>{THREAD}</thread>{extensions}</meta>{payload}</message>"
    ).encode()


def code_of(data: bytes, shape: ShapeLimits = DEFAULT_SHAPE) -> HuhCode | None:
    try:
        parse_envelope(data, shape=shape)
    except Rejection as rej:
        return rej.code
    return None


# ---- the privileged namespace, anywhere ---------------------------------------------

PRIV_PLACES = {
    "meta extension": message(ADD, extensions=f'<x xmlns="{PRIV}"/>'),
    "inside a meta extension": message(
        ADD, extensions=f'<ext xmlns="urn:ext"><deep><p:x xmlns:p="{PRIV}"/></deep></ext>'
    ),
    "payload child": message(f'<add xmlns="{ADD_NS}"><a>2</a><p:b xmlns:p="{PRIV}">3</p:b></add>'),
    "deep in the payload": message(
        f'<add xmlns="{ADD_NS}"><a>2<i><i><i><p:command xmlns:p="{PRIV}"/></i></i></i></a></add>'
    ),
    "attribute in the payload": message(
        f'<add xmlns="{ADD_NS}" xmlns:p="{PRIV}"><a p:name="x">2</a><b>3</b></add>'
    ),
    "attribute in a meta extension": message(
        ADD, extensions=f'<ext xmlns="urn:ext" xmlns:p="{PRIV}" p:key="ops-1"/>'
    ),
    "namespace spelled with character references": message(
        ADD,
        extensions='<x xmlns="https&#x3a;//xml-pipeline.org/ns/privileged&#x2f;v1"/>',
    ),
    "the payload itself": message(f'<privileged xmlns="{PRIV}"><x/></privileged>'),
}


@pytest.mark.parametrize("place", PRIV_PLACES)
def test_privileged_namespace_anywhere_is_refused(place: str) -> None:
    with pytest.raises(PrivilegedOnBus) as exc:
        parse_envelope(PRIV_PLACES[place])
    assert exc.value.code is HuhCode.UNROUTABLE


def test_privileged_uri_as_text_is_only_text() -> None:
    data = message(ADD, extensions=f'<note xmlns="urn:ext">{PRIV}</note>')
    assert parse_envelope(data).key == "{" + ADD_NS + "}add"


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, str]]] = []

    def __call__(self, kind: str, fields: Mapping[str, str]) -> None:
        self.events.append((kind, dict(fields)))


async def test_privileged_meta_extension_is_dropped_journaled_and_answered_unroutable() -> None:
    seen = Recorder()
    async with Harness.from_config(ORGANISM, clients={"alice": "public"}, on_security=seen) as h:
        thread = str(uuid.uuid4())
        data = build_envelope("alice", thread, ADD.encode())
        data = data.replace(b"</thread></meta>", f'</thread><x xmlns="{PRIV}"/></meta>'.encode())
        frames = await h.send("alice", data)
        assert [frame_kind(f)[:2] for f in frames] == [("core", "huh")]
        assert parse_envelope(frames[0]).payload[0].text == "unroutable"
        assert seen.events == [("priv-on-bus", {"client": "alice"})]
        assert h.pump.registry.get(thread) is None  # nothing of it was kept


# ---- the shape, bounded before the parse --------------------------------------------


def attributes(n: int, prefix: str = "a") -> str:
    return " ".join(f'{prefix}{i}="1"' for i in range(n))


def test_too_many_attributes_on_one_element_is_too_large() -> None:
    limits = ShapeLimits(max_attributes=8)  # the payload's xmlns is one of them
    fits = code_of(message(f'<add xmlns="{ADD_NS}" {attributes(7)}/>'), limits)
    assert fits is None
    over = code_of(message(f'<add xmlns="{ADD_NS}" {attributes(8)}/>'), limits)
    assert over is HuhCode.TOO_LARGE


def test_namespace_declarations_count_as_attributes() -> None:
    decls = " ".join(f'xmlns:n{i}="urn:{i}"' for i in range(70))
    assert code_of(message(f'<add xmlns="{ADD_NS}" {decls}/>')) is HuhCode.TOO_LARGE


def test_equals_signs_in_values_are_not_attributes() -> None:
    data = message(f'<add xmlns="{ADD_NS}"><a>{"=" * 500}</a><b>3</b></add>')
    assert code_of(data) is None
    value = "=" * 100
    assert code_of(message(ADD, extensions=f'<e xmlns="urn:e" v="{value}" w="a>b"/>')) is None


def test_too_many_elements_is_too_large() -> None:
    limits = ShapeLimits(max_elements=100)
    # message, meta, from, thread, add: 5 of the envelope's own.
    fits = message(f'<add xmlns="{ADD_NS}">' + "<e/>" * 95 + "</add>")
    over = message(f'<add xmlns="{ADD_NS}">' + "<e/>" * 96 + "</add>")
    assert code_of(fits, limits) is HuhCode.INVALID_ENVELOPE or code_of(fits, limits) is None
    assert code_of(over, limits) is HuhCode.TOO_LARGE


def test_tags_inside_comments_and_cdata_are_not_elements() -> None:
    limits = ShapeLimits(max_elements=10)
    text = "<![CDATA[" + "<e/>" * 50 + "]]><!--" + "<e/>" * 50 + "-->"
    assert code_of(message(f'<add xmlns="{ADD_NS}"><a>{text}</a><b>3</b></add>'), limits) is None
    over = message(f'<add xmlns="{ADD_NS}"><!-- x -->' + "<e/>" * 20 + "</add>")
    assert code_of(over, limits) is HuhCode.TOO_LARGE


def test_a_document_without_a_shape_is_not_held_to_one() -> None:
    # The operator's channel carries journals of any number of entries; an envelope
    # read back from the journal was admitted under the limits of its day.
    data = b"<r>" + b"<e/>" * 20_000 + b"</r>"
    assert len(parse_untrusted(data, max_bytes=1 << 20)) == 20_000
    big = message(f'<add xmlns="{ADD_NS}">' + "<e/>" * 20_000 + "</add>")
    assert len(parse_envelope(big, max_bytes=1 << 20).payload) == 20_000


def test_attributes_on_envelope_elements_are_refused_before_validation() -> None:
    assert code_of(message(ADD, meta_attrs=' a="1"')) is HuhCode.INVALID_ENVELOPE
    many = " " + attributes(60)
    assert code_of(message(ADD, meta_attrs=many)) is HuhCode.INVALID_ENVELOPE


def test_attributes_in_the_payload_are_found_before_validation() -> None:
    assert parse_envelope(message(f'<add xmlns="{ADD_NS}"><a k="v">2</a></add>'))\
        .payload_has_attributes()
    assert not parse_envelope(message(ADD)).payload_has_attributes()
    text = message(f'<add xmlns="{ADD_NS}"><a>x = 1</a></add>')
    assert not parse_envelope(text).payload_has_attributes()


def test_attributes_hidden_behind_namespace_words_are_still_found() -> None:
    words = "xmlns " * 20
    data = message(f'<add xmlns="{ADD_NS}"><a k="v">{words}</a><b>3</b></add>')
    assert parse_envelope(data).payload_has_attributes()


async def test_a_payload_with_thousands_of_attributes_is_refused_at_one_error() -> None:
    spread = "".join(f"<a {attributes(60)}>2</a>" for _ in range(330))
    data = build_envelope("alice", str(uuid.uuid4()),
                          f'<add xmlns="{ADD_NS}">{spread}<b>3</b></add>'.encode())
    assert len(data) > 150_000  # 19,800 attributes
    async with Harness.from_config(ORGANISM, clients={"alice": "public"}) as h:
        frames = await h.send("alice", data)
    assert parse_envelope(frames[0]).payload[0].text == "invalid-payload"


def test_payload_attributes_are_refused_before_the_schema_validator_runs() -> None:
    env = parse_envelope(message(f'<add xmlns="{ADD_NS}" {attributes(60)}><a>2</a><b>3</b></add>'))
    with pytest.raises(Rejection) as exc:
        admission.validate(spec_of(Add), env)
    assert exc.value.code is HuhCode.INVALID_PAYLOAD
    assert exc.value.detail == "attributes are not allowed in a payload"


async def test_configured_shape_limits_reach_the_pump(tmp_path: Path) -> None:
    text = ORGANISM.read_text()
    config_file = tmp_path / "organism.yaml"
    config_file.write_text(text)
    config = load_config(config_file)
    bus = type(config.bus)(max_attributes=2, max_elements=8)
    config = type(config)(**{**config.__dict__, "bus": bus})
    async with Harness(config, clients={"alice": "public"}) as h:
        ok = await h.send("alice", build_envelope("alice", str(uuid.uuid4()), ADD.encode()))
        assert frame_kind(ok[0])[1] == "accepted"
        big = f'<add xmlns="{ADD_NS}"><a>2</a><b>3</b>' + "<e/>" * 4 + "</add>"
        frames = await h.send("alice", build_envelope("alice", str(uuid.uuid4()), big.encode()))
        assert parse_envelope(frames[0]).payload[0].text == "too-large"


# ---- what a rejection costs -----------------------------------------------------------


def test_twenty_thousand_attributes_are_refused_on_the_bytes_before_any_parse() -> None:
    # Was 34-36 ms: libxml2 parsed every attribute and the validator reported each.
    # The time it takes now is measured by benchmarks/hostile.py; here, where it is
    # refused: by the byte scan, which is linear in the bytes, before libxml2 runs.
    hostile = message(f'<add xmlns="{ADD_NS}" {attributes(20_000)}/>')
    assert code_of(hostile) is HuhCode.TOO_LARGE
    assert len(hostile) > 180_000
    with pytest.raises(Rejection) as refused:
        DEFAULT_SHAPE.check_bytes(hostile, hostile.count(b"<"))
    assert refused.value.code is HuhCode.TOO_LARGE
