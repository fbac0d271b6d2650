"""`lexical`: BM25-weighted term vectors, with nothing to load.

Tokens are the lower-cased `\\w+` runs of a text, minus a fixed English stop-word
list, without stemming. A document's weight for a term is
`idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * len / avglen))` with k1 = 1.2 and
b = 0.75, `idf = ln(1 + (N - n + 0.5) / (n + 0.5))` over the N candidate texts of
which n contain the term (always > 0). A query's vector holds the IDF of each of its
distinct terms that occur in the corpus. Both are scaled to unit length, so their
dot product is a cosine in [0, 1].

The vectors are corpus-relative: one fit over the candidate texts defines both the
dimensions and the weights. Fits are cached per corpus (a routing profile's
candidate set changes only on reload), newest kept.
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentd.embeddings._protocol import EmbedderIdentity
from agentd.embeddings._vectors import Matrix, Vector, unit_rows

K1 = 1.2
B = 0.75
_TOKEN = re.compile(r"\w+")
_FITS_KEPT = 64

# A fixed list: changing it changes every score, so it is part of the identity.
STOP_WORDS = frozenset(
    [
        "a", "about", "above", "after", "again", "against", "all", "am", "an", "and", "any", "are",
        "as", "at", "be", "because", "been", "before", "being", "below", "between", "both", "but",
        "by", "can", "could", "did", "do", "does", "doing", "down", "during", "each", "few", "for",
        "from", "further", "had", "has", "have", "having", "he", "her", "here", "hers", "herself",
        "him", "himself", "his", "how", "i", "if", "in", "into", "is", "it", "its", "itself",
        "just", "me", "more", "most", "my", "myself", "no", "nor", "not", "now", "of", "off", "on",
        "once", "only", "or", "other", "our", "ours", "ourselves", "out", "over", "own", "please",
        "same", "she", "should", "so", "some", "such", "than", "that", "the", "their", "theirs",
        "them", "themselves", "then", "there", "these", "they", "this", "those", "through", "to",
        "too", "under", "until", "up", "very", "was", "we", "were", "what", "when", "where",
        "which", "while", "who", "whom", "why", "will", "with", "would", "you", "your", "yours",
        "yourself", "yourselves"
    ]
)


def tokens(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOP_WORDS]


@dataclass(frozen=True)
class Bm25Fit:
    """One fit over a corpus: the vocabulary (term → column), each term's IDF, and
    the documents' unit rows."""

    columns: dict[str, int]
    idf: np.ndarray
    matrix: Matrix

    @classmethod
    def over(cls, texts: Sequence[str]) -> Bm25Fit:
        docs = [Counter(tokens(t)) for t in texts]
        columns: dict[str, int] = {}
        frequency: list[int] = []
        for doc in docs:
            for term in doc:
                col = columns.setdefault(term, len(columns))
                if col == len(frequency):
                    frequency.append(0)
                frequency[col] += 1
        n = len(docs)
        df = np.asarray(frequency, dtype=np.float64)
        idf = np.log1p((n - df + 0.5) / (df + 0.5))
        lengths = [sum(doc.values()) for doc in docs]
        average = (sum(lengths) / n) if n and sum(lengths) else 1.0
        matrix = np.zeros((n, len(columns)), dtype=np.float32)
        for row, (doc, length) in enumerate(zip(docs, lengths, strict=True)):
            norm = K1 * (1 - B + B * length / average)
            for term, tf in doc.items():
                col = columns[term]
                matrix[row, col] = idf[col] * tf * (K1 + 1) / (tf + norm)
        return cls(columns, idf.astype(np.float32), unit_rows(matrix))

    def query(self, text: str) -> Vector:
        vector = np.zeros(len(self.columns), dtype=np.float32)
        for term in set(tokens(text)):
            col = self.columns.get(term)
            if col is not None:
                vector[col] = self.idf[col]
        norm = float(np.linalg.norm(vector))
        return vector / norm if norm > 0 else vector


class LexicalEmbedder:
    identity = EmbedderIdentity("lexical", "bm25")
    corpus_relative = True

    def __init__(self) -> None:
        self._fits: OrderedDict[tuple[str, ...], Bm25Fit] = OrderedDict()

    def fit(self, corpus: Sequence[str]) -> Bm25Fit:
        key = tuple(corpus)
        found = self._fits.get(key)
        if found is None:
            found = self._fits[key] = Bm25Fit.over(key)
            if len(self._fits) > _FITS_KEPT:
                self._fits.popitem(last=False)
        else:
            self._fits.move_to_end(key)
        return found

    async def embed_documents(self, texts: Sequence[str]) -> Matrix:
        return self.fit(texts).matrix

    async def embed_query(self, text: str, corpus: Sequence[str] = ()) -> Vector:
        return self.fit(corpus).query(text)

