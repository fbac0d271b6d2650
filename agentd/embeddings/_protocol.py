"""What every embeddings provider offers: texts in, unit float32 vectors out, and
an identity that says when stored vectors must be recomputed.

A provider is either *absolute* (a text's vector does not depend on other texts:
`openai`, `local`) or *corpus-relative* (`lexical`: BM25 weights are fit over the
candidate texts, so a vector is comparable only with vectors of the same fit).
Callers always pass the candidate texts to `embed_query` as `corpus`; absolute
providers ignore it. Stored vectors are only meaningful for absolute providers:
`corpus_relative` tells a store not to keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentd._errors import AgentdError
from agentd.embeddings._vectors import Matrix, Vector


class EmbeddingsError(AgentdError):
    """Vectors could not be produced (a model that cannot be loaded, an endpoint
    that failed or answered nonsense). The message is for the operator's log."""


@dataclass(frozen=True)
class EmbedderIdentity:
    """Who made a vector. Two vectors are comparable only under the same `key`;
    a store that finds another key beside its vectors re-embeds."""

    provider: str  # lexical | openai | local
    model: str  # bm25 | the endpoint's model name | the local model's content digest

    @property
    def key(self) -> str:
        return f"{self.provider}:{self.model}"


@runtime_checkable
class Embedder(Protocol):
    identity: EmbedderIdentity
    corpus_relative: bool

    async def embed_documents(self, texts: Sequence[str]) -> Matrix:
        """One unit row per text, in order (a text with nothing to embed: a zero
        row). For a corpus-relative provider the rows are fit over `texts`."""
        ...

    async def embed_query(self, text: str, corpus: Sequence[str] = ()) -> Vector:
        """The vector of a query, comparable with `embed_documents(corpus)`."""
        ...
