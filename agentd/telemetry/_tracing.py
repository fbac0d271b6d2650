"""OpenTelemetry traces, when the organism has a `telemetry:` section.

`TRACER` is what the pump, the LLM router, the approval gates and the federation
call, a line each. Without the section it is `OFF`, whose methods return at once:
no OpenTelemetry module is imported and no span object is built, and `OTEL_*`
environment variables change nothing (the SDK is only ever given explicit
settings, and its tracer provider is never made the process's global one).

With it, `configure` builds a tracer provider with a batch span processor (a
bounded queue drained by the SDK's own thread: ending a span never waits for the
network, a full queue drops spans) and an OTLP exporter. Invariants:

- One trace per client thread: a conversation's first span takes the thread UUID's
  128 bits as its trace id, and what follows hangs from the span whose work sent
  it (the pump carries that span on the message). Work with no such span in
  memory (resumed after a restart, a timer) is a root of the same trace id. A
  peer's federation call (or, when allowed, a client's traceparent) makes the
  conversation continue the caller's trace instead.
- A handler call's span id is derived (through the SDK's id generator) from the
  conversation and the journal seq of the message it handles; a redelivered
  message's span gets a new id and a link to the interrupted one (never exported:
  a span is exported when it ends, and work the journal shows done is not
  redelivered).
- No payload, prompt or completion is put in a span unless `capture_content`; then
  an LLM call's messages are, with every env value and key of the configuration
  replaced by `[redacted]`.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentd.config import TelemetryConfig

log = logging.getLogger("agentd.telemetry")

# The client's thread the running task serves (set by `handler`): a span started
# below it (an LLM attempt) names its conversation from here.
_conversation: contextvars.ContextVar[str] = contextvars.ContextVar(
    "agentd_telemetry_conversation", default="")

# The span id the next span started gets (0: a random one); see `_derived_ids`.
_next_span_id: contextvars.ContextVar[int] = contextvars.ContextVar(
    "agentd_telemetry_next_span_id", default=0)

# The trace id the next root span gets (0: a random one); see `_derived_ids`.
_next_trace_id: contextvars.ContextVar[int] = contextvars.ContextVar(
    "agentd_telemetry_next_trace_id", default=0)

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_REMOTE = 65536  # conversations continuing a remote trace, remembered (newest kept)
_SCHEDULE_MS = 2000  # export this often: a trace shows soon, in few requests
_QUEUE = 4096  # spans waiting for export; beyond it, dropped (never blocks)
_BATCH = 512


class Off:
    """No telemetry: every call returns at once and builds nothing."""

    enabled = False

    def handler(self, listener: str, agent: bool, conversation: str, seq: int,
                redelivered: bool, cause: Any = None) -> None:
        return None

    def chat(self, backend: str, model: str, request: Any = None) -> None:
        return None

    def content(self, request: Any, response: Any) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        return None


OFF = Off()
TRACER: Any = OFF


def _span_id(*parts: object) -> int:
    digest = hashlib.sha256("\n".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") or 1


def trace_id_of(conversation: str) -> int:
    """The trace id of a client's thread: its UUID's 128 bits (a non-UUID thread
    id, which a client cannot choose here, is hashed)."""
    try:
        return uuid.UUID(conversation).int or 1
    except ValueError:
        return int.from_bytes(hashlib.sha256(conversation.encode()).digest()[:16], "big") or 1


def _derived_ids() -> Any:
    """The SDK's id generator, but a handler span takes the id derived for it, and a
    conversation's root span its trace id."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class DerivedIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            return _next_span_id.get() or super().generate_span_id()

        def generate_trace_id(self) -> int:
            return _next_trace_id.get() or super().generate_trace_id()

    return DerivedIds()


class _Quieter(logging.Filter):
    """The SDK logs a warning for every span a full queue drops: one a minute here."""

    def __init__(self) -> None:
        super().__init__()
        self.last = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if "dropping" not in record.getMessage():
            return True
        if record.created - self.last < 60.0:
            return False
        self.last = record.created
        return True


def read_headers(path: Path) -> dict[str, str]:
    """`Name: value` lines of a headers file (a secret file: an API key), for the
    exporter. Raises ConfigError on a line that is not a header."""
    from agentd._errors import ConfigError
    from agentd._secrets import read_secret_file

    headers: dict[str, str] = {}
    text = read_secret_file(path, "telemetry headers file").decode()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition(":")
        if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
            raise ConfigError([f"{path}:{number}: expected `Name: value`"])
        headers[name.strip().lower()] = value.strip()
    return headers


