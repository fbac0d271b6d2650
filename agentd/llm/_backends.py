"""Backends: one configured LLM endpoint each, with its own limits.

Every attempt passes, in order: the size check against the token-per-minute bucket
(a request that can never fit fails at once), the requests-per-minute bucket, the
tokens-per-minute bucket (charged with the estimate, corrected with the provider's
reported usage afterwards), and the concurrency limit. Then the backend sends:

- `HttpBackend` speaks a wire protocol (`_wire`) over the router's `HttpPool`. The API
  key is read from the environment variable named in the configuration at every
  attempt and is never logged, cached or recorded. With `record:`, each successful
  exchange is appended to a cassette. A backend is not trusted with the daemon's
  resources: an attempt has `timeout_s` in all (not per read: a server dripping a
  byte at a time is cut off), the body is read up to `MAX_RESPONSE_BYTES`, and the
  usage it reports is bounded by what the request could have cost (input: four
  times the estimate and 1,024 tokens; output: `max_tokens`) before it reaches the
  token buckets or a conversation's budget.
  Given a `TextSink`, the call is streamed (`_stream`): each piece of visible text
  goes to the sink as it arrives, and the reply is decoded from the stream into the
  same response (usage from the stream's usage chunk, bounded the same way). A
  stream that breaks before its end is a retryable error, like a dropped
  connection; the router tells the sink the stream was interrupted.
- `ReplayBackend` answers from a cassette, with no network at all (streamed: the
  recorded text as one piece).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from agentd import _metrics as metrics
from agentd.config import LlmBackendConfig
from agentd.llm._cassette import Cassette, CassetteRecorder
from agentd.llm._http import (
    ConnectionFailed,
    HttpPool,
    ResponseTooLarge,
    post_bounded,
    post_streamed,
)
from agentd.llm._limits import Clock, TokenBucket
from agentd.llm._stream import SseParser, stream_decoder
from agentd.llm._types import (
    BackendError,
    LlmRequest,
    LlmResponse,
    ReplayMiss,
    RequestTooLarge,
    TextSink,
)
from agentd.llm._wire import DEFAULT_BASE_URLS, PROTOCOLS, Decoded, classify

log = logging.getLogger("agentd.llm")


class Backend:
    def __init__(self, config: LlmBackendConfig, clock: Clock) -> None:
        self.config = config
        self.name = config.name
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self.in_flight = 0
        self.rpm = (
            TokenBucket.per_minute(config.requests_per_minute, clock, "requests")
            if config.requests_per_minute else None
        )
        self.tpm = (
            TokenBucket.per_minute(config.tokens_per_minute, clock, "tokens")
            if config.tokens_per_minute else None
        )

    @staticmethod
    def cost(request: LlmRequest) -> int:
        """Tokens reserved in the TPM bucket before the call."""
        return request.estimated_input_tokens + request.max_tokens

    def precheck(self, request: LlmRequest) -> None:
        """Raise `RequestTooLarge` if the request can never pass this backend's limits."""
        cost = self.cost(request)
        if self.tpm is not None and cost > self.tpm.capacity:
            raise RequestTooLarge(
                f"backend {self.name}: the request needs about {cost} tokens (input "
                f"~{request.estimated_input_tokens} + max_tokens {request.max_tokens}) but "
                f"tokens_per_minute is {self.tpm.capacity:.0f}; it can never be sent"
            )

    async def attempt(self, request: LlmRequest, sink: TextSink | None = None) -> LlmResponse:
        self.precheck(request)
        cost = self.cost(request)
        if self.rpm is not None:
            await self.rpm.take(1)
        if self.tpm is not None:
            await self.tpm.take(cost)
        try:
            async with self._slots:
                self.in_flight += 1
                try:
                    response = await self.send(request, sink)
                finally:
                    self.in_flight -= 1
        except BaseException:
            if self.tpm is not None:
                self.tpm.adjust(-cost)  # a failed attempt is not billed
            raise
        if self.tpm is not None:
            self.tpm.adjust(response.total_tokens - cost)
        return response

    async def send(
        self, request: LlmRequest, sink: TextSink | None = None
    ) -> LlmResponse:  # pragma: no cover
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


