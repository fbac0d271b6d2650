"""Native tool calling on the wire: the OpenAI chat-completions and Anthropic
Messages tool protocols, read from recorded provider responses (checked against the
providers' own SDK types), written as those providers document, and carried
through a real HTTP exchange and a cassette."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion

from agentd.llm import (
    Cassette,
    CassetteRecorder,
    ChatMessage,
    LlmError,
    LlmRequest,
    ToolCall,
    ToolResult,
    ToolSpec,
)
from agentd.llm._wire import PROTOCOLS, alternate
from tests.llm_servers import FakeLLM, Reply
from tests.test_llm import backend, router

RECORDINGS = Path(__file__).resolve().parent / "recordings"
ADD = ToolSpec("calculator__add", "Adds two integers.", {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False})
ECHO = ToolSpec("echo", "Says the text back.", {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})


def recording(name: str) -> bytes:
    return (RECORDINGS / name).read_bytes()


def test_openai_tool_calls_decode_as_the_openai_sdk_reads_them() -> None:
    body = recording("openai_parallel_tool_calls.json")
    ours = PROTOCOLS["openai"].decode(body)
    sdk = ChatCompletion.model_validate_json(body).choices[0].message.tool_calls or []
    assert [(c.id, c.name, c.arguments) for c in ours.calls] == [
        (c.id, c.function.name, c.function.arguments) for c in sdk  # type: ignore[union-attr]
    ]
    assert len(ours.calls) == 2 and ours.finish_reason == "tool_calls" and ours.text == ""
    assert json.loads(ours.calls[1].arguments) == {"text": 'café <&> "quoted"'}


def test_anthropic_tool_use_decodes_as_the_anthropic_sdk_reads_it() -> None:
    body = recording("anthropic_tool_use.json")
    ours = PROTOCOLS["anthropic"].decode(body)
    sdk = [b for b in Message.model_validate_json(body).content if b.type == "tool_use"]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in ours.calls] == [
        (b.id, b.name, b.input) for b in sdk
    ]
    assert ours.text.startswith("I'll add") and ours.finish_reason == "tool_use"


def conversation() -> tuple[ChatMessage, ...]:
    calls = (ToolCall("call_1", "calculator__add", '{"a": 2, "b": 40}'),
             ToolCall("call_2", "echo", "not json"))
    results = (ToolResult("call_1", '<sum xmlns="urn:x">42</sum>'),
               ToolResult("call_2", "arguments are not JSON: expected a value", is_error=True))
    return (ChatMessage("user", "task"), ChatMessage("assistant", "", calls),
            ChatMessage("user", "", results=results))


def encoded(protocol: str, messages: tuple[ChatMessage, ...]) -> dict[str, Any]:
    request = LlmRequest("sys", messages, 64, tools=(ADD, ECHO))
    http = PROTOCOLS[protocol].encode(request, base_url="http://x/v1", model="m", api_key=None)
    body: dict[str, Any] = json.loads(http.body)
    return body


def test_openai_results_follow_their_assistant_message_as_tool_messages() -> None:
    body = encoded("openai", conversation())
    assert body["tool_choice"] == "auto"
    assert [t["function"]["name"] for t in body["tools"]] == ["calculator__add", "echo"]
    assert body["tools"][0] == {"type": "function", "function": {
        "name": ADD.name, "description": ADD.description, "parameters": ADD.parameters}}
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assistant = body["messages"][2]
    assert assistant["content"] is None
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert assistant["tool_calls"][0]["function"] == {"name": "calculator__add",
                                                      "arguments": '{"a": 2, "b": 40}'}
    ok, error = body["messages"][3:]
    assert ok == {"role": "tool", "tool_call_id": "call_1",
                  "content": '<sum xmlns="urn:x">42</sum>'}
    assert error["tool_call_id"] == "call_2"
    assert error["content"] == "error: arguments are not JSON: expected a value"


def test_anthropic_results_are_the_first_blocks_of_the_next_user_message() -> None:
    messages = (*conversation(), ChatMessage("user", "a notice"))
    body = encoded("anthropic", messages)
    assert body["tools"][0] == {"name": ADD.name, "description": ADD.description,
                                "input_schema": ADD.parameters}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
    uses = body["messages"][1]["content"]
    assert [(b["type"], b["id"], b["input"]) for b in uses] == [
        ("tool_use", "call_1", {"a": 2, "b": 40}), ("tool_use", "call_2", {})]
    blocks = body["messages"][2]["content"]
    assert [b["type"] for b in blocks] == ["tool_result", "tool_result", "text"]
    assert blocks[0] == {"type": "tool_result", "tool_use_id": "call_1",
                         "content": '<sum xmlns="urn:x">42</sum>', "is_error": False}
    assert blocks[1]["is_error"] is True and blocks[1]["tool_use_id"] == "call_2"
    assert blocks[2] == {"type": "text", "text": "a notice"}


def test_merging_turns_keeps_every_result_of_a_reply() -> None:
    first = ChatMessage("user", "", results=(ToolResult("a", "1"),))
    second = ChatMessage("user", "", results=(ToolResult("b", "2"),))
    [merged] = alternate((first, second))
    assert [r.call_id for r in merged.results] == ["a", "b"]


def test_a_request_without_tools_keeps_its_key() -> None:
    # Keys of recorded requests (cassettes) must not move with the tool fields.
    request = LlmRequest("sys", (ChatMessage("user", "hi"),), 64, 0.2)
    assert "tools" not in request.normalised()
    assert request.normalised()["messages"] == [{"role": "user", "content": "hi"}]
    assert LlmRequest("sys", request.messages, 64, 0.2, tools=(ADD,)).key != request.key


@pytest.mark.parametrize("protocol, name", [
    ("openai", "openai_parallel_tool_calls.json"), ("anthropic", "anthropic_tool_use.json")])
async def test_tool_calls_cross_real_http_and_replay_from_a_cassette(
        protocol: str, name: str, tmp_path: Path) -> None:
    tape = tmp_path / "tape.jsonl"
    async with FakeLLM(protocol, [Reply(body=recording(name))]) as server:
        live = router(backend("live", server))
        request = LlmRequest("sys", (ChatMessage("user", "add and echo"),), 256,
                             tools=(ADD, ECHO))
        response = await live.complete(request)
        await live.aclose()
        sent = server.requests[0].json
    assert [c.name for c in response.calls] == ["calculator__add", "echo"]
    assert len(sent["tools"]) == 2
    CassetteRecorder(tape).append(request, response)
    replayed = Cassette.load(tape).lookup(request)
    assert replayed is not None and replayed.to_response("tape").calls == response.calls


def test_a_cassette_with_malformed_calls_is_refused_at_load(tmp_path: Path) -> None:
    tape = tmp_path / "bad.jsonl"
    tape.write_text(json.dumps({"key": "k", "request": {}, "response": {
        "text": "", "calls": [["only-an-id"]]}}) + "\n")
    with pytest.raises(Exception, match="not a cassette exchange"):
        Cassette.load(tape)


def refuses_tools(seen: Any) -> Reply:
    if "tools" in seen.json:
        return Reply(status=400, body=b'{"error": {"message": "tools is not supported", '
                                      b'"type": "invalid_request_error"}}')
    return Reply(text="<add>...</add>")


def with_tools(*, optional: bool) -> LlmRequest:
    return LlmRequest("sys", (ChatMessage("user", "add"),), 64, tools=(ADD,),
                      tools_optional=optional)


async def test_auto_falls_back_once_to_xml_on_a_backend_refusing_tools(
        caplog: pytest.LogCaptureFixture) -> None:
    async with FakeLLM("openai", refuses_tools) as server:
        live = router(backend("local", server))
        first = await live.complete(with_tools(optional=True))
        second = await live.complete(with_tools(optional=True))
        await live.aclose()
    assert first.without_tools and second.without_tools and first.text == "<add>...</add>"
    # the first request was retried without tools; the second went without them at once
    assert ["tools" in seen.json for seen in server.requests] == [True, False, False]
    refusals = [r for r in caplog.records if "answered HTTP 400 to a request with tools"
                in r.getMessage()]
    assert len(refusals) == 1


@pytest.mark.parametrize("protocol, optional", [("openai", False), ("anthropic", True)])
async def test_a_refusal_of_tools_is_an_error_unless_auto_on_openai(
        protocol: str, optional: bool) -> None:
    async with FakeLLM(protocol, refuses_tools) as server:
        live = router(backend("local", server))
        with pytest.raises(LlmError, match="tools is not supported"):
            await live.complete(with_tools(optional=optional))
        await live.aclose()
    assert all("tools" in seen.json for seen in server.requests)
