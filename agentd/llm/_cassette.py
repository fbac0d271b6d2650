"""Cassettes: recorded request -> response exchanges, for deterministic replay.

A cassette is a JSON Lines file, one exchange a line:

    {"key": "<sha256>", "conversation": "<sha256>", "request": {...normalised...},
     "response": {"text": "...", "input_tokens": 12, "output_tokens": 7, "model": "...",
                  "calls": [["call_1", "calculator__add", "{\"a\": 2}"]]}}

`calls` (id, tool name, arguments as JSON text) are the model's native tool calls,
absent when it made none.

`request` is `LlmRequest.normalised()` (the spotlight nonce replaced by a fixed
placeholder), so a recording replays although every live call had its own nonce.
No header, URL or API key is ever written. Recording appends; the file is readable
and diffable, and can be written by hand.

Lookup is by `key` (the whole request, system prompt included). A request whose key
is unknown falls back to `conversation` (the messages alone) so a shipped demo
cassette survives an edit of a prompt; that fallback is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentd._errors import ConfigError
from agentd.llm._types import LlmRequest, LlmResponse, ToolCall

log = logging.getLogger("agentd.llm.cassette")


@dataclass(frozen=True)
class Exchange:
    key: str
    conversation: str
    request: dict[str, Any]
    response: dict[str, Any]

    def to_response(self, backend: str) -> LlmResponse:
        r = self.response
        return LlmResponse(
            text=str(r.get("text", "")),
            input_tokens=int(r.get("input_tokens", 0)),
            output_tokens=int(r.get("output_tokens", 0)),
            backend=backend,
            model=str(r.get("model", "")),
            finish_reason=str(r.get("finish_reason", "")),
            calls=tuple(ToolCall(str(i), str(n), str(a)) for i, n, a in r.get("calls", ())),
        )


class Cassette:
    """The exchanges of one cassette file, indexed for lookup. When one request was
    recorded several times, its responses are played in order, the last repeating."""

    def __init__(self, exchanges: list[Exchange], source: str = "", digest: str = "") -> None:
        self.source = source
        self.digest = digest  # SHA-256 of the file as read, to tell a changed cassette
        self.exchanges = exchanges
        self._by_key: dict[str, list[Exchange]] = defaultdict(list)
        self._by_conversation: dict[str, list[Exchange]] = defaultdict(list)
        for ex in exchanges:
            self._by_key[ex.key].append(ex)
            self._by_conversation[ex.conversation].append(ex)
        self._played: dict[tuple[str, str], int] = defaultdict(int)

    @classmethod
    def load(cls, path: Path, where: str = "cassette") -> Cassette:
        """Read `path`; any problem is a `ConfigError` naming `where` and the line."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                [f"{where}: cannot read cassette {path}: {exc.strerror or exc}"]
            ) from None
        exchanges: list[Exchange] = []
        issues: list[str] = []
        for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ex = Exchange(
                    key=str(obj["key"]),
                    conversation=str(obj.get("conversation", "")),
                    request=dict(obj.get("request", {})),
                    response=dict(obj["response"]),
                )
                ex.to_response("")  # a malformed response is refused here, not at replay
            except (ValueError, KeyError, TypeError) as exc:
                issues.append(f"{where}: {path}:{n}: not a cassette exchange ({exc})")
                continue
            exchanges.append(ex)
        if issues:
            raise ConfigError(issues)
        return cls(exchanges, str(path), hashlib.sha256(data).hexdigest())

    def lookup(self, request: LlmRequest) -> Exchange | None:
        found = self._take("key", request.key, self._by_key)
        if found is None:
            found = self._take("conversation", request.conversation_key, self._by_conversation)
            if found is not None:
                log.warning(
                    "cassette %s: replaying by conversation (the system prompt or the "
                    "parameters differ from the recording)", self.source,
                )
        return found

    def _take(self, kind: str, key: str, index: dict[str, list[Exchange]]) -> Exchange | None:
        candidates = index.get(key)
        if not candidates:
            return None
        i = self._played[(kind, key)]
        self._played[(kind, key)] = i + 1
        return candidates[min(i, len(candidates) - 1)]


class CassetteRecorder:
    """Appends exchanges to a cassette file (created 0600 if missing)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, request: LlmRequest, response: LlmResponse) -> None:
        line = json.dumps(
            {
                "key": request.key,
                "conversation": request.conversation_key,
                "request": request.normalised(),
                "response": {
                    "text": response.text,
                    "input_tokens": response.input_tokens,
                    "output_tokens": response.output_tokens,
                    "model": response.model,
                    "finish_reason": response.finish_reason,
                    **({"calls": [[c.id, c.name, c.arguments] for c in response.calls]}
                       if response.calls else {}),
                },
            },
            ensure_ascii=False,
            sort_keys=True,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(line + "\n")
