"""The LLM router: picks backends by strategy, retries, fails over, caches.

- `failover`: the preferred backend (the agent's `model`) first, then the others in
  configuration order. `round-robin`: every call starts at the next backend in
  rotation and fails over along the ring.
- Per backend, an attempt that failed with a retryable error (429, 5xx, timeout,
  connection) is retried up to `llm.retries` times after an exponential backoff
  with jitter, or after exactly `Retry-After` when the provider says so (a
  `Retry-After` longer than `max_retry_after_s` moves on to the next backend instead
  of stalling the agent). 401/403/404 and replay misses move on at once. Any other
  4xx is the request's fault: no retry, no failover, the error is raised.
- A response cache (TTL `llm.cache_ttl_s`) keyed by the assembled request answers
  identical requests without a call.
- Streamed (`complete(..., sink=)`): an attempt that fails before any text reached
  the sink is retried or failed over as above, unseen; one that fails after it
  ends its stream interrupted (`sink.interrupted()`) and is then retried or failed
  over by the same rules, so the caller gets one response, never two.

`agentd_llm_requests_total{backend,outcome}` counts every attempt and cache hit.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agentd import _metrics as metrics
from agentd.config import LlmConfig
from agentd.llm._backends import Backend, HttpBackend, ReplayBackend
from agentd.llm._cache import ResponseCache
from agentd.llm._cassette import Cassette
from agentd.llm._http import HttpPool
from agentd.llm._limits import Clock, MonotonicClock
from agentd.llm._types import (
    BackendError,
    LlmError,
    LlmRequest,
    LlmResponse,
    NoBackendAvailable,
    RequestTooLarge,
    TextSink,
)
from agentd.telemetry import tracer

log = logging.getLogger("agentd.llm.router")


class LlmRouter:
    def __init__(
        self,
        config: LlmConfig,
        *,
        env: Mapping[str, str] | None = None,
        clock: Clock | None = None,
        rng: Callable[[], float] = random.random,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 20.0,
        max_retry_after_s: float = 60.0,
    ) -> None:
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self._rng = rng
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_retry_after_s = max_retry_after_s
        total = sum(b.max_concurrency for b in config.backends) or 1
        self._client = HttpPool(total)
        self.backends: dict[str, Backend] = {}
        for i, bcfg in enumerate(config.backends):
            if bcfg.provider == "replay":
                assert bcfg.cassette is not None  # the configuration loader requires it
                cassette = Cassette.load(bcfg.cassette, f"llm.backends[{i}].cassette")
                self.backends[bcfg.name] = ReplayBackend(bcfg, self.clock, cassette)
            else:
                self.backends[bcfg.name] = HttpBackend(bcfg, self.clock, self._client, env)
        self.cache = ResponseCache(config.cache_ttl_s, self.clock)
        self._ring = 0

    def order(self, prefer: str | None = None, *, only: bool = False) -> list[Backend]:
        """The backends one call may try, in order. `only`: `prefer` alone (no
        failover, no rotation): a caller whose data may go to that backend only."""
        if only:
            chosen = self.backends.get(prefer) if prefer is not None else None
            return [chosen] if chosen is not None else []
        ring = list(self.backends.values())
        if not ring:
            return []
        if self.config.strategy == "round-robin":
            start = self._ring % len(ring)
            self._ring = start + 1
            return ring[start:] + ring[:start]
        first = self.backends.get(prefer) if prefer is not None else None
        return [first, *(b for b in ring if b is not first)] if first else ring

    def backoff(self, attempt: int, retry_after: float | None) -> float | None:
        """Seconds before retry number `attempt + 1`; None: do not wait, fail over."""
        if retry_after is not None:
            return retry_after if retry_after <= self.max_retry_after_s else None
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        return ceiling / 2 + self._rng() * ceiling / 2  # "equal jitter"

    async def complete(self, request: LlmRequest, *, prefer: str | None = None,
                       only: bool = False, sink: TextSink | None = None) -> LlmResponse:
        cache_key = f"{prefer or ''}\n{request.key}"
        hit = self.cache.get(cache_key)
        if hit is not None:
            metrics.llm_requests.labels(hit.backend, "cache_hit").inc()
            if sink is not None and hit.text:
                sink.piece(hit.text)
            return hit
        errors: list[BackendError | LlmError] = []
        attempts = 0
        transport_s = 0.0
        for backend in self.order(prefer, only=only):
            try:
                backend.precheck(request)
            except RequestTooLarge as exc:
                metrics.llm_requests.labels(backend.name, "too_large").inc()
                errors.append(exc)
                continue
            for attempt in range(self.config.retries + 1):
                attempts += 1
                span = tracer().chat(backend.name, getattr(backend, "model", ""), request)
                sent = time.perf_counter()
                watched = _Watched(sink) if sink is not None else None
                try:
                    response = await backend.attempt(request, watched)
                except BackendError as err:
                    observe_attempt(backend.name, sent, span, err)
                    if watched is not None and watched.sent:
                        watched.interrupted()
                    delay = (
                        self.backoff(attempt, err.retry_after)
                        if err.retryable and attempt < self.config.retries else None
                    )
                    metrics.llm_requests.labels(
                        backend.name, "retry" if delay is not None else "error"
                    ).inc()
                    log.warning("llm attempt failed: %s%s", err,
                                f"; retrying in {delay:.2f}s" if delay is not None else "")
                    if delay is None:
                        errors.append(err)
                        if not err.failover:
                            raise err
                        break
                    await self.clock.sleep(delay)
                    continue
                metrics.llm_requests.labels(backend.name, "ok").inc()
                observe_attempt(backend.name, sent, span, None, response,
                                watched.first - sent if watched and watched.sent else None)
                response = dataclasses.replace(
                    response, attempts=attempts, transport_s=transport_s + response.transport_s
                )
                self.cache.put(cache_key, response)
                return response
        if errors and all(isinstance(e, RequestTooLarge) for e in errors):
            raise errors[0]
        raise NoBackendAvailable(errors)

    async def aclose(self) -> None:
        for backend in self.backends.values():
            await backend.aclose()
        await self._client.aclose()

    @property
    def names(self) -> Sequence[str]:
        return tuple(self.backends)


class _Watched:
    """A sink that knows whether an attempt sent it anything."""

    __slots__ = ("first", "sent", "sink")

    def __init__(self, sink: TextSink) -> None:
        self.sink = sink
        self.sent = False
        self.first = 0.0  # perf_counter() at the first piece (its chat span's)

    def piece(self, text: str) -> None:
        if not self.sent:
            self.sent = True
            self.first = time.perf_counter()
        self.sink.piece(text)

    def interrupted(self) -> None:
        self.sink.interrupted()


def observe_attempt(backend: str, sent: float, span: Any, error: BaseException | None,
                    response: LlmResponse | None = None, first_s: float | None = None
                    ) -> None:
    """One attempt's latency (`agentd_llm_latency_seconds`) and its `chat` span
    (`first_s`: a streamed reply's time to its first text)."""
    metrics.llm_latency.labels(backend, "ok" if error is None else "error").observe(
        time.perf_counter() - sent)
    if span is None:
        return
    if response is not None:
        tracer().end_chat(span, outcome="ok", response_model=response.model,
                          input_tokens=response.input_tokens,
                          output_tokens=response.output_tokens,
                          finish_reason=response.finish_reason, response=response,
                          first_s=first_s)
    else:
        tracer().end_chat(span, outcome="error", error=type(error).__name__)
