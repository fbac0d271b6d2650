"""OpenTelemetry traces, when the organism has a `telemetry:` section.

`TRACER` is what the pump, the LLM router and the daemon call, one line each.
Without the section it is `OFF`, whose methods return at once: no OpenTelemetry
module is imported and no span object is built, and `OTEL_*` environment
variables change nothing (the SDK is only ever given explicit settings, and its
tracer provider is never made the process's global one).

With it, `configure` builds a tracer provider with a batch span processor (a
bounded queue drained by the SDK's own thread: ending a span never waits for the
network, a full queue drops spans) and an OTLP exporter. Invariants:

- One trace per client thread: the trace id is the thread UUID's 128 bits, so
  work resumed after a restart lands in the same trace without storing anything.
- A handler call's span id is derived (through the SDK's id generator) from the
  conversation and the journal seq of the message it handles; a redelivered
  message's span gets a new id and a link to the interrupted one (never exported:
  a span is exported when it ends, and work the journal shows done is not
  redelivered).
- No payload, prompt or completion is put in a span (content capture is not
  implemented; `capture_content` is accepted and has no effect yet).
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import uuid
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

_SCHEDULE_MS = 2000  # exported within this of ending (the contract allows 10 s)
_QUEUE = 4096  # spans waiting for export; beyond it, dropped (never blocks)
_BATCH = 512


class Off:
    """No telemetry: every call returns at once and builds nothing."""

    enabled = False

    def handler(self, listener: str, agent: bool, conversation: str, seq: int,
                redelivered: bool) -> None:
        return None

    def end_handler(self, token: Any, outcome: str, code: str = "") -> None:
        return None

    def chat(self, backend: str, model: str) -> None:
        return None

    def end_chat(self, token: Any, *, outcome: str, response_model: str = "",
                 input_tokens: int = 0, output_tokens: int = 0, finish_reason: str = "",
                 error: str = "") -> None:
        return None

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
    """The SDK's id generator, but a handler span takes the id derived for it."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class DerivedIds(RandomIdGenerator):
        def generate_span_id(self) -> int:
            return _next_span_id.get() or super().generate_span_id()

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

    def __init__(self, cfg: TelemetryConfig, organism: str, headers: dict[str, str]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

        from agentd import __version__

        self.cfg = cfg
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

    def _root(self, conversation: str) -> Any:
        """The context of the conversation's root: a parent every handler span of
        the thread hangs from, with the trace id of the thread."""
        from opentelemetry import trace

        ctx = trace.SpanContext(trace_id_of(conversation), _span_id(conversation),
                                is_remote=True, trace_flags=trace.TraceFlags(1))
        return trace.set_span_in_context(trace.NonRecordingSpan(ctx))

    def handler(self, listener: str, agent: bool, conversation: str, seq: int,
                redelivered: bool) -> Any:
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
            span = self.tracer.start_span(name, context=self._root(conversation),
                                          kind=trace.SpanKind.INTERNAL, attributes=attrs,
                                          links=links)
        finally:
            _next_span_id.reset(derived)
        token = context.attach(trace.set_span_in_context(span))
        return (span, token, _conversation.set(conversation))

    def end_handler(self, token: Any, outcome: str, code: str = "") -> None:
        from opentelemetry import context
        from opentelemetry.trace import Status, StatusCode

        span, attached, conversation = token
        span.set_attribute("agentd.outcome", outcome)
        if code:
            span.add_event("agentd.huh", {"code": code})
        if outcome != "ok":
            span.set_attribute("error.type", code or outcome)
            span.set_status(Status(StatusCode.ERROR))
        span.end()
        context.detach(attached)
        _conversation.reset(conversation)

    def chat(self, backend: str, model: str) -> Any:
        from opentelemetry.trace import SpanKind

        conversation = _conversation.get()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": model or backend,
            "agentd.backend": backend,
        }
        if conversation:
            attrs["gen_ai.conversation.id"] = conversation
        return self.tracer.start_span(f"chat {model or backend}", kind=SpanKind.CLIENT,
                                      attributes=attrs)

    def end_chat(self, token: Any, *, outcome: str, response_model: str = "",
                 input_tokens: int = 0, output_tokens: int = 0, finish_reason: str = "",
                 error: str = "") -> None:
        from opentelemetry.trace import Status, StatusCode

        span = token
        if outcome == "ok":
            span.set_attributes({
                "gen_ai.response.model": response_model,
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
                "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else [],
            })
        else:
            span.set_attribute("error.type", error or outcome)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what is queued (bounded by the timeout)


def configure(cfg: TelemetryConfig | None, organism: str, base_dir: Path | None = None) -> Any:
    """Install the tracer for `cfg` (None: `OFF`) and return it. Raises ConfigError
    when the SDK is not installed or the headers file is bad."""
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
        TRACER = On(cfg, organism, headers)
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
