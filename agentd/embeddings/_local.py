"""`local`: a static embedding model read from a directory the operator provides,
in the model2vec layout:

    DIR/tokenizer.json      a Hugging Face `tokenizers` tokenizer
    DIR/model.safetensors   tensor `embeddings` (vocabulary x dimensions), optional
                            tensor `weights` (one per token)
    DIR/config.json         `normalize` (bool), anything else is ignored

A text's vector is the mean of its tokens' rows (weighted when `weights` is
given), scaled to unit length. The `model2vec` package itself is not used: its
loader falls back to downloading from the Hugging Face hub whenever the path does
not exist, and nothing here may ever reach the network. We read the files with
`safetensors` and `tokenizers`, which only touch the paths they are given.

The identity's model is a SHA-256 over the three files, so replacing the model in
place is detected as a change that requires re-embedding.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agentd.embeddings._protocol import EmbedderIdentity, EmbeddingsError
from agentd.embeddings._vectors import Matrix, Vector, unit_rows

TOKENIZER_FILE = "tokenizer.json"
MATRIX_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MAX_TEXT_CHARS = 32768  # a longer text is embedded from its start


class LocalEmbedder:
    corpus_relative = False

    def __init__(self, folder: Path) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        folder = Path(folder)
        files = [folder / TOKENIZER_FILE, folder / MATRIX_FILE, folder / CONFIG_FILE]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EmbeddingsError(
                f"embeddings model in {folder}: missing {', '.join(missing)} "
                "(the model2vec layout: tokenizer.json, model.safetensors, config.json)"
            )
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
        try:
            tensors = load_file(str(folder / MATRIX_FILE))
            self._tokenizer = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
            config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        except Exception as exc:  # tokenizers and safetensors raise plain Exception
            raise EmbeddingsError(
                f"embeddings model in {folder} cannot be read: {type(exc).__name__}: {exc}"
            ) from None
        table = tensors.get("embeddings")
        if table is None or table.ndim != 2 or table.shape[0] == 0:
            raise EmbeddingsError(
                f"embeddings model in {folder}: {MATRIX_FILE} needs a 2-D tensor `embeddings`"
            )
        weights = tensors.get("weights")
        if weights is not None and weights.shape != (table.shape[0],):
            raise EmbeddingsError(
                f"embeddings model in {folder}: `weights` must have one value per token"
            )
        vocabulary = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if vocabulary > table.shape[0]:
            raise EmbeddingsError(
                f"embeddings model in {folder}: the tokenizer has {vocabulary} tokens but "
                f"the matrix only {table.shape[0]} rows"
            )
        if not np.all(np.isfinite(table)):
            raise EmbeddingsError(f"embeddings model in {folder}: the matrix is not finite")
        self._table = np.asarray(table, dtype=np.float32)
        self._weights = None if weights is None else np.asarray(weights, dtype=np.float32)
        if not isinstance(config, dict):
            raise EmbeddingsError(f"embeddings model in {folder}: {CONFIG_FILE} is not an object")
        unk = self._tokenizer.token_to_id("[UNK]")
        self._skip = frozenset() if unk is None else frozenset({unk})
        self.dimensions = int(self._table.shape[1])
        self.identity = EmbedderIdentity("local", "sha256-" + digest.hexdigest()[:32])

    def _embed(self, texts: Sequence[str]) -> Matrix:
        out = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        encodings = self._tokenizer.encode_batch(
            [t[:MAX_TEXT_CHARS] for t in texts], add_special_tokens=False
        )
        for row, encoding in enumerate(encodings):
            ids = [i for i in encoding.ids if i not in self._skip]
            if not ids:
                continue
            rows = self._table[ids]
            if self._weights is not None:
                rows = rows * self._weights[ids, None]
            out[row] = rows.mean(axis=0)
        # Always unit length, whatever config.json's `normalize` says: a similarity
        # must be a cosine in [0, 1] for every model.
        return unit_rows(out)

    async def embed_documents(self, texts: Sequence[str]) -> Matrix:
        return self._embed(texts)

    async def embed_query(self, text: str, corpus: Sequence[str] = ()) -> Vector:
        return self._embed([text])[0]
