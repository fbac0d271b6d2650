"""Embeddings: the three providers behind one interface, cosine similarities in
[0, 1], the stable bytes form, and the providers' own guarantees: BM25 exactly as
specified, a local model read from files with the network unreachable, an
OpenAI-compatible endpoint spoken over real HTTP, hostile replies refused."""

from __future__ import annotations

import json
import math
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentd._errors import ConfigError
from agentd.config import EmbeddingsConfig, LlmBackendConfig, load_config_text
from agentd.embeddings import (
    STOP_WORDS,
    Bm25Fit,
    Embedder,
    EmbeddingsError,
    LexicalEmbedder,
    LocalEmbedder,
    OpenAIEmbedder,
    build_embedder,
    cosine,
    from_blob,
    similarities,
    to_blob,
    tokens,
    top_k,
    unit,
)
from agentd.embeddings._openai import MAX_DIMENSIONS, decode_response, reply_limit
from tests.embedding_models import write_static_model
from tests.llm_servers import FakeLLM, Reply


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Any attempt to open a connection fails, and is recorded."""
    attempts: list[object] = []

    def refuse(self: socket.socket, address: object) -> None:
        attempts.append(address)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    yield attempts


# ---------------------------------------------------------------- vectors


def test_blob_round_trip_is_little_endian_float32() -> None:
    vector = np.array([1.0, -2.5, 0.125], dtype=np.float32)
    blob = to_blob(vector)
    assert blob == np.array([1.0, -2.5, 0.125], dtype="<f4").tobytes()
    assert np.array_equal(from_blob(blob, 3), vector)
    with pytest.raises(ValueError):
        from_blob(blob, 4)
    with pytest.raises(ValueError):
        from_blob(blob[:-1])


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=3),
       st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=3))
def test_similarity_is_a_cosine_clipped_to_unit_range(a: list[float], b: list[float]) -> None:
    score = cosine(unit(a), unit(b))
    assert 0.0 <= score <= 1.0
    if np.linalg.norm(a) > 1e-3 and np.linalg.norm(b) > 1e-3:
        expected = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        assert score == pytest.approx(max(0.0, min(1.0, expected)), abs=1e-4)


def test_zero_vector_matches_nothing() -> None:
    matrix = np.vstack([unit([1, 0]), unit([0, 0])])
    assert similarities(unit([0, 0]), matrix).tolist() == [0.0, 0.0]
    assert top_k(unit([1, 0]), matrix, 5, threshold=0.1) == [(0, 1.0)]


def test_top_k_is_best_first_and_stable_on_ties() -> None:
    matrix = np.vstack([unit([1, 1]), unit([1, 0]), unit([1, 1])])
    ranked = top_k(unit([1, 1]), matrix, 2)
    assert [i for i, _ in ranked] == [0, 2]


# ---------------------------------------------------------------- lexical


def test_tokens_are_lowercased_word_runs_without_stop_words() -> None:
    assert tokens("Read THE contents of main.rs, please!") == ["read", "contents", "main", "rs"]
    assert {"the", "of", "a", "and"} <= STOP_WORDS


def test_bm25_weights_follow_the_formula() -> None:
    corpus = ["read file", "read read file system", "add numbers"]
    fit = Bm25Fit.over(corpus)
    n, lengths = 3, [2, 4, 2]
    average = sum(lengths) / n

    def idf(df: int) -> float:
        return math.log(1 + (n - df + 0.5) / (df + 0.5))

    def weight(tf: int, df: int, length: int) -> float:
        return idf(df) * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * length / average))

    raw = {"read": weight(2, 2, 4), "file": weight(1, 2, 4), "system": weight(1, 1, 4)}
    norm = math.sqrt(sum(v * v for v in raw.values()))
    row = fit.matrix[1]
    for term, value in raw.items():
        assert row[fit.columns[term]] == pytest.approx(value / norm, rel=1e-5)
    query = fit.query("read the file twice")  # `twice` is not in the corpus
    q = {"read": idf(2), "file": idf(2)}
    qn = math.sqrt(sum(v * v for v in q.values()))
    assert query[fit.columns["read"]] == pytest.approx(q["read"] / qn, rel=1e-5)
    assert float(np.linalg.norm(query)) == pytest.approx(1.0, rel=1e-5)


async def test_lexical_ranks_the_matching_text_first() -> None:
    embedder = LexicalEmbedder()
    corpus = ["Reads the contents of a file.", "Adds two integers.", "Fetches a web page."]
    matrix = await embedder.embed_documents(corpus)
    query = await embedder.embed_query("read the contents of main.rs", corpus)
    assert top_k(query, matrix, 3)[0][0] == 0
    assert (await embedder.embed_query("nothing shared", corpus)).any() is np.False_
    assert isinstance(embedder, Embedder)
    assert embedder.corpus_relative and embedder.identity.key == "lexical:bm25"


# ---------------------------------------------------------------- local


async def test_local_model_loads_and_ranks_with_the_network_blocked(
    tmp_path: Path, no_network: list[object]
) -> None:
    folder = write_static_model(tmp_path / "model")
    embedder = LocalEmbedder(folder)
    corpus = ["delete temporary files from disk", "add two numbers", "send an email message"]
    matrix = await embedder.embed_documents(corpus)
    assert matrix.dtype == np.float32 and matrix.shape == (3, 16)
    ranked = top_k(await embedder.embed_query("erase the temp folder"), matrix, 3)
    assert ranked[0][0] == 0 and ranked[0][1] > 0.8
    assert not embedder.corpus_relative and embedder.identity.provider == "local"
    assert no_network == []


async def test_local_identity_changes_when_the_model_changes(tmp_path: Path) -> None:
    a = LocalEmbedder(write_static_model(tmp_path / "a", seed=1)).identity
    b = LocalEmbedder(write_static_model(tmp_path / "b", seed=2)).identity
    again = LocalEmbedder(write_static_model(tmp_path / "c", seed=1)).identity
    assert a != b and a == again


async def test_local_unknown_words_give_a_zero_vector(tmp_path: Path) -> None:
    embedder = LocalEmbedder(write_static_model(tmp_path / "m"))
    assert not (await embedder.embed_query("zzz qqq")).any()


@pytest.mark.parametrize("damage", ["missing", "garbage", "no-embeddings-tensor"])
def test_a_broken_model_directory_is_refused_clearly(
    tmp_path: Path, damage: str, no_network: list[object]
) -> None:
    folder = write_static_model(tmp_path / "m")
    if damage == "missing":
        (folder / "tokenizer.json").unlink()
    elif damage == "garbage":
        (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    else:
        from safetensors.numpy import save_file

        save_file({"other": np.zeros((3, 3), dtype=np.float32)}, str(folder / "model.safetensors"))
    with pytest.raises(EmbeddingsError, match="embeddings model in"):
        LocalEmbedder(folder)
    assert no_network == []


def test_a_nonexistent_model_path_never_reaches_the_network(
    tmp_path: Path, no_network: list[object]
) -> None:
    with pytest.raises(EmbeddingsError, match="missing"):
        LocalEmbedder(tmp_path / "minishlab" / "potion-base-8M")
    assert no_network == []


# ---------------------------------------------------------------- openai


def _topic_vector(text: str) -> list[float]:
    words = text.lower().split()
    return [float(sum(w.startswith(p) for w in words)) for p in ("file", "add", "mail")]


def _backend(server: FakeLLM, **extra: object) -> LlmBackendConfig:
    return LlmBackendConfig(
        name="emb", provider="openai", base_url=server.base_url, model="chat", **extra  # type: ignore[arg-type]
    )


async def test_openai_embeddings_over_real_http() -> None:
    async with FakeLLM(embed=_topic_vector) as server:
        embedder = OpenAIEmbedder(
            _backend(server, api_key_env="EMB_KEY"), "embed-small", env={"EMB_KEY": "sk-test"}
        )
        try:
            matrix = await embedder.embed_documents(["file file", "add numbers", "mail me"])
            query = await embedder.embed_query("files")
        finally:
            await embedder.aclose()
    assert matrix.shape == (3, 3) and top_k(query, matrix, 1)[0][0] == 0
    first = server.requests[0]
    assert first.path == "/v1/embeddings"
    assert first.json == {"model": "embed-small", "input": ["file file", "add numbers", "mail me"],
                          "encoding_format": "float"}
    assert first.headers["authorization"] == "Bearer sk-test"
    assert embedder.identity.key == "openai:embed-small"


@pytest.mark.parametrize("body", [
    b"not json",
    b'{"data": []}',
    b'{"data": [{"index": 0, "embedding": [1.0, "x"]}]}',
    b'{"data": [{"index": 0, "embedding": [1.0, 2.0]}, {"index": 0, "embedding": [1.0, 2.0]}]}',
    b'{"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0, 2.0]}]}',
    b'{"data": [{"index": 0, "embedding": [1e39, 0]}, {"index": 1, "embedding": [1.0, 2.0]}]}',
])
async def test_a_hostile_embeddings_reply_is_refused(body: bytes) -> None:
    async with FakeLLM(script=[Reply(body=body)], embed=_topic_vector) as server:
        embedder = OpenAIEmbedder(_backend(server), "m", retries=0)
        try:
            with pytest.raises(EmbeddingsError):
                await embedder.embed_documents(["a", "b"])
        finally:
            await embedder.aclose()


async def test_a_vector_wider_than_any_model_is_refused_before_it_is_decoded() -> None:
    wide = [0.5] * (MAX_DIMENSIONS + 1)
    body = json.dumps({"data": [{"index": 0, "embedding": wide}]}).encode()
    with pytest.raises(EmbeddingsError, match="dimensions"):
        decode_response(body, 1)
    assert reply_limit(1) < 1 << 20  # one query's reply is read up to 320 KiB, not 64 MiB


async def test_a_reply_of_another_width_than_the_first_is_refused() -> None:
    """Vectors of two widths cannot be compared: a provider that changes its width
    mid-life (a hostile one, or a model swapped behind the same name) fails the
    call instead of storing a vector no search can use."""
    eight = json.dumps({"data": [{"index": 0, "embedding": [1.0] * 8}]}).encode()
    sixteen = json.dumps({"data": [{"index": 0, "embedding": [1.0] * 16}]}).encode()
    async with FakeLLM(script=[Reply(body=eight), Reply(body=sixteen), Reply(body=eight)],
                       embed=_topic_vector) as server:
        embedder = OpenAIEmbedder(_backend(server), "m", retries=0)
        try:
            assert (await embedder.embed_query("a")).shape == (8,)
            with pytest.raises(EmbeddingsError, match="16 dimensions after replies of 8"):
                await embedder.embed_query("b")
            assert (await embedder.embed_query("c")).shape == (8,)
        finally:
            await embedder.aclose()


async def test_a_failing_endpoint_is_retried_then_reported() -> None:
    replies = [Reply(status=503), Reply(status=503)]
    async with FakeLLM(script=replies, embed=_topic_vector) as server:
        embedder = OpenAIEmbedder(_backend(server), "m", retries=1, backoff_base_s=0.0)
        try:
            with pytest.raises(EmbeddingsError, match="HTTP 503"):
                await embedder.embed_query("x")
        finally:
            await embedder.aclose()
    assert len(server.requests) == 2


async def test_a_missing_api_key_is_reported_without_a_request() -> None:
    async with FakeLLM(embed=_topic_vector) as server:
        embedder = OpenAIEmbedder(_backend(server, api_key_env="NOPE_KEY"), "m", env={})
        try:
            with pytest.raises(EmbeddingsError, match="NOPE_KEY"):
                await embedder.embed_query("x")
        finally:
            await embedder.aclose()
    assert server.requests == []


# ---------------------------------------------------------------- configuration


def _organism(extra: str) -> str:
    return "organism: {name: t}\n" + textwrap.dedent(extra)


def test_default_embeddings_are_lexical(tmp_path: Path) -> None:
    config = load_config_text(_organism(""), base_dir=tmp_path)
    assert config.embeddings == EmbeddingsConfig()
    assert isinstance(build_embedder(config.embeddings, config.llm), LexicalEmbedder)


def test_openai_embeddings_name_an_openai_backend(tmp_path: Path) -> None:
    text = _organism("""
        llm: {backends: [{name: chat, provider: anthropic, model: c},
                         {name: emb, provider: openai, model: x, base_url: "http://127.0.0.1:9/v1"}]}
        embeddings: {provider: openai, backend: emb, model: nomic-embed-text}
    """)
    config = load_config_text(text, base_dir=tmp_path)
    embedder = build_embedder(config.embeddings, config.llm)
    assert isinstance(embedder, OpenAIEmbedder) and embedder.model == "nomic-embed-text"
    with pytest.raises(ConfigError, match="not an openai-compatible backend"):
        load_config_text(text.replace("backend: emb", "backend: chat"), base_dir=tmp_path)
    with pytest.raises(ConfigError, match="no backend named 'ghost'"):
        load_config_text(text.replace("backend: emb", "backend: ghost"), base_dir=tmp_path)


@pytest.mark.parametrize(("section", "message"), [
    ("{provider: openai, backend: emb}", "model: required for provider openai"),
    ("{provider: local}", "path: required for provider local"),
    ("{provider: lexical, path: m}", "path: not a key of provider lexical"),
    ("{provider: word2vec}", "embeddings.provider"),
    ("{provider: lexical, url: x}", "embeddings.url"),
])
def test_bad_embeddings_sections_are_refused(tmp_path: Path, section: str, message: str) -> None:
    (tmp_path / "m").mkdir()
    text = _organism(f"""
        llm: {{backends: [{{name: emb, provider: openai, model: x}}]}}
        embeddings: {section}
    """)
    with pytest.raises(ConfigError, match=message):
        load_config_text(text, base_dir=tmp_path)


def test_local_embeddings_resolve_the_path_against_the_file(tmp_path: Path) -> None:
    write_static_model(tmp_path / "models" / "tiny")
    config = load_config_text(
        _organism("embeddings: {provider: local, path: models/tiny}\n"), base_dir=tmp_path
    )
    embedder = build_embedder(config.embeddings, config.llm)
    assert isinstance(embedder, LocalEmbedder)


def test_a_reply_of_number_strings_is_refused_and_huge_coordinates_keep_their_direction(
) -> None:
    """`["1", "2"]` was read as numbers; coordinates near float32's limit overflowed
    when squared and the vector became all zeros (it then matched nothing)."""
    with pytest.raises(EmbeddingsError, match="non-numeric"):
        decode_response(json.dumps({"data": [{"embedding": ["1", "2"]}]}).encode(), 1)
    rows, _ = decode_response(json.dumps({"data": [{"embedding": [3e38, 3e38]}]}).encode(), 1)
    assert rows[0].tolist() == pytest.approx([0.70710677, 0.70710677])
