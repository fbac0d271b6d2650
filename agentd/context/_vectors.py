r"""Vectors for relevance and recall: the `TextVectors` seam and a numpy index.

`TextVectors.vectors(texts)` returns one unit row per text; `identity` names the
provider and model, and is stored beside each vector so that a change of provider
re-embeds. Two kinds:

- `ProviderVectors`: an absolute provider of `agentd.embeddings` (`openai`, `local`),
  whose vector of a text does not depend on other texts;
- `HashedTerms`: for `embeddings: {provider: lexical}` and as the fallback when a
  provider fails. Lexical BM25 vectors are fit over a corpus, so they cannot be
  stored beside a memory and compared later; these are the storable lexical kind:
  lower-cased `\\w+` terms (the same stop words removed), sub-linear term frequency,
  hashed into a fixed number of dimensions. Nothing to load.

`VectorIndex` holds rows in one contiguous float32 matrix (grown by doubling), so a
search is one matrix-vector product. Exact search over n rows of d dimensions costs
n·d multiply-adds: about 25 M for 100,000 memories of 256 dimensions, a few
milliseconds; past a few million rows an approximate index (sqlite-vec, or a vector
store such as FAISS or hnswlib) should replace it behind the same `search` call.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from agentd.config import EmbeddingsConfig, LlmConfig
from agentd.embeddings import Embedder, build_embedder, tokens


class TextVectors(Protocol):
    @property
    def identity(self) -> str: ...

    async def vectors(self, texts: Sequence[str]) -> np.ndarray: ...


def terms(text: str) -> list[str]:
    """The lexical provider's terms (`\\w+`, lower case, its stop words removed); XML
    tags are read as text too (element names say what a result is about)."""
    return tokens(text)


class ProviderVectors:
    """An absolute provider of `agentd.embeddings` as `TextVectors`."""

    def __init__(self, provider: Embedder) -> None:
        if provider.corpus_relative:
            raise ValueError("a corpus-relative provider's vectors cannot be stored")
        self._provider = provider

    @property
    def identity(self) -> str:
        return self._provider.identity.key

    async def vectors(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 1), dtype=np.float32)
        return np.asarray(await self._provider.embed_documents(texts), dtype=np.float32)


def text_vectors(config: EmbeddingsConfig, llm: LlmConfig | None, **provider_options: Any
                 ) -> TextVectors:
    """The vectors the `embeddings:` section asks for (see the module docstring);
    `provider_options` (env) go to `build_embedder`."""
    if config.provider == "lexical":
        return HashedTerms()
    return ProviderVectors(build_embedder(config, llm, **provider_options))


_CACHED_TERMS = 200_000
_CACHED_TERM_CHARS = 64


class HashedTerms:
    """Sub-linear term frequencies hashed into `dimensions` buckets, L2-normalised."""

    def __init__(self, dimensions: int = 256) -> None:
        self._d = dimensions
        self._buckets: dict[str, tuple[int, float]] = {}

    @property
    def identity(self) -> str:
        return f"hashed-terms:{self._d}"

    @property
    def dimensions(self) -> int:
        return self._d

    def _bucket(self, term: str) -> tuple[int, float]:
        found = self._buckets.get(term)
        if found is None:
            h = int.from_bytes(hashlib.blake2b(term.encode(), digest_size=8).digest(), "big")
            found = (h % self._d, 1.0 if (h >> 63) & 1 else -1.0)
            # Only words are kept: a term can be a whole run of untrusted text (a
            # tool result without spaces), and the cache lives as long as the daemon.
            if len(term) <= _CACHED_TERM_CHARS and len(self._buckets) < _CACHED_TERMS:
                self._buckets[term] = found
        return found

    async def vectors(self, texts: Sequence[str]) -> np.ndarray:
        return self.vectors_now(texts)

    def vectors_now(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._d), dtype=np.float32)
        for i, text in enumerate(texts):
            for term, n in Counter(terms(text)).items():
                bucket, sign = self._bucket(term)
                out[i, bucket] += sign * (1.0 + np.log(n))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out


class VectorIndex:
    """Rows of float32 vectors addressed by position; append, replace, remove, search.
    The width is set by the first vector (or `reset`)."""

    def __init__(self, dimensions: int = 0) -> None:
        self.reset(dimensions)

    def reset(self, dimensions: int) -> None:
        self.dimensions = dimensions
        self._rows = np.zeros((16, dimensions), dtype=np.float32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, vector: np.ndarray) -> int:
        if self._n == 0 and self.dimensions != len(vector):
            self.reset(len(vector))
        if self._n == len(self._rows):
            grown = np.zeros((2 * len(self._rows), self.dimensions), dtype=np.float32)
            grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n] = vector
        self._n += 1
        return self._n - 1

    def replace(self, position: int, vector: np.ndarray) -> None:
        self._rows[position] = vector

    def remove(self, position: int) -> None:
        """Drop a row; the rows after it move up by one."""
        self._rows[position: self._n - 1] = self._rows[position + 1: self._n]
        self._n -= 1

    @property
    def matrix(self) -> np.ndarray:
        return self._rows[: self._n]

    def similarities(self, query: np.ndarray) -> np.ndarray:
        """Cosine similarity of every row with `query` (rows and query normalised),
        clipped to [0, 1]."""
        if self._n == 0 or len(query) != self.dimensions:
            return np.zeros(0, dtype=np.float32)
        return np.clip(self.matrix @ query, 0.0, 1.0)