class HttpBackend(Backend):
    def __init__(
        self,
        config: LlmBackendConfig,
        clock: Clock,
        client: HttpPool,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(config, clock)
        self.protocol = PROTOCOLS[config.provider]
        self.base_url = config.base_url or DEFAULT_BASE_URLS[config.provider]
        self.model = config.model or ""
        self._client = client
        self._env = os.environ if env is None else env
        self.recorder = CassetteRecorder(Path(config.record)) if config.record else None
        self.refuses_tools = False  # answered 400 to tools once: sent without them since

    def _api_key(self) -> str | None:
        var = self.config.api_key_env
        if var is None:
            return None
        value = self._env.get(var)
        if not value:
            raise BackendError(self.name, f"environment variable {var} is not set")
        return value

    async def send(self, request: LlmRequest, sink: TextSink | None = None) -> LlmResponse:
        """One exchange. An `openai` backend that answered 400 to a request with tools
        (a server without tool support) is logged once, asked again without them, and
        asked without them from then on, when the request allows it (`auto`)."""
        if not (request.tools and request.tools_optional):
            return await self._exchange(request, sink)
        if not self.refuses_tools:
            try:
                return await self._exchange(request, sink)
            except BackendError as err:
                if err.status != 400 or self.protocol.name != "openai":
                    raise
                self.refuses_tools = True
                log.warning("backend %s answered HTTP 400 to a request with tools (%s): "
                            "its agents call tools with XML payloads from now on",
                            self.name, err.message)
        response = await self._exchange(request.without_tools(), sink)
        return dataclasses.replace(response, without_tools=True)

    async def _exchange(self, request: LlmRequest, sink: TextSink | None = None) -> LlmResponse:
        http = self.protocol.encode(
            request, base_url=self.base_url, model=self.model, api_key=self._api_key(),
            stream=sink is not None,
        )
        started = time.perf_counter()
        streamed: _Streamed | None = None
        try:
            if sink is None:
                status, headers, content = await post_bounded(
                    self._client, http.url, http.body, http.headers, self.config.timeout_s)
            else:
                streamed = _Streamed(self.name, self.protocol.name, sink, started)
                status, headers, content = await post_streamed(
                    self._client, http.url, http.body, http.headers, self.config.timeout_s,
                    streamed.chunk)
        except TimeoutError:
            raise BackendError(self.name, "timed out", retryable=True) from None
        except ResponseTooLarge as exc:
            raise BackendError(self.name, str(exc)) from None
        except BackendError as err:  # the stream said so, or could not be read
            raise dataclasses.replace(err, backend=self.name) from None
        except ConnectionFailed as exc:
            raise BackendError(self.name, f"connection failed ({exc})", retryable=True) from None
        transport_s = time.perf_counter() - started
        if not 200 <= status < 300:
            raise classify(self.name, status, headers, content)
        try:
            decoded = self.protocol.decode(content) if streamed is None else streamed.finish()
        except BackendError as err:
            raise dataclasses.replace(err, backend=self.name) from None
        estimate = (len(decoded.text.encode())
                    + sum(len(c.arguments.encode()) + len(c.name) for c in decoded.calls) + 3) // 4
        response = LlmResponse(
            text=decoded.text,
            input_tokens=self._bounded(
                "input", decoded.input_tokens, request.estimated_input_tokens,
                4 * request.estimated_input_tokens + 1024),
            output_tokens=self._bounded(
                "output", decoded.output_tokens, estimate,
                max(request.max_tokens, estimate)),
            backend=self.name,
            model=decoded.model or self.model,
            finish_reason=decoded.finish_reason,
            transport_s=transport_s,
            calls=decoded.calls,
        )
        if self.recorder is not None:
            self.recorder.append(request, response)
        return response

    def _bounded(self, what: str, reported: int | None, estimate: int, most: int) -> int:
        """The usage a backend reported, or `estimate` when it reported none; at most
        `most` (what the request could have cost), so a hostile or broken server
        cannot drain a conversation's budget or lock the token buckets; and at least
        a quarter of `estimate` (bytes / 16: no tokenizer packs more into a token), so
        one reporting nothing (0) cannot make budgets count nothing either."""
        if reported is None:
            return estimate
        counted = min(max(reported, estimate // 4), most)  # estimate // 4 <= most always
        if counted != reported:
            log.warning("llm backend=%s reported an impossible %d %s tokens; counting %d",
                        self.name, reported, what, counted)
        return counted


class _Streamed:
    """One streamed reply as it arrives: SSE parsed, text pieces to the sink, the
    time to the first byte observed."""

    def __init__(self, backend: str, provider: str, sink: TextSink, started: float) -> None:
        self.backend = backend
        self.parser = SseParser(backend)
        self.decoder = stream_decoder(provider)
        self.sink = sink
        self.started = started
        self.first = True

    def chunk(self, data: bytes) -> None:
        if self.first and data:
            self.first = False
            metrics.llm_time_to_first_token.labels(self.backend).observe(
                time.perf_counter() - self.started)
        for event in self.parser.feed(data):
            for piece in self.decoder.feed(event):
                self.sink.piece(piece)

    def finish(self) -> Decoded:
        # An event the server did not end with a blank line.
        for event in self.parser.feed(b"\n\n"):
            for piece in self.decoder.feed(event):
                self.sink.piece(piece)
        return self.decoder.finish()


class ReplayBackend(Backend):
    def __init__(self, config: LlmBackendConfig, clock: Clock, cassette: Cassette) -> None:
        super().__init__(config, clock)
        self.cassette = cassette

    async def send(self, request: LlmRequest, sink: TextSink | None = None) -> LlmResponse:
        exchange = self.cassette.lookup(request)
        if exchange is None:
            raise ReplayMiss(self.name, f"no recorded exchange for request {request.key[:16]}")
        response = exchange.to_response(self.name)
        if sink is not None and response.text:
            sink.piece(response.text)
        return response
