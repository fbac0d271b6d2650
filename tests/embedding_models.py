"""A tiny static embedding model, generated here and saved in the model2vec layout
(`tokenizer.json`, `model.safetensors`, `config.json`), so the `local` provider is
tested on real files without anything downloaded.

Words come in topic groups; a word's row is its topic's axis plus a little
deterministic noise, so texts about one topic are similar and texts about
different topics are not.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

TOPICS: dict[str, list[str]] = {
    "files": [
        "file", "files", "read", "write", "delete", "erase", "remove", "contents", "directory",
        "folder", "path", "temp", "temporary", "disk", "save", "open", "main", "rs", "txt", "log",
        "logs", "document"
    ],
    "math": [
        "add", "sum", "plus", "number", "numbers", "multiply", "product", "calculate", "arithmetic",
        "total", "integer", "integers", "divide", "minus", "subtract"
    ],
    "web": [
        "fetch", "url", "http", "https", "page", "website", "download", "web", "browse", "request",
        "get", "site", "link"
    ],
    "mail": [
        "email", "mail", "send", "message", "inbox", "recipient", "letter", "notify", "notification"
    ],
    "time": [
        "time", "clock", "date", "today", "timer", "schedule", "remind", "reminder", "later",
        "tomorrow"
    ],
}
FILLER = [f"word{i}" for i in range(300)]  # a vocabulary of a few hundred words


def write_static_model(folder: Path, dims: int = 16, seed: int = 7) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]"] + [w for group in TOPICS.values() for w in group] + FILLER
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 0.05, size=(len(vocab), dims)).astype(np.float32)
    for axis, group in enumerate(TOPICS.values()):
        for word in group:
            table[vocab[word], axis] += 1.0
    for word in FILLER:
        table[vocab[word], len(TOPICS) + vocab[word] % (dims - len(TOPICS))] += 1.0
    save_file({"embeddings": table}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"normalize": True, "model_type": "model2vec"}))
    return folder
