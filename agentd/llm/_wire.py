"""The providers' wire protocols, sans I/O: request values in, HTTP parts out; HTTP
status, headers and body in, a response value or a classified error out.

- `openai`: the Chat Completions protocol (OpenAI, vLLM, Ollama, llama.cpp server).
  The system prompt is the first message, with role `system`. Tools go in `tools`
  (`type: function`); the model's calls come back in `message.tool_calls`, each
  with an id and its arguments as JSON text; each result is a `role: tool` message
  with that id, right after the assistant message (an error's text starts with
  `error:`).
  Streamed (`stream: true`, with `stream_options.include_usage` so the usage still
  comes), the reply is Server-Sent Events, decoded in `_stream`.
- `anthropic`: the Messages API. The system prompt goes in the top-level `system`
  field, never among the messages (the reference implementation dropped it); the
  messages must alternate user/assistant starting with user, so consecutive
  messages of one role are merged. Tools go in `tools` (`input_schema`); calls are
  `tool_use` blocks (arguments as an object); results are `tool_result` blocks,
  first in the next user message, with `is_error`.

Errors are classified here once, for every provider: 408/409/429 and 5xx are
retryable (honouring `Retry-After` / `retry-after-ms`); 401/403/404 fail over to the
next backend without retry; any other 4xx is the request's fault and is neither
retried nor failed over.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agentd.llm._types import BackendError, ChatMessage, LlmRequest, ToolCall

JSON = "application/json"
EVENT_STREAM = "text/event-stream"
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_BASE_URLS = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
MAX_ERROR_TEXT = 300  # provider error bodies are logged, truncated


@dataclass(frozen=True)
class HttpRequest:
    url: str
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class Decoded:
    text: str
    input_tokens: int | None
    output_tokens: int | None
    finish_reason: str
    model: str
    calls: tuple[ToolCall, ...] = ()


class WireProtocol(Protocol):
    name: str

    def encode(
        self, request: LlmRequest, *, base_url: str, model: str, api_key: str | None,
        stream: bool = False,
    ) -> HttpRequest: ...

    def decode(self, body: bytes) -> Decoded: ...


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _loads(body: bytes, backend: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise BackendError(backend, "response is not JSON", retryable=True) from None
    if not isinstance(obj, dict):
        raise BackendError(backend, "response is not a JSON object", retryable=True)
    return obj


def _usage(obj: dict[str, Any]) -> dict[str, Any]:
    usage = obj.get("usage")
    return usage if isinstance(usage, dict) else {}


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class OpenAIChat:
    name = "openai"

    def encode(
        self, request: LlmRequest, *, base_url: str, model: str, api_key: str | None,
        stream: bool = False,
    ) -> HttpRequest:
        messages: list[dict[str, Any]] = [{"role": "system", "content": request.system}]
        for m in request.messages:
            messages += openai_messages(m)
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": request.max_tokens,
            "stream": stream,
        }
        if stream:  # the usage comes in a last chunk of its own
            body["stream_options"] = {"include_usage": True}
        if request.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters,
            }} for t in request.tools]
            body["tool_choice"] = "auto"
        if request.temperature is not None:
            body["temperature"] = request.temperature
        headers = {"content-type": JSON, "accept": EVENT_STREAM if stream else JSON}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        return HttpRequest(base_url.rstrip("/") + "/chat/completions", headers, _dumps(body))

    def decode(self, body: bytes) -> Decoded:
        obj = _loads(body, self.name)
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise BackendError(self.name, "response has no choices", retryable=True)
        message = choices[0].get("message")
        message = message if isinstance(message, dict) else {}
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        calls: list[ToolCall] = []
        raw_calls = message.get("tool_calls")
        for raw in raw_calls if isinstance(raw_calls, list) else ():
            function = raw.get("function") if isinstance(raw, dict) else None
            if not isinstance(function, dict) or not isinstance(raw.get("id"), str):
                raise BackendError(self.name, "a tool call without id or function",
                                   retryable=True)
            arguments = function.get("arguments")
            calls.append(ToolCall(raw["id"], str(function.get("name") or ""),
                                  arguments if isinstance(arguments, str) else ""))
        usage = _usage(obj)
        return Decoded(
            text=text,
            input_tokens=_count(usage.get("prompt_tokens")),
            output_tokens=_count(usage.get("completion_tokens")),
            finish_reason=str(choices[0].get("finish_reason") or ""),
            model=str(obj.get("model") or ""),
            calls=tuple(calls),
        )


ERROR_PREFIX = "error: "


def openai_messages(m: ChatMessage) -> list[dict[str, Any]]:
    """One turn as chat-completions messages: an assistant turn with its
    `tool_calls`; a user turn's results as `role: tool` messages, then its text."""
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": m.content or None}
        if m.calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in m.calls]
        elif out["content"] is None:
            out["content"] = ""
        return [out]
    messages: list[dict[str, Any]] = [{
        "role": "tool", "tool_call_id": r.call_id,
        "content": error_text(r.content) if r.is_error else r.content,
    } for r in m.results]
    if m.content or not m.results:
        messages.append({"role": "user", "content": m.content})
    return messages


