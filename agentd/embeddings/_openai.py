"""`openai`: vectors from an OpenAI-compatible `/v1/embeddings` endpoint (OpenAI,
Ollama, vLLM, llama.cpp server) of an `llm.backends` entry.

The wire part is sans I/O (`encode_request`, `decode_response`); `OpenAIEmbedder`
sends through its own `HttpPool` (agentd.llm). The backend's `base_url`, `api_key_env` (read at
every call, never logged) and `timeout_s` apply; errors are classified as for chat
calls (retry 408/409/429/5xx after a backoff or `Retry-After`, up to `llm.retries`
times; anything else fails at once). Each attempt counts in
`agentd_llm_requests_total{backend,outcome}` and the reported input tokens in
`agentd_llm_tokens_total{agent="embeddings",backend,kind="input"}`.

A reply is checked before use: one finite vector per input, all of one
dimension, at most `MAX_DIMENSIONS` wide and the same width as the embedder's
first reply, and no longer than its inputs' vectors can take (at most
`MAX_RESPONSE_BYTES`); anything else is an error, never a silently wrong ranking
or a vector that cannot be compared with those stored before it. A long reply is
decoded off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from agentd import _metrics as metrics
from agentd.config import LlmBackendConfig
from agentd.embeddings._protocol import EmbedderIdentity, EmbeddingsError
from agentd.embeddings._vectors import Matrix, Vector, unit_rows
from agentd.llm import (
    BackendError,
    ConnectionFailed,
    HttpPool,
    ResponseTooLarge,
    classify,
    post_bounded,
)

log = logging.getLogger("agentd.embeddings")

DEFAULT_BASE_URL = "https://api.openai.com/v1"
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
MAX_DIMENSIONS = 8192  # the widest common models have 3,072 (OpenAI) or 4,096
_BYTES_PER_VALUE = 32  # a float in JSON with its separator, generously
_INLINE_DECODE_BYTES = 1 << 20  # decoded on the event loop below this size
BATCH = 128  # inputs per request


def reply_limit(count: int) -> int:
    """The most bytes a reply of `count` vectors can need."""
    return min(MAX_RESPONSE_BYTES, 65536 + count * MAX_DIMENSIONS * _BYTES_PER_VALUE)


def encode_request(model: str, texts: Sequence[str]) -> bytes:
    body = {"model": model, "input": list(texts), "encoding_format": "float"}
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def decode_response(body: bytes, count: int) -> tuple[Matrix, int | None]:
    """The rows in input order and the reported input tokens; raises
    `EmbeddingsError` on any reply that is not exactly `count` finite vectors."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise EmbeddingsError("embeddings reply is not JSON") from None
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list) or len(data) != count:
        raise EmbeddingsError(f"embeddings reply does not hold {count} vectors")
    rows: list[Any] = [None] * count
    for position, item in enumerate(data):
        index = item.get("index", position) if isinstance(item, dict) else None
        vector = item.get("embedding") if isinstance(item, dict) else None
        if (
            not isinstance(index, int) or isinstance(index, bool)
            or not 0 <= index < count or rows[index] is not None
            or not isinstance(vector, list) or not vector
        ):
            raise EmbeddingsError("embeddings reply has a malformed or repeated entry")
        if len(vector) > MAX_DIMENSIONS:
            raise EmbeddingsError(f"embeddings reply has more than {MAX_DIMENSIONS} dimensions")
        rows[index] = vector
    try:
        wide = np.asarray(rows)  # numbers only: "1" (a string) or true is no coordinate
    except (ValueError, TypeError):
        raise EmbeddingsError("embeddings reply holds vectors of different sizes") from None
    if wide.dtype.kind not in "if":
        raise EmbeddingsError("embeddings reply holds non-numeric or non-finite values")
    wide = wide.astype(np.float64)
    limit = float(np.finfo(np.float32).max)
    if wide.ndim != 2 or not np.all(np.isfinite(wide)) or np.any(np.abs(wide) > limit):
        raise EmbeddingsError("embeddings reply holds non-numeric or non-finite values")
    matrix = wide.astype(np.float32)
    usage = obj.get("usage")
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    valid = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    return unit_rows(matrix), tokens if valid else None


