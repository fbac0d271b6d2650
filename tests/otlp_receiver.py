"""A real OTLP/HTTP trace receiver on loopback, built on opentelemetry-proto's own
message classes: POST /v1/traces with an `ExportTraceServiceRequest` body (what
any OTLP exporter sends), the spans kept for the test to read."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]
    service: str
    kind: int
    start: int = 0


@dataclass
class OtlpReceiver:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def __enter__(self) -> OtlpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request, {k.lower(): v for k, v in self.headers.items()})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got = []
        for rs in request.resource_spans:
            res = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes},
                        [(e.name, {a.key: _value(a.value) for a in e.attributes})
                         for e in s.events],
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        str(res.get("service.name", "")), s.kind, s.start_time_unix_nano))
        with self._changed:
            self.requests += 1
            self.headers.append(headers)
            self.spans.extend(got)
            self._changed.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> list[Span]:
        """The spans once `predicate(spans)` holds (waits for exports, not a sleep)."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.spans), timeout):
                raise TimeoutError(f"spans received: {[s.name for s in self.spans]}")
            return list(self.spans)


def tree(spans: list[Span], trace_id: str, skip: frozenset[str] = frozenset({"agentd.commit"})
         ) -> list[Any]:
    """The trace's spans nested by parent, as `[name, [children...]]` in start order
    (a span whose parent was not received is a root); spans named in `skip` left out,
    their children lifted to their place."""
    mine = [s for s in spans if s.trace_id == trace_id]
    ids = {s.span_id for s in mine}
    children: dict[str, list[Span]] = {}
    for s in mine:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)

    def nodes(parent: str) -> list[Any]:
        out: list[Any] = []
        for s in sorted(children.get(parent, []), key=lambda x: x.start):
            if s.name in skip:
                out.extend(nodes(s.span_id))
            else:
                out.append([s.name, nodes(s.span_id)])
        return out

    return nodes("")


if __name__ == "__main__":  # a receiver in a process of its own (benchmarks/telemetry.py)
    import sys

    with OtlpReceiver() as running:
        print(running.url, flush=True)
        sys.stdin.read()  # until the parent closes it
        print(len(running.spans), flush=True)