def error_text(text: str) -> str:
    """An error result's text for a protocol without an error flag: `error: ...`."""
    return text if text.startswith(ERROR_PREFIX) else ERROR_PREFIX + text


class AnthropicMessages:
    name = "anthropic"

    def encode(
        self, request: LlmRequest, *, base_url: str, model: str, api_key: str | None,
        stream: bool = False,
    ) -> HttpRequest:
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": request.max_tokens,
            "system": request.system,
            "messages": [anthropic_message(m) for m in alternate(request.messages)],
        }
        if request.tools:
            body["tools"] = [{"name": t.name, "description": t.description,
                              "input_schema": t.parameters} for t in request.tools]
        if request.temperature is not None:
            body["temperature"] = min(request.temperature, 1.0)  # Anthropic's range is 0..1
        if stream:
            body["stream"] = True
        headers = {"content-type": JSON, "accept": EVENT_STREAM if stream else JSON,
                   "anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        base = base_url.rstrip("/")
        url = base + ("/messages" if base.endswith("/v1") else "/v1/messages")
        return HttpRequest(url, headers, _dumps(body))

    def decode(self, body: bytes) -> Decoded:
        obj = _loads(body, self.name)
        blocks = obj.get("content")
        if not isinstance(blocks, list):
            raise BackendError(self.name, "response has no content", retryable=True)
        text = "".join(
            b["text"] for b in blocks
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
        )
        calls: list[ToolCall] = []
        for b in blocks:
            if not isinstance(b, dict) or b.get("type") != "tool_use":
                continue
            if not isinstance(b.get("id"), str):
                raise BackendError(self.name, "a tool_use block without id", retryable=True)
            calls.append(ToolCall(b["id"], str(b.get("name") or ""),
                                  json.dumps(b.get("input"), ensure_ascii=False)))
        usage = _usage(obj)
        return Decoded(
            text=text,
            input_tokens=_count(usage.get("input_tokens")),
            output_tokens=_count(usage.get("output_tokens")),
            finish_reason=str(obj.get("stop_reason") or ""),
            model=str(obj.get("model") or ""),
            calls=tuple(calls),
        )


def anthropic_message(m: ChatMessage) -> dict[str, Any]:
    """One turn as a Messages API message: plain text when it carries no tool
    traffic, else blocks (`tool_result` blocks first in a user turn, `tool_use`
    blocks after the text of an assistant turn)."""
    if not m.calls and not m.results:
        return {"role": m.role, "content": m.content}
    blocks: list[dict[str, Any]] = [{
        "type": "tool_result", "tool_use_id": r.call_id, "content": r.content,
        "is_error": r.is_error,
    } for r in m.results]
    if m.content:
        blocks.append({"type": "text", "text": m.content})
    for c in m.calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name,
                       "input": _object_or_empty(c.arguments)})
    return {"role": m.role, "content": blocks}


def _object_or_empty(arguments: str) -> Any:
    """A call's arguments as the object the protocol wants back; a call whose
    arguments were not a JSON object was answered with an error result, and is
    echoed with `{}`."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def alternate(messages: tuple[ChatMessage, ...]) -> list[ChatMessage]:
    """Messages that alternate user/assistant and start with user: consecutive
    messages of one role are joined; a leading assistant message gets an empty user
    turn before it."""
    out: list[ChatMessage] = []
    for m in messages:
        if out and out[-1].role == m.role:
            last = out[-1]
            text = "\n\n".join(t for t in (last.content, m.content) if t)
            out[-1] = ChatMessage(m.role, text, last.calls + m.calls, last.results + m.results)
        else:
            out.append(m)
    if out and out[0].role != "user":
        out.insert(0, ChatMessage("user", "(continue)"))
    return out


PROTOCOLS: dict[str, WireProtocol] = {"openai": OpenAIChat(), "anthropic": AnthropicMessages()}


# ---- error classification ------------------------------------------------------------


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms`, or `Retry-After` (seconds or HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def classify(backend: str, status: int, headers: Mapping[str, str], body: bytes) -> BackendError:
    """The error for a non-2xx response."""
    detail = _error_text(body)
    if status in (408, 409, 429) or status >= 500:
        return BackendError(
            backend, detail or "temporarily unavailable", status=status, retryable=True,
            retry_after=retry_after_s(headers),
        )
    if status in (401, 403, 404):
        return BackendError(backend, detail or "refused", status=status, failover=True)
    return BackendError(backend, detail or "request refused", status=status, failover=False)


def _error_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body[:MAX_ERROR_TEXT].decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:MAX_ERROR_TEXT]
        if isinstance(err, str):
            return err[:MAX_ERROR_TEXT]
    return ""
