"""The JSON Schema -> payload class mapping, pure: no server, no sockets."""

from __future__ import annotations

import pytest

from agentd._errors import ValidationError
from agentd._xmlify import from_xml, spec_of, to_xml
from agentd.mcp.schema import Unmappable, arguments_of, payload_class, result_class

SCHEMA = {
    "type": "object",
    "description": "Search the notes.",
    "properties": {
        "query": {"type": "string", "description": "what to look for"},
        "limit": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "order": {"enum": ["newest", "oldest"]},
        "filter": {"type": "object", "properties": {"done": {"type": "boolean"}},
                   "required": ["done"]},
        "score": {"type": ["number", "null"]},
    },
    "required": ["query", "order"],
}
NS = "https://xml-pipeline.org/ns/mcp/notes/search/v1"


def test_objects_map_to_elements_in_property_order_with_required_mandatory() -> None:
    cls = payload_class("notes", "search", SCHEMA)
    spec = spec_of(cls)
    assert spec.namespace == NS and spec.tag == "search"
    assert [f.name for f in spec.fields] == list(SCHEMA["properties"])  # type: ignore[call-overload]
    assert {f.name for f in spec.fields if f.min_occurs} == {"query", "order"}
    assert "what to look for" in spec.prompt and "Search the notes." in spec.prompt
    from_xml(cls, spec.example)  # the example is valid


def test_the_payload_converts_back_to_the_json_arguments() -> None:
    cls = payload_class("notes", "search", SCHEMA)
    xml = (f'<search xmlns="{NS}"><query>a &lt; b</query><tags>x</tags><tags>y</tags>'
           "<order>oldest</order><filter><done>true</done></filter><score>1.5</score>"
           "</search>").encode()
    payload = from_xml(cls, xml)
    assert arguments_of(payload) == {"query": "a < b", "tags": ["x", "y"], "order": "oldest",
                                     "filter": {"done": True}, "score": 1.5}
    assert to_xml(payload) == xml


@pytest.mark.parametrize("bad", [
    f'<search xmlns="{NS}"><order>newest</order></search>',  # query missing
    f'<search xmlns="{NS}"><query>q</query><order>sideways</order></search>',
    f'<search xmlns="{NS}"><query>q</query><order>newest</order><limit>ten</limit></search>',
    f'<search xmlns="{NS}"><query>q</query><order>newest</order><extra/></search>',
])
def test_arguments_that_fail_the_generated_schema_are_refused(bad: str) -> None:
    with pytest.raises(ValidationError):
        from_xml(payload_class("notes", "search", SCHEMA), bad.encode())


@pytest.mark.parametrize(("schema", "pointer"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "/properties/a/$ref"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}},
     "/properties/a/anyOf"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "array",
                                                                      "items": {}}}}},
     "/properties/a/items"),
    ({"type": "object", "properties": {"a/b": {"type": "string"}}}, "/properties/a~1b"),
    ({"type": "object", "properties": {"a": {"type": "null"}}}, "/properties/a/type"),
    ({"type": "string"}, "/"),
])
def test_an_unmappable_schema_names_the_json_pointer(schema: dict, pointer: str) -> None:
    with pytest.raises(Unmappable) as info:
        payload_class("notes", "search", schema)
    assert info.value.pointer == pointer


def test_the_result_class_caps_its_text() -> None:
    cls = result_class("notes", "search", 10)
    ok = (f'<mcp-result xmlns="{NS}"><content><type>text</type><text>short</text>'
          "</content><is-error>false</is-error></mcp-result>").encode()
    from_xml(cls, ok)
    with pytest.raises(ValidationError):
        from_xml(cls, ok.replace(b"short", b"far too long for the cap"))
