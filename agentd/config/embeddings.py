"""The `embeddings` section: which provider turns text into vectors (semantic
routing, context relevance, long-term memory recall).

    embeddings: {provider: lexical}                          # the default
    embeddings: {provider: openai, backend: NAME, model: M}   # an llm.backends entry
    embeddings: {provider: local, path: DIR}                  # a model2vec directory
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from agentd.config.values import Folder, Name, Problem, Text, rules

EmbeddingsProvider = Literal["lexical", "openai", "local"]
_KEYS = {"openai": ("backend", "model"), "local": ("path",), "lexical": ()}


def _embeddings_rules(data: dict[str, Any]) -> list[Problem]:
    provider = data.get("provider", "lexical")
    if provider not in _KEYS:
        return []
    problems = [
        Problem((key,), f"required for provider {provider}", data)
        for key in _KEYS[provider]
        if key not in data
    ]
    for key in ("backend", "model", "path"):
        if key in data and key not in _KEYS[provider]:
            problems.append(Problem((key,), f"not a key of provider {provider}", data[key]))
    return problems


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class EmbeddingsConfig:
    provider: EmbeddingsProvider = "lexical"
    backend: Name | None = None  # openai: the name of an llm.backends entry
    model: Text | None = None  # openai: the embedding model the endpoint serves
    path: Folder | None = None  # local: the model directory

    _rules = rules(lambda data, _: _embeddings_rules(data), "embeddings")


def embeddings_references(data: dict[str, Any]) -> list[Problem]:
    """`embeddings.backend` names an openai backend of `llm.backends`."""
    section = data.get("embeddings")
    if not isinstance(section, dict) or section.get("provider") != "openai":
        return []
    name = section.get("backend")
    if not isinstance(name, str):
        return []
    llm = data.get("llm")
    backends = llm.get("backends") if isinstance(llm, dict) else ()
    for backend in backends if isinstance(backends, tuple) else ():
        if isinstance(backend, dict) and backend.get("name") == name:
            if backend.get("provider") != "openai":
                return [Problem(("embeddings", "backend"),
                                f"backend {name!r} is not an openai-compatible backend", name)]
            return []
    return [Problem(("embeddings", "backend"), f"no backend named {name!r} in llm.backends", name)]
