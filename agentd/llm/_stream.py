"""The providers' streamed replies, sans I/O: Server-Sent Events bytes in, the
model's visible text piece by piece out, and at the end the same `Decoded` value a
whole reply gives (text, tool calls, usage, finish reason).

- `SseParser` splits an event stream into events (`event:` name, `data:` lines
  joined), whatever the chunking. A line is at most `MAX_LINE_BYTES` and an event
  at most `MAX_EVENT_BYTES`: past either the stream is refused, so a hostile
  server costs bounded memory and linear time.
- `OpenAIChatStream`: chat-completions chunks (`choices[0].delta.content`, tool
  calls as `delta.tool_calls[i]` pieces keyed by `index`: id and name once, the
  arguments in pieces), the usage chunk `stream_options.include_usage` asks for
  (no choices), and `data: [DONE]`.
- `AnthropicStream`: `message_start` (model, input tokens), `content_block_start`
  (a text or `tool_use` block), `content_block_delta` (`text_delta`,
  `input_json_delta`), `message_delta` (stop reason, output tokens),
  `message_stop`; an `error` event is the provider's error.

A reply that ends without its terminator (`[DONE]`, `message_stop`) is not
complete: `finish()` raises a retryable `BackendError`, and the caller treats it as
an interrupted stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentd.llm._types import BackendError, ToolCall
from agentd.llm._wire import Decoded

MAX_LINE_BYTES = 1024 * 1024
MAX_EVENT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SseEvent:
    event: str
    data: str


class SseParser:
    """Bytes of `text/event-stream` in, complete events out (comments and `id:`
    / `retry:` fields are ignored: a completion is never resumed by id)."""

    def __init__(self, backend: str) -> None:
        self._backend = backend
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        events: list[SseEvent] = []
        buffer = self._buffer + chunk
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = buffer[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            self._line(line, events)
        self._buffer = buffer[start:]
        if len(self._buffer) > MAX_LINE_BYTES:
            raise BackendError(self._backend, "stream line too long")
        return events

    def _line(self, line: bytes, events: list[SseEvent]) -> None:
        if not line:
            if self._data:
                events.append(SseEvent(self._event or "message", "\n".join(self._data)))
            self._event, self._data, self._size = "", [], 0
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            self._size += len(value)
            if self._size > MAX_EVENT_BYTES:
                raise BackendError(self._backend, "stream event too large")
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"event":
            self._event = value.decode("utf-8", "replace")


class StreamDecoder(Protocol):
    def feed(self, event: SseEvent) -> list[str]:
        """One event: the pieces of visible text it adds (often none)."""
        ...

    def finish(self) -> Decoded:
        """The whole reply; raises `BackendError` when the stream did not end."""
        ...


def _json(data: str, backend: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        raise BackendError(backend, "stream event is not JSON", retryable=True) from None
    if not isinstance(obj, dict):
        raise BackendError(backend, "stream event is not a JSON object", retryable=True)
    return obj


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class _Reply:
    """What both decoders collect as the events come (the text pieces, usage, the
    finish reason, the model, whether the terminator came) and the `Decoded` they
    end with; each names its provider, its terminator and how it orders its calls."""

    name = ""
    terminator = ""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason = ""
        self.model = ""
        self.done = False

    def _calls(self) -> list[ToolCall]:
        raise NotImplementedError

    def finish(self) -> Decoded:
        if not self.done:
            raise BackendError(self.name, f"stream ended before {self.terminator}",
                               retryable=True)
        return Decoded("".join(self.text), self.input_tokens, self.output_tokens,
                       self.finish_reason, self.model, tuple(self._calls()))


class OpenAIChatStream(_Reply):
    name = "openai"
    terminator = "[DONE]"

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[int, _Call] = {}

    def feed(self, event: SseEvent) -> list[str]:
        if event.data.strip() == "[DONE]":
            self.done = True
            return []
        obj = _json(event.data, self.name)
        if isinstance(obj.get("error"), dict | str):
            raise BackendError(self.name, "error in stream", retryable=True)
        self.model = str(obj.get("model") or self.model)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.input_tokens = _count(usage.get("prompt_tokens"))
            self.output_tokens = _count(usage.get("completion_tokens"))
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return []
        choice = choices[0]
        if choice.get("finish_reason"):
            self.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        for raw in delta.get("tool_calls") or ():
            if not isinstance(raw, dict) or not isinstance(raw.get("index"), int):
                raise BackendError(self.name, "a tool call piece without index", retryable=True)
            call = self.calls.setdefault(raw["index"], _Call())
            if isinstance(raw.get("id"), str):
                call.id = raw["id"]
            function = raw.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    call.name += function["name"]
                if isinstance(function.get("arguments"), str):
                    call.arguments.append(function["arguments"])
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.text.append(content)
            return [content]
        return []

    def _calls(self) -> list[ToolCall]:
        calls = []
        for _, call in sorted(self.calls.items()):
            if not call.id:
                raise BackendError(self.name, "a tool call without id", retryable=True)
            calls.append(ToolCall(call.id, call.name, "".join(call.arguments)))
        return calls


class AnthropicStream(_Reply):
    name = "anthropic"
    terminator = "message_stop"

    def __init__(self) -> None:
        super().__init__()
        self.blocks: dict[int, _Call | None] = {}  # index -> tool_use, None: text
        self.order: list[int] = []

    def feed(self, event: SseEvent) -> list[str]:
        obj = _json(event.data, self.name)
        kind = str(obj.get("type") or event.event)
        if kind == "error":
            err = obj.get("error")
            detail = err.get("message") if isinstance(err, dict) else None
            raise BackendError(self.name, str(detail or "error in stream")[:300], retryable=True)
        if kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self.model = str(message.get("model") or "")
                usage = message.get("usage")
                if isinstance(usage, dict):
                    self.input_tokens = _count(usage.get("input_tokens"))
                    self.output_tokens = _count(usage.get("output_tokens"))
        elif kind == "content_block_start":
            index, block = obj.get("index"), obj.get("content_block")
            if not isinstance(index, int) or not isinstance(block, dict):
                raise BackendError(self.name, "a content block without index", retryable=True)
            if block.get("type") == "tool_use":
                if not isinstance(block.get("id"), str):
                    raise BackendError(self.name, "a tool_use block without id", retryable=True)
                self.blocks[index] = _Call(block["id"], str(block.get("name") or ""))
                self.order.append(index)
            else:
                self.blocks[index] = None
                text = block.get("text")
                if isinstance(text, str) and text:
                    self.text.append(text)
                    return [text]
        elif kind == "content_block_delta":
            delta = obj.get("delta")
            if not isinstance(delta, dict):
                return []
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self.text.append(delta["text"])
                return [delta["text"]] if delta["text"] else []
            if delta.get("type") == "input_json_delta":
                call = self.blocks.get(obj.get("index"))  # type: ignore[arg-type]
                if call is not None and isinstance(delta.get("partial_json"), str):
                    call.arguments.append(delta["partial_json"])
        elif kind == "message_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason"):
                self.finish_reason = str(delta["stop_reason"])
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if _count(usage.get("output_tokens")) is not None:
                    self.output_tokens = _count(usage.get("output_tokens"))
                if _count(usage.get("input_tokens")) is not None:
                    self.input_tokens = _count(usage.get("input_tokens"))
        elif kind == "message_stop":
            self.done = True
        return []

    def _calls(self) -> list[ToolCall]:
        calls = []
        for index in self.order:
            call = self.blocks[index]
            assert call is not None
            arguments = "".join(call.arguments) or "{}"
            calls.append(ToolCall(call.id, call.name, arguments))
        return calls


def stream_decoder(provider: str) -> StreamDecoder:
    return OpenAIChatStream() if provider == "openai" else AnthropicStream()
