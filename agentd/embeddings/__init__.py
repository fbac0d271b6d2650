"""Embeddings: text in, unit float32 vectors out, for semantic routing, context
relevance and long-term memory recall.

The interface (`Embedder`): `embed_documents(texts) -> Matrix`,
`embed_query(text, corpus) -> Vector`, `identity` (provider and model: stored
vectors made under another identity are re-embedded) and `corpus_relative` (the
`lexical` provider fits its weights over the texts it is given, so its vectors are
never stored). Similarities are cosines in [0, 1] (`similarities`, `top_k`);
`to_blob`/`from_blob` are the stable bytes form for SQLite.

Providers (the `embeddings:` section): `lexical` (BM25, nothing to load), `openai`
(an OpenAI-compatible `/v1/embeddings` endpoint of an `llm.backends` entry), `local`
(a static model2vec-layout model read from a directory; never a download).
`build_embedder` makes the configured one.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentd.config import EmbeddingsConfig, LlmConfig
from agentd.embeddings._lexical import STOP_WORDS, Bm25Fit, LexicalEmbedder, tokens
from agentd.embeddings._local import LocalEmbedder
from agentd.embeddings._openai import OpenAIEmbedder
from agentd.embeddings._protocol import Embedder, EmbedderIdentity, EmbeddingsError
from agentd.embeddings._vectors import (
    Matrix,
    Vector,
    cosine,
    from_blob,
    similarities,
    stack,
    to_blob,
    top_k,
    unit,
    unit_rows,
)

__all__ = [
    "STOP_WORDS",
    "Bm25Fit",
    "Embedder",
    "EmbedderIdentity",
    "EmbeddingsError",
    "LexicalEmbedder",
    "LocalEmbedder",
    "Matrix",
    "OpenAIEmbedder",
    "Vector",
    "build_embedder",
    "cosine",
    "from_blob",
    "similarities",
    "stack",
    "to_blob",
    "tokens",
    "top_k",
    "unit",
    "unit_rows",
]


def build_embedder(
    config: EmbeddingsConfig,
    llm: LlmConfig | None,
    *,
    env: Mapping[str, str] | None = None,
) -> Embedder:
    """The configured provider. `EmbeddingsError` if it cannot be made (a model
    directory that does not hold a readable model, a backend that is not there)."""
    if config.provider == "lexical":
        return LexicalEmbedder()
    if config.provider == "local":
        assert config.path is not None  # the section's rules require it
        return LocalEmbedder(config.path)
    assert config.backend is not None and config.model is not None
    if llm is None:
        raise EmbeddingsError("embeddings provider openai needs an `llm` section")
    try:
        backend = llm.backend(config.backend)
    except KeyError:
        raise EmbeddingsError(f"no backend named {config.backend!r} in llm.backends") from None
    return OpenAIEmbedder(
        backend, config.model, retries=llm.retries, env=env
    )
