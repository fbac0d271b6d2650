"""Values that cross the LLM layer: a provider-neutral request, its response, errors.

A request is what the platform assembled for one call; it is frozen, and its `key`
(SHA-256 over a canonical JSON form) identifies it for the response cache and for
cassettes. The spotlight nonce is random per call, so it is replaced by a fixed
placeholder before hashing: two calls that differ only in their nonce are the same
request. Nothing secret (API keys, headers) is ever part of a request value.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from typing import Any, Literal, Protocol

from agentd._errors import AgentdError

Role = Literal["user", "assistant"]
NONCE_PLACEHOLDER = "NONCE"
ORGANISM_PLACEHOLDER = "ORGANISM"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One provider tool offered with a request: its name, what it does, and the
    JSON Schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    # Sizes taken once (a spec lives as long as its prompt; requests read them on
    # every call): characters for the token estimate, UTF-8 bytes on the wire.
    estimate_chars: int = field(init=False, repr=False, compare=False)
    wire_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schema = json.dumps(self.parameters)
        compact = json.dumps(self.parameters, separators=(",", ":"))
        object.__setattr__(self, "estimate_chars",
                           len(schema) + len(self.description) + len(self.name))
        object.__setattr__(self, "wire_bytes", len(self.name) + len(self.description.encode())
                           + len(compact.encode()) + 32)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A model's call of a tool, as the provider reported it. `arguments` is the
    JSON text as the model wrote it (it may not even be JSON: the caller checks)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What came of one call, sent back under its id. `is_error`: the call failed
    (a `huh`, arguments that are not JSON or fail the schema)."""

    call_id: str
    content: str
    is_error: bool = False


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One turn. An assistant turn may carry the model's tool calls; a user turn may
    carry tool results, which the wire puts before its text (both providers want
    the results of a reply's calls directly after it)."""

    role: Role
    content: str
    calls: tuple[ToolCall, ...] = ()
    results: tuple[ToolResult, ...] = ()

    def normalised(self, norm: Callable[[str], str]) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": norm(self.content)}
        if self.calls:
            out["calls"] = [[c.id, c.name, norm(c.arguments)] for c in self.calls]
        if self.results:
            out["results"] = [[r.call_id, norm(r.content), r.is_error] for r in self.results]
        return out

    @property
    def size(self) -> int:
        """Characters of the turn, tool calls and results included."""
        return (len(self.content) + sum(len(c.name) + len(c.arguments) + len(c.id)
                                        for c in self.calls)
                + sum(len(r.content) + len(r.call_id) for r in self.results))


@dataclass(frozen=True)
class LlmRequest:
    """One completion request, provider-neutral. `system` is sent in the provider's
    system slot (a `system` message for OpenAI, the `system` field for Anthropic);
    `messages` never carry the system role."""

    system: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    temperature: float | None = None
    nonce: str = ""  # the spotlight nonce of this call; normalised out of `key`
    agent: str = ""  # for metrics and audit; never sent
    tools: tuple[ToolSpec, ...] = ()  # provider tools (native tool calling)
    # `tool_calling: auto`: a backend that refuses tools may answer without them
    # (never sent, not part of `key`).
    tools_optional: bool = False
    # The organism's name (in prompts and shared facts); normalised out of `key`, so a
    # renamed organism replays its cassette.
    organism: str = ""

    def normalised(self, *, with_system: bool = True) -> dict[str, Any]:
        """The request as stored in cassettes: the nonce and the organism's name
        replaced by placeholders."""
        name = _name_pattern(self.organism) if self.organism else None

        def norm(text: str) -> str:
            if self.nonce:
                text = text.replace(self.nonce, NONCE_PLACEHOLDER)
            return name.sub(ORGANISM_PLACEHOLDER, text) if name is not None else text

        out: dict[str, Any] = {
            "messages": [m.normalised(norm) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        if self.tools:  # absent when empty: keys of requests without tools do not move
            out["tools"] = [[t.name, t.description, t.parameters] for t in self.tools]
        if with_system:
            out["system"] = norm(self.system)
        return out

    @cached_property
    def key(self) -> str:
        """SHA-256 hex of the canonical JSON of `normalised()`, with the system prompt
        replaced by its own SHA-256 (the same frozen prompt is hashed once, not on
        every call)."""
        material = self.normalised(with_system=False)
        material["system_sha256"] = _system_digest(self.system, self.organism)
        return _digest(material)

    @cached_property
    def conversation_key(self) -> str:
        """SHA-256 of the messages alone (no system prompt, no parameters): lets a
        cassette survive an edit of the system prompt (see `ReplayBackend`)."""
        return _digest(self.normalised(with_system=False)["messages"])

    @cached_property
    def estimated_input_tokens(self) -> int:
        """A provider-independent estimate (4 characters a token, rounded up), used
        for budgets and token buckets before the provider reports the real figure."""
        size = len(self.system) + sum(m.size + 4 for m in self.messages)
        size += sum(t.estimate_chars for t in self.tools)
        return (size + 3) // 4

    def with_max_tokens(self, max_tokens: int) -> LlmRequest:
        return replace(self, max_tokens=max_tokens)

    def without_tools(self) -> LlmRequest:
        return replace(self, tools=())


@lru_cache(maxsize=16)
def _name_pattern(name: str) -> re.Pattern[str]:
    """The organism's name as a whole word (not inside a longer name)."""
    return re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w-])")


@lru_cache(maxsize=256)
def _system_digest(system: str, organism: str) -> str:
    """The system prompt's SHA-256 with the organism's name normalised out; cached
    whole, as the name's substitution over a long prompt costs more than the hash."""
    if organism:
        system = _name_pattern(organism).sub(ORGANISM_PLACEHOLDER, system)
    return hashlib.sha256(system.encode()).hexdigest()


def _digest(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()


@dataclass(frozen=True)
class LlmResponse:
    text: str
    input_tokens: int
    output_tokens: int
    backend: str = ""
    model: str = ""
    finish_reason: str = ""
    cached: bool = False
    attempts: int = 1  # HTTP attempts, all backends together
    transport_s: float = 0.0  # time spent waiting on the backend (excluded from overhead)
    calls: tuple[ToolCall, ...] = ()  # the model's tool calls, in its order
    # The request's tools were not sent: the backend refuses them (`tools_optional`),
    # so the model was asked with XML tool calls in mind.
    without_tools: bool = False

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class TextSink(Protocol):
    """Where a streamed call's visible text goes as it is written: `piece` for each
    piece of text, `interrupted` when an attempt that sent pieces failed (its
    stream ends there; a retry or another backend starts a new one)."""

    def piece(self, text: str) -> None: ...

    def interrupted(self) -> None: ...


# ---- errors ------------------------------------------------------------------------


class LlmError(AgentdError):
    """A completion could not be produced. `retry_allowed`: whether the same request
    could succeed later (what the caller's `huh` says); False for a failure that
    asking again cannot change."""

    retry_allowed: bool = True


@dataclass(eq=False)
class BackendError(LlmError):
    """One backend failed one attempt. `retryable`: worth another attempt on the same
    backend (429, 5xx, timeouts, connection errors); `failover`: worth trying another
    backend (everything but a request the provider refused as malformed)."""

    backend: str
    message: str
    status: int | None = None
    retryable: bool = False
    failover: bool = True
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.__str__())

    def __str__(self) -> str:
        status = f" (HTTP {self.status})" if self.status is not None else ""
        return f"backend {self.backend}{status}: {self.message}"


class RequestTooLarge(LlmError):
    """The request can never fit a backend's token bucket: refused at once rather
    than waiting forever."""


@dataclass(eq=False)
class ReplayMiss(BackendError):
    """A replay backend has no recorded exchange for this request. Another backend
    may have one (failover), but this one never will: not retryable, on this backend
    or by the client."""

    failover: bool = True
    retry_allowed = False


@dataclass(eq=False)
class NoBackendAvailable(LlmError):
    """Every backend the strategy allowed failed; `errors` says how, in order."""

    errors: list[BackendError | LlmError] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.__str__())
        # Worth asking again only if some backend failed for a reason that can pass.
        self.retry_allowed = not self.errors or any(e.retry_allowed for e in self.errors)

    def __str__(self) -> str:
        return "no LLM backend could answer: " + "; ".join(str(e) for e in self.errors)
