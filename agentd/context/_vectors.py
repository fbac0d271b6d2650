"""Vectors for relevance and recall: the `Embedder` seam and a numpy index.

`Embedder.embed(texts)` returns one L2-normalised row per text; `identity` names the
provider and model, and is stored beside each vector so that a change of embedder
re-embeds. `HashedTerms` is the embedder used when the organism configures none:
lower-cased word terms (stop words removed), sub-linear term frequency, hashed into
a fixed number of dimensions; it needs nothing and loads nothing.

`VectorIndex` holds rows in one contiguous float32 matrix (grown by doubling), so a
search is one matrix-vector product. Exact search over n rows of d dimensions costs
n·d multiply-adds: about 25 M for 100,000 memories of 256 dimensions, a few
milliseconds; past a few million rows an approximate index (sqlite-vec, or a vector
store such as FAISS or hnswlib) should replace it behind the same `search` call.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np

_WORD = re.compile(r"\w+")
_TAG = re.compile(r"<[^<>]{0,400}>")
_STOP_TEXT = (
    "a an and are as at be but by for from has have he her his i if in into is it its of "
    "on or our she so than that the their them then there these they this to was we were "
    "what when which who will with you your"
)
STOP_WORDS = frozenset(_STOP_TEXT.split(" "))


class Embedder(Protocol):
    @property
    def identity(self) -> str: ...

    @property
    def dimensions(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def terms(text: str) -> list[str]:
    """Lower-cased `\\w+` terms without stop words; XML tags are read as text too
    (element names say what a result is about)."""
    return [t for t in _WORD.findall(text.lower()) if t not in STOP_WORDS]


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
            if len(self._buckets) < 200_000:
                self._buckets[term] = found
        return found

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._d), dtype=np.float32)
        for i, text in enumerate(texts):
            for term, n in Counter(terms(text)).items():
                bucket, sign = self._bucket(term)
                out[i, bucket] += sign * (1.0 + np.log(n))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        np.divide(out, norms, out=out, where=norms > 0)
        return out


class VectorIndex:
    """Rows of float32 vectors addressed by position; append, replace, remove, search."""

    def __init__(self, dimensions: int) -> None:
        self.dimensions = dimensions
        self._rows = np.zeros((16, dimensions), dtype=np.float32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, vector: np.ndarray) -> int:
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
        if self._n == 0:
            return np.zeros(0, dtype=np.float32)
        return np.clip(self.matrix @ query, 0.0, 1.0)