class On:
    """Spans through an OpenTelemetry SDK tracer provider of our own."""

    enabled = True

    def __init__(self, cfg: TelemetryConfig, organism: str, headers: dict[str, str],
                 secrets: Iterable[str] = ()) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

        from agentd import __version__

        self.cfg = cfg
        self.capture = cfg.capture_content
        self.accept_client_context = cfg.accept_client_context
        # Values never put in a span, even with capture_content: env values, keys.
        self.secrets = sorted({s for s in (*secrets, *headers.values()) if len(s) >= 4},
                              key=len, reverse=True)
        # Conversations whose trace was started elsewhere (a peer's federation call,
        # an accepted client traceparent): their remote parent, newest kept.
        self.remote: OrderedDict[str, Any] = OrderedDict()
        base = cfg.otlp_endpoint.rstrip("/")
        if cfg.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
            exporter: Any = GrpcExporter(endpoint=base, headers=headers, timeout=10)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=f"{base}/v1/traces", headers=headers,
                                        timeout=10)
        # Resource(...) rather than Resource.create(): the latter reads OTEL_* variables.
        resource = Resource({"service.name": cfg.service_name or organism,
                             "service.version": __version__})
        # On the trace id alone: a conversation's spans are all kept or all dropped.
        self.provider = TracerProvider(resource=resource,
                                       sampler=TraceIdRatioBased(cfg.sample_ratio),
                                       id_generator=_derived_ids())
        self.provider.add_span_processor(BatchSpanProcessor(
            exporter, max_queue_size=_QUEUE, schedule_delay_millis=_SCHEDULE_MS,
            max_export_batch_size=_BATCH, export_timeout_millis=10_000))
        self.tracer = self.provider.get_tracer("agentd", __version__)
        # Filters apply where a record is logged: the loggers the SDK drops spans on.
        for name in ("opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export"):
            sdk_log = logging.getLogger(name)
            if not any(isinstance(f, _Quieter) for f in sdk_log.filters):
                sdk_log.addFilter(_Quieter())

    # ---- where a span hangs ---------------------------------------------------------

    def _start(self, name: str, conversation: str, cause: Any, **kw: Any) -> Any:
        """A span under `cause` (a span: the one whose work sent this), else under the
        conversation's remote parent, else a root of the conversation's trace."""
        from opentelemetry import context, trace

        if cause is None:
            cause = self.remote.get(conversation)
        if cause is not None:
            return self.tracer.start_span(name, context=trace.set_span_in_context(cause), **kw)
        derived = _next_trace_id.set(trace_id_of(conversation))
        try:
            return self.tracer.start_span(name, context=context.Context(), **kw)
        finally:
            _next_trace_id.reset(derived)

    def adopt(self, conversation: str, traceparent: str) -> Any:
        """A W3C traceparent from a peer organism (or a client allowed to send one):
        the conversation's spans continue its trace. Returns the remote span, or
        None when `traceparent` is not a valid one (ignored)."""
        from opentelemetry import trace

        found = _TRACEPARENT.fullmatch(traceparent or "")
        if found is None:
            return None
        trace_id, span_id = int(found.group(1), 16), int(found.group(2), 16)
        if not trace_id or not span_id:
            return None
        remote = trace.NonRecordingSpan(trace.SpanContext(
            trace_id, span_id, is_remote=True, trace_flags=trace.TraceFlags(
                int(found.group(3), 16) & 1)))
        self.remote[conversation] = remote
        self.remote.move_to_end(conversation)
        while len(self.remote) > _REMOTE:
            self.remote.popitem(last=False)
        return remote

    @staticmethod
    def traceparent(span: Any) -> str:
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    # ---- agentd's own spans ---------------------------------------------------------

    def admit(self, client: str, conversation: str, started_ns: int, cause: Any = None,
              code: str = "", security: str = "") -> Any:
        """`agentd.admit`: a client's envelope checked, routed and journaled (ended by
        `end`, once its journal entry committed). A refusal: ended at once."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self._start("agentd.admit", conversation, cause, kind=SpanKind.SERVER,
                           start_time=started_ns, attributes={
                               "gen_ai.conversation.id": conversation,
                               "agentd.client": client})
        if security:
            span.add_event("agentd.security", {"kind": security})
        if code:
            span.add_event("agentd.huh", {"code": code})
            span.set_attribute("error.type", code)
            span.set_status(Status(StatusCode.ERROR))
            span.end()
        return span

    def commit(self, cause: Any) -> Any:
        """`agentd.commit`: a step's journal transaction, from handing it to the
        kernel's writer to its commit (ended by `end`)."""
        from opentelemetry import trace

        return self.tracer.start_span("agentd.commit",
                                      context=trace.set_span_in_context(cause))

    def end(self, span: Any, error: BaseException | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if error is not None:
            span.set_attribute("error.type", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def approval(self, conversation: str, listener: str, outcome: str, by: str,
                 parked_at: float) -> Any:
        """`agentd.approval`: the wait of a parked message, from when it was parked
        (kept by the kernel, so a restart in between loses nothing) to its decision."""
        span = self._start("agentd.approval", conversation, None,
                           start_time=int(parked_at * 1e9), attributes={
                               "gen_ai.conversation.id": conversation,
                               "agentd.listener": listener, "agentd.outcome": outcome,
                               "agentd.decided_by": by})
        span.end()
        return span

    def federation_call(self, gateway: str, listener: str) -> Any:
        """`agentd.federation.call`: a call to a peer organism, under the span of the
        handler making it (the current one); its traceparent crosses in the frame."""
        from opentelemetry.trace import SpanKind

        return self.tracer.start_span("agentd.federation.call", kind=SpanKind.CLIENT,
                                      attributes={"agentd.gateway": gateway,
                                                  "agentd.listener": listener})

    def end_federation(self, span: Any, outcome: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("agentd.outcome", outcome)
        if outcome != "ok":
            span.add_event("agentd.huh", {"code": outcome})
            span.set_attribute("error.type", outcome)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def event(span: Any, name: str, fields: Mapping[str, str]) -> None:
        """A huh code or security event on a span still open (values bounded)."""
        span.add_event(name, {k: str(v)[:200] for k, v in fields.items()})

    # ---- GenAI spans ------------------------------------------------------------------

    def handler(self, listener: str, agent: bool, conversation: str, seq: int,
                redelivered: bool, cause: Any = None) -> Any:
        from opentelemetry import context, trace

        links = []
        if redelivered:  # the interrupted call's span id, as it was derived then
            links.append(trace.Link(trace.SpanContext(
                trace_id_of(conversation), _span_id(conversation, seq), is_remote=False,
                trace_flags=trace.TraceFlags(1)), {"agentd.resumed": True}))
        name = f"invoke_agent {listener}" if agent else f"execute_tool {listener}"
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent" if agent else "execute_tool",
            "gen_ai.conversation.id": conversation,
            "agentd.listener": listener,
            "agentd.seq": seq,
            "agentd.redelivered": redelivered,
        }
        if agent:
            attrs["gen_ai.agent.name"] = listener
        else:
            attrs["gen_ai.tool.name"] = listener
            attrs["gen_ai.tool.call.id"] = f"{conversation}:{seq}"
        derived = _next_span_id.set(_span_id(conversation, seq, "resumed") if redelivered
                                    else _span_id(conversation, seq))
        try:
            span = self._start(name, conversation, cause, kind=trace.SpanKind.INTERNAL,
                               attributes=attrs, links=links)
        finally:
            _next_span_id.reset(derived)
        token = context.attach(trace.set_span_in_context(span))
        return (span, token, _conversation.set(conversation))

    def detach(self, token: Any) -> Any:
        """The handler has returned: later spans of the task are no longer its
        children. Returns its span, open until `end_handler`."""
        from opentelemetry import context

        span, attached, conversation = token
        context.detach(attached)
        _conversation.reset(conversation)
        return span

    def end_handler(self, span: Any, outcome: str, code: str = "") -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("agentd.outcome", outcome)
        if code:
            span.add_event("agentd.huh", {"code": code})
        if outcome != "ok":
            span.set_attribute("error.type", code or outcome)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def chat(self, backend: str, model: str, request: Any = None) -> Any:
        from opentelemetry.trace import SpanKind

        conversation = _conversation.get()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": model or backend,
            "agentd.backend": backend,
        }
        if conversation:
            attrs["gen_ai.conversation.id"] = conversation
        if self.capture and request is not None:
            attrs["gen_ai.input.messages"] = _json(input_messages(request, self._scrub))
            if request.system:
                attrs["gen_ai.system_instructions"] = _json(
                    [{"type": "text", "content": self._scrub(request.system)}])
        return self.tracer.start_span(f"chat {model or backend}", kind=SpanKind.CLIENT,
                                      attributes=attrs)

    def end_chat(self, token: Any, *, outcome: str, response_model: str = "",
                 input_tokens: int = 0, output_tokens: int = 0, finish_reason: str = "",
                 error: str = "", response: Any = None, first_s: float | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span = token
        if outcome == "ok":
            span.set_attributes({
                "gen_ai.response.model": response_model,
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else [],
            })
            if first_s is not None:  # streamed: the time to the first chunk of text
                span.set_attribute("agentd.time_to_first_chunk_s", round(first_s, 6))
            if self.capture and response is not None:
                span.set_attribute("gen_ai.output.messages",
                                   _json(output_messages(response, self._scrub)))
        else:
            span.set_attribute("error.type", error or outcome)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def content(self, request: Any, response: Any) -> dict[str, Any]:
        """With `capture_content`, an LLM call's messages for its journal record
        (`agentctl trace --content`), redacted as in spans; otherwise nothing."""
        if not self.capture:
            return {}
        return {"content": {"system": self._scrub(request.system),
                            "input": input_messages(request, self._scrub),
                            "output": output_messages(response, self._scrub)}}

    def _scrub(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, "[redacted]")
        return text

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is queued (bounded by the timeout)


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def input_messages(request: Any, scrub: Any) -> list[dict[str, Any]]:
    """`gen_ai.input.messages` as the GenAI conventions shape them (role and parts):
    text, the model's tool calls and their results, each text through `scrub`."""
    out = []
    for message in request.messages:
        parts: list[dict[str, Any]] = [
            {"type": "tool_call_response", "id": r.call_id, "response": scrub(r.content)}
            for r in message.results]
        if message.content:
            parts.append({"type": "text", "content": scrub(message.content)})
        parts.extend({"type": "tool_call", "id": c.id, "name": c.name,
                      "arguments": scrub(c.arguments)} for c in message.calls)
        out.append({"role": message.role, "parts": parts})
    return out


def output_messages(response: Any, scrub: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if response.text:
        parts.append({"type": "text", "content": scrub(response.text)})
    parts.extend({"type": "tool_call", "id": c.id, "name": c.name,
                  "arguments": scrub(c.arguments)} for c in response.calls)
    return [{"role": "assistant", "parts": parts,
             "finish_reason": response.finish_reason or "stop"}]


def secret_values(config: object) -> set[str]:
    """What content capture must never show: every `env` value in the configuration
    (tools, MCP servers, isolation workers) and the value of every `*_env` variable
    it names (an API key read from the environment)."""
    import dataclasses
    import os

    found: set[str] = set()

    def walk(value: object, depth: int) -> None:
        if depth > 12:
            return
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                item = getattr(value, f.name, None)
                if f.name == "env" and isinstance(item, Mapping):
                    found.update(str(v) for v in item.values())
                elif f.name.endswith("_env") and isinstance(item, str):
                    found.add(os.environ.get(item, ""))
                else:
                    walk(item, depth + 1)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth + 1)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item, depth + 1)

    walk(config, 0)
    found.discard("")
    return found


def configure(cfg: TelemetryConfig | None, organism: str, base_dir: Path | None = None,
              secrets: Iterable[str] = ()) -> Any:
    """Install the tracer for `cfg` (None: `OFF`) and return it. Raises ConfigError
    when the SDK is not installed or the headers file is bad. `secrets`: values
    captured content must never show (see `secret_values`)."""
    global TRACER
    if cfg is None:
        TRACER = OFF
        return TRACER
    from agentd._errors import ConfigError

    headers = {}
    if cfg.headers_file is not None:
        path = cfg.headers_file if base_dir is None else base_dir / cfg.headers_file
        try:
            headers = read_headers(path)
        except OSError as exc:
            raise ConfigError([f"telemetry.headers_file: {exc}"]) from None
    try:
        TRACER = On(cfg, organism, headers, secrets)
    except ImportError as exc:
        raise ConfigError([f"telemetry: the OpenTelemetry SDK is not installed ({exc.name}); "
                           "install agentd[telemetry] (grpc: also "
                           "opentelemetry-exporter-otlp-proto-grpc) or remove the section"]
                          ) from None
    log.info("telemetry: traces to %s (%s), service %s, sample ratio %s",
             cfg.otlp_endpoint, cfg.protocol, cfg.service_name or organism, cfg.sample_ratio)
    return TRACER


def shutdown() -> None:
    """Flush and stop the exporter (blocking: call it off the event loop)."""
    global TRACER
    tracer, TRACER = TRACER, OFF
    tracer.shutdown()