class OpenAIEmbedder:
    corpus_relative = False

    def __init__(
        self,
        backend: LlmBackendConfig,
        model: str,
        *,
        retries: int = 3,
        env: Mapping[str, str] | None = None,
        backoff_base_s: float = 0.5,
    ) -> None:
        if backend.provider != "openai":
            raise EmbeddingsError(
                f"embeddings backend {backend.name} speaks {backend.provider}; "
                "only an openai-compatible backend has /v1/embeddings"
            )
        self.backend = backend
        self.model = model
        self.identity = EmbedderIdentity("openai", model)
        self.dimensions: int | None = None  # the width of the first reply, kept
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self._url = (backend.base_url or DEFAULT_BASE_URL).rstrip("/") + "/embeddings"
        self._env = os.environ if env is None else env
        self._client = HttpPool(backend.max_concurrency)
        self._slots = asyncio.Semaphore(backend.max_concurrency)

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json"}
        var = self.backend.api_key_env
        if var is not None:
            value = self._env.get(var)
            if not value:
                raise EmbeddingsError(
                    f"embeddings backend {self.backend.name}: environment variable {var} "
                    "is not set"
                )
            headers["authorization"] = f"Bearer {value}"
        return headers

    async def _attempt(self, body: bytes, count: int) -> Matrix:
        name = self.backend.name
        try:
            async with self._slots:
                status, headers, content = await post_bounded(
                    self._client, self._url, body, self._headers(), self.backend.timeout_s,
                    reply_limit(count))
        except TimeoutError:
            raise BackendError(name, "timed out", retryable=True) from None
        except ResponseTooLarge:
            raise EmbeddingsError(f"embeddings backend {name}: reply too large") from None
        except ConnectionFailed as exc:
            raise BackendError(name, f"connection failed ({exc})", retryable=True) from None
        if not 200 <= status < 300:
            raise classify(name, status, headers, content[:4096])
        if len(content) < _INLINE_DECODE_BYTES:
            matrix, tokens = decode_response(content, count)
        else:
            matrix, tokens = await asyncio.to_thread(decode_response, content, count)
        width = matrix.shape[1]
        if self.dimensions is None:
            self.dimensions = width
        elif width != self.dimensions:
            raise EmbeddingsError(f"embeddings backend {name}: a reply of {width} dimensions "
                                  f"after replies of {self.dimensions}")
        if tokens:
            metrics.llm_tokens.labels("embeddings", name, "input").inc(tokens)
        return matrix

    async def _batch(self, texts: Sequence[str]) -> Matrix:
        body = encode_request(self.model, texts)
        name = self.backend.name
        for attempt in range(self.retries + 1):
            try:
                matrix = await self._attempt(body, len(texts))
            except BackendError as err:
                again = err.retryable and attempt < self.retries
                metrics.llm_requests.labels(name, "retry" if again else "error").inc()
                log.warning("embeddings attempt failed: %s", err)
                if not again:
                    raise EmbeddingsError(f"embeddings: {err}") from None
                delay = err.retry_after
                if delay is None:
                    delay = self.backoff_base_s * (2**attempt)
                await asyncio.sleep(min(delay, 60.0))
                continue
            except EmbeddingsError:
                metrics.llm_requests.labels(name, "error").inc()
                raise
            metrics.llm_requests.labels(name, "ok").inc()
            return matrix
        raise AssertionError("unreachable")  # pragma: no cover

    async def embed_documents(self, texts: Sequence[str]) -> Matrix:
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        parts = [await self._batch(texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)]
        if len({p.shape[1] for p in parts}) != 1:
            raise EmbeddingsError("embeddings reply holds vectors of different sizes")
        return np.vstack(parts)

    async def embed_query(self, text: str, corpus: Sequence[str] = ()) -> Vector:
        return (await self._batch([text]))[0]

    async def aclose(self) -> None:
        await self._client.aclose()
