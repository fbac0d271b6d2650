"""A model's native tool call becomes the payload for the listener it named, or that
call's error result with the reason (nothing that fails goes out)."""

from __future__ import annotations

from lxml import etree

from agentd._xmlify import spec_of
from agentd.llm import ToolCall, ToolResult
from agentd.platform._calls import AddressedCall, decide, peer_tools
from agentd.tools.calculator import Add
from agentd.tools.files import ReadFile

TOOLS = peer_tools([("calculator.add", spec_of(Add)), ("notes", spec_of(ReadFile)),
                    ("pages", spec_of(ReadFile))])


def error_of(call: ToolCall) -> str:
    result = decide(call, TOOLS)
    assert isinstance(result, ToolResult) and result.is_error and result.call_id == call.id
    assert result.content.startswith("error: ")
    return result.content


def test_a_call_becomes_the_payload_addressed_to_the_listener_it_named() -> None:
    result = decide(ToolCall("call_1", "calculator__add", '{"a": 2, "b": 40}'), TOOLS)
    assert isinstance(result, AddressedCall)
    assert result.to == "calculator.add" and result.call_id == "call_1"
    assert spec_of(Add).schema.validate(etree.fromstring(result.payload))
    assert spec_of(Add).from_element(etree.fromstring(result.payload)) == Add(a=2, b=40)


def test_two_tools_of_one_payload_class_are_addressed_apart() -> None:
    notes = decide(ToolCall("c1", "notes", '{"path": "a.txt"}'), TOOLS)
    pages = decide(ToolCall("c2", "pages", '{"path": "a.txt"}'), TOOLS)
    assert isinstance(notes, AddressedCall) and isinstance(pages, AddressedCall)
    assert (notes.to, pages.to) == ("notes", "pages")
    assert notes.payload == pages.payload


def test_arguments_that_are_not_json_are_that_calls_error() -> None:
    assert "the arguments are not JSON" in error_of(ToolCall("c", "calculator__add", "{a: 2"))


def test_arguments_that_are_not_an_object_are_that_calls_error() -> None:
    assert "must be a JSON object" in error_of(ToolCall("c", "calculator__add", "[2, 40]"))


def test_arguments_that_fail_the_schema_name_the_reason() -> None:
    reason = error_of(ToolCall("c", "calculator__add", '{"a": "two", "b": 40}'))
    assert "do not match the tool's schema" in reason and "'two'" in reason
    missing = error_of(ToolCall("c", "calculator__add", '{"a": 2}'))
    assert "do not match the tool's schema" in missing and "b" in missing
    extra = error_of(ToolCall("c", "calculator__add", '{"a": 2, "b": 1, "rm": "-rf"}'))
    assert "unknown argument 'rm'" in extra


def test_a_tool_the_agent_was_not_given_is_refused_by_name() -> None:
    reason = error_of(ToolCall("c", "shell", '{"cmd": "id"}'))
    assert "no tool named 'shell'" in reason and "calculator__add" in reason


def test_markup_in_arguments_stays_text() -> None:
    result = decide(ToolCall("c", "notes", '{"path": "</path><x/>&amp;"}'), TOOLS)
    assert isinstance(result, AddressedCall)
    read = spec_of(ReadFile).from_element(etree.fromstring(result.payload))
    assert read.path == "</path><x/>&amp;"
