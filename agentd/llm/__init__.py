"""The LLM layer: provider wire protocols, backends, the router (strategies,
retries, failover, rate limits, response cache) and cassettes.

Only the platform (`agentd.platform`) makes LLM calls through it: handlers and agents
never reach a router or a backend directly. Other rooms use its plain parts: the
provider tool names and schemas (config, mcp), the error and call types (isolation,
semantic), the HTTP pool (embeddings) and cassettes (preflight).
"""

from typing import TYPE_CHECKING

from agentd._lazy import lazy_exports

if TYPE_CHECKING:
    from agentd.llm._cache import ResponseCache
    from agentd.llm._cassette import Cassette, CassetteRecorder, Exchange
    from agentd.llm._http import ConnectionFailed, HttpPool, ResponseTooLarge, post_bounded
    from agentd.llm._limits import Clock, MonotonicClock, TokenBucket
    from agentd.llm._router import LlmRouter
    from agentd.llm._types import (
        BackendError,
        ChatMessage,
        LlmError,
        LlmRequest,
        LlmResponse,
        NoBackendAvailable,
        ReplayMiss,
        RequestTooLarge,
        Role,
        TextSink,
        ToolCall,
        ToolResult,
        ToolSpec,
    )
    from agentd.llm._wire import PROTOCOLS, AnthropicMessages, OpenAIChat, classify, retry_after_s

__getattr__, __dir__ = lazy_exports(__name__, {
    "agentd.llm._cache": ("ResponseCache",),
    "agentd.llm._cassette": ("Cassette", "CassetteRecorder", "Exchange"),
    "agentd.llm._http": ("ConnectionFailed", "HttpPool", "ResponseTooLarge", "post_bounded"),
    "agentd.llm._limits": ("Clock", "MonotonicClock", "TokenBucket"),
    "agentd.llm._router": ("LlmRouter",),
    "agentd.llm._types": (
        "BackendError",
        "ChatMessage",
        "LlmError",
        "LlmRequest",
        "LlmResponse",
        "NoBackendAvailable",
        "ReplayMiss",
        "RequestTooLarge",
        "Role",
        "TextSink",
        "ToolCall",
        "ToolResult",
        "ToolSpec",
    ),
    "agentd.llm._wire": (
        "PROTOCOLS",
        "AnthropicMessages",
        "OpenAIChat",
        "classify",
        "retry_after_s",
    ),
})

__all__ = [
    "PROTOCOLS",
    "AnthropicMessages",
    "BackendError",
    "Cassette",
    "CassetteRecorder",
    "ChatMessage",
    "Clock",
    "ConnectionFailed",
    "Exchange",
    "HttpPool",
    "LlmError",
    "LlmRequest",
    "LlmResponse",
    "LlmRouter",
    "MonotonicClock",
    "NoBackendAvailable",
    "OpenAIChat",
    "ReplayMiss",
    "RequestTooLarge",
    "ResponseCache",
    "ResponseTooLarge",
    "Role",
    "TextSink",
    "TokenBucket",
    "ToolCall",
    "ToolResult",
    "ToolSpec",
    "classify",
    "post_bounded",
    "retry_after_s",
]
