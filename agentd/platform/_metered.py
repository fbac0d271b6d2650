"""The one way the platform calls a model, metered: whom a call is charged to
(`Meter`), what it returns to the agent (`Completion`), and `MeteredCalls`, which
reserves the budgets, calls the router, settles, counts and journals. An agent's
turn, a fold summary and semantic routing's form filling all go through it;
streaming (a `TextSink`) and native tool calling (the request's tools) ride on the
request, never on a second path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentd import _metrics as metrics
from agentd.llm import ChatMessage, LlmRequest, LlmResponse, LlmRouter, TextSink, ToolCall, ToolSpec
from agentd.platform._budget import BudgetLedger, Scope
from agentd.telemetry import tracer

# audit(kind, thread, fields): must not block; the kernel adapter journals it.
AuditFn = Callable[[str, str, Mapping[str, Any]], None]


@dataclass(frozen=True)
class Completion:
    text: str
    input_tokens: int
    output_tokens: int
    backend: str
    cached: bool
    request_key: str
    transport_s: float = 0.0  # time waiting on the backend (the rest is platform overhead)
    calls: tuple[ToolCall, ...] = ()  # the reply's provider tool calls (native tool calling)


@dataclass(frozen=True)
class Meter:
    """Whom one LLM call is charged to and how it is journaled: `who` is the metrics
    label and the record's `agent`, `audit` the record's kind, `fields` ride on it
    (a segment id, a prompt hash), `failed` is the outcome a failure records."""

    who: str
    thread: str
    scopes: Sequence[Scope]
    audit: str = "llm-call"
    fields: Mapping[str, Any] = field(default_factory=dict)
    failed: str = "error"


class MeteredCalls:
    """Budgets, router and journal for every model call the platform makes."""

    def __init__(self, router: LlmRouter, budgets: BudgetLedger, audit: AuditFn) -> None:
        self._router = router
        self.budgets = budgets
        self._audit = audit

    async def __call__(self, request: LlmRequest, meter: Meter, *, prefer: str,
                       only: bool = False, sink: TextSink | None = None,
                       ) -> tuple[LlmRequest, LlmResponse]:
        """The one way the platform calls a model: reserve the budgets (raises
        `BudgetExceeded` before anything is sent), call the router, charge what the
        provider reported (a cache hit costs nothing), count the tokens in
        `agentd_llm_tokens_total`, and journal the call, failed or not. Returns the
        request as sent (its output lowered to what the budgets grant)."""
        reservation = self.budgets.reserve(
            meter.scopes, request.estimated_input_tokens, request.max_tokens)
        if reservation.max_output != request.max_tokens:
            request = request.with_max_tokens(reservation.max_output)
        try:
            response = await self._router.complete(request, prefer=prefer, only=only,
                                                   sink=sink)
        except BaseException as exc:  # cancelled too (handler timeout): freed
            self.budgets.settle(reservation, None)
            if isinstance(exc, Exception):
                self._audit(meter.audit, meter.thread, {
                    "agent": meter.who, "backend": prefer, **meter.fields,
                    "request_sha256": request.key, "outcome": meter.failed,
                    "error": type(exc).__name__,
                })
            raise
        self.budgets.settle(reservation, 0 if response.cached else response.total_tokens)
        if not response.cached:
            metrics.llm_tokens.labels(meter.who, response.backend, "input").inc(
                response.input_tokens)
            metrics.llm_tokens.labels(meter.who, response.backend, "output").inc(
                response.output_tokens)
        self._audit(meter.audit, meter.thread, {
            "agent": meter.who, "backend": response.backend, **meter.fields,
            "request_sha256": request.key, "input_tokens": response.input_tokens,
            "output_tokens": response.output_tokens, "cached": response.cached,
            "attempts": response.attempts, "outcome": "ok", "model": response.model,
            "latency_ms": round(response.transport_s * 1000, 3),
            **tracer().content(request, response),  # only with telemetry.capture_content
        })
        return request, response


def request_bytes(system: str, messages: Sequence[ChatMessage],
                   tools: Sequence[ToolSpec] = ()) -> int:
    """UTF-8 size of a request's system prompt, messages (tool calls and results
    included) and tool definitions, with a few bytes for each message's framing."""
    size = len(system.encode()) + sum(len(m.content.encode()) + 16 for m in messages)
    for m in messages:
        if m.calls or m.results:
            size += sum(len(c.arguments.encode()) + len(c.id) + len(c.name) + 32
                        for c in m.calls)
            size += sum(len(r.content.encode()) + len(r.call_id) + 32 for r in m.results)
    return size + sum(tool_bytes(t) for t in tools)


def tool_bytes(tool: ToolSpec) -> int:
    """What one provider tool definition adds to a request, in UTF-8 bytes."""
    return tool.wire_bytes
