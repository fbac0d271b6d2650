"""Streamed completions against real HTTP servers on loopback speaking the providers'
SSE: the text reaches the sink piece by piece and in order, the response is the one
a whole reply gives (usage from the stream), tool calls are put together from their
pieces, and a stream that breaks ends interrupted before the retry, never with two
answers. The SSE parser alone is at the end."""

from __future__ import annotations

import json

import pytest

from agentd.llm import BackendError, LlmRouter
from agentd.llm._stream import MAX_LINE_BYTES, AnthropicStream, SseEvent, SseParser
from tests.llm_servers import FakeLLM, Reply
from tests.test_llm import backend, request, router


class Sink:
    """What a caller's sink was given: text pieces, None for each interruption."""

    def __init__(self) -> None:
        self.log: list[str | None] = []

    def piece(self, text: str) -> None:
        self.log.append(text)

    def interrupted(self) -> None:
        self.log.append(None)


async def complete(r: LlmRouter, sink: Sink, **kw: object):  # type: ignore[no-untyped-def]
    try:
        return await r.complete(request(**kw), sink=sink)  # type: ignore[arg-type]
    finally:
        await r.aclose()


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_a_streamed_reply_reaches_the_sink_in_order_with_its_usage(protocol: str) -> None:
    reply = Reply(pieces=["The ", "answer ", "is ", "42."], input_tokens=31, output_tokens=7)
    async with FakeLLM(protocol, [reply]) as server:
        sink = Sink()
        resp = await complete(router(backend("a", server)), sink)
    assert sink.log == ["The ", "answer ", "is ", "42."]
    assert resp.text == "The answer is 42." and resp.backend == "a"
    assert (resp.input_tokens, resp.output_tokens) == (31, 7)  # counted from the stream
    body = server.requests[0].json
    assert body["stream"] is True
    if protocol == "openai":
        assert body["stream_options"] == {"include_usage": True}
    assert server.requests[0].headers["accept"] == "text/event-stream"


def _openai(obj: dict) -> str:
    return "data: " + json.dumps(obj) + "\n\n"


async def test_openai_tool_calls_are_put_together_from_their_deltas() -> None:
    def call(index: int, **kw: object) -> str:
        return _openai({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": index, **kw}]}}]})

    events = [
        _openai({"choices": [{"index": 0, "delta": {"content": "Adding."}}]}),
        call(0, id="call_1", type="function", function={"name": "calc__add", "arguments": ""}),
        call(0, function={"arguments": '{"a": 2,'}),
        call(1, id="call_2", type="function", function={"name": "echo", "arguments": "{}"}),
        call(0, function={"arguments": ' "b": 3}'}),
        _openai({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
        _openai({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 12}}),
        "data: [DONE]\n\n",
    ]
    async with FakeLLM("openai", [Reply(events=events)]) as server:
        sink = Sink()
        resp = await complete(router(backend("a", server)), sink)
    assert sink.log == ["Adding."]  # tool-call markup is not text
    assert [(c.id, c.name, json.loads(c.arguments)) for c in resp.calls] == [
        ("call_1", "calc__add", {"a": 2, "b": 3}), ("call_2", "echo", {})]
    assert resp.finish_reason == "tool_calls" and resp.total_tokens == 52


async def test_anthropic_tool_use_is_put_together_from_input_json_deltas() -> None:
    def ev(kind: str, **obj: object) -> str:
        return f"event: {kind}\ndata: " + json.dumps({"type": kind, **obj}) + "\n\n"

    events = [
        ev("message_start", message={"model": "claude-x", "usage": {"input_tokens": 20}}),
        ev("ping"),
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "Let me add."}),
        ev("content_block_stop", index=0),
        ev("content_block_start", index=1, content_block={"type": "tool_use", "id": "tu_1",
                                                          "name": "calc__add", "input": {}}),
        ev("content_block_delta", index=1, delta={"type": "input_json_delta",
                                                  "partial_json": '{"a": 2, '}),
        ev("content_block_delta", index=1, delta={"type": "input_json_delta",
                                                  "partial_json": '"b": 3}'}),
        ev("content_block_stop", index=1),
        ev("message_delta", delta={"stop_reason": "tool_use"}, usage={"output_tokens": 9}),
        ev("message_stop"),
    ]
    async with FakeLLM("anthropic", [Reply(events=events)]) as server:
        sink = Sink()
        resp = await complete(router(backend("a", server)), sink)
    assert sink.log == ["Let me add."]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in resp.calls] == [
        ("tu_1", "calc__add", {"a": 2, "b": 3})]
    assert (resp.input_tokens, resp.output_tokens, resp.model) == (20, 9, "claude-x")


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
async def test_a_stream_cut_after_text_ends_interrupted_and_the_retry_answers_once(
    protocol: str,
) -> None:
    cut = Reply(pieces=["one ", "two ", "three"], cut_after=2)
    whole = Reply(pieces=["one ", "two ", "three"])
    async with FakeLLM(protocol, [cut, whole]) as server:
        sink = Sink()
        resp = await complete(router(backend("a", server), retries=1), sink)
    assert sink.log == ["one ", "two ", None, "one ", "two ", "three"]
    assert resp.text == "one two three" and resp.attempts == 2
    assert len(server.requests) == 2


async def test_a_failure_before_the_first_byte_fails_over_unseen() -> None:
    async with FakeLLM("openai", [Reply(status=401)]) as bad, \
            FakeLLM("openai", [Reply(pieces=["fine"])]) as good:
        sink = Sink()
        resp = await complete(router(backend("a", bad), backend("b", good)), sink)
    assert sink.log == ["fine"] and resp.backend == "b"


async def test_a_stream_without_its_end_is_not_an_answer() -> None:
    # The server closes cleanly after two pieces but never says [DONE]: retryable,
    # and with no retry left, an error, not a truncated answer.
    events = [_openai({"choices": [{"index": 0, "delta": {"content": "half"}}]})]
    async with FakeLLM("openai", [Reply(events=events)]) as server:
        sink = Sink()
        with pytest.raises(Exception) as info:
            await complete(router(backend("a", server), retries=0), sink)
    assert "before [DONE]" in str(info.value) and sink.log == ["half", None]


# ---- the SSE parser ------------------------------------------------------------------


def test_events_are_the_same_whatever_the_chunking() -> None:
    body = (b": comment\r\nevent: a\r\ndata: {\"x\":\r\ndata: 1}\r\n\r\n"
            b"data: second\n\nid: 7\nretry: 10\ndata: third\n\n")
    whole = SseParser("t").feed(body)
    parser = SseParser("t")
    bytewise = [e for i in range(len(body)) for e in parser.feed(body[i:i + 1])]
    assert whole == bytewise == [SseEvent("a", '{"x":\n1}'), SseEvent("message", "second"),
                                 SseEvent("message", "third")]


def test_a_line_without_end_past_the_bound_is_refused() -> None:
    parser = SseParser("t")
    with pytest.raises(BackendError, match="too long"):
        for _ in range(MAX_LINE_BYTES // 65536 + 2):
            parser.feed(b"x" * 65536)


def test_an_error_event_is_the_providers_error() -> None:
    stream = AnthropicStream()
    with pytest.raises(BackendError, match="Overloaded") as info:
        stream.feed(SseEvent("error", json.dumps(
            {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})))
    assert info.value.retryable
