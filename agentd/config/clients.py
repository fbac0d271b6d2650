"""The bus's clients file: `{clients: {id: {totp_secret: BASE32, profile: NAME}}}`.

Read with the same machinery as `organism.yaml` (safe YAML, every problem with its
`file:line:col` and key path). Whether the profiles exist is the caller's check:
the file is read by the bus and by `agentctl reload`, against a configuration.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict
from pydantic.dataclasses import dataclass as section

from agentd.config.organism import validate_document
from agentd.config.values import NAME_PATTERN, Problem, Text, problem, rules

CLIENT_ID = NAME_PATTERN
_BASE32 = re.compile(r"[A-Z2-7]+=*")
SHAPE = (
    "expected one top-level key `clients` mapping client ids to "
    "{totp_secret: BASE32, profile: NAME}"
)


@dataclass(frozen=True)
class ClientEntry:
    client: str
    totp_secret: str  # base32, upper case, no padding or spaces
    profile: str


def normalise_secret(secret: str) -> str:
    """A base32 TOTP secret without spaces or padding, upper case; ValueError if bad."""
    value = re.sub(r"[\s-]", "", secret).upper().rstrip("=")
    if not value or not _BASE32.fullmatch(value):
        raise ValueError("not a base32 string")
    try:
        raw = base64.b32decode(value + "=" * (-len(value) % 8))
    except binascii.Error:
        raise ValueError("not a base32 string") from None
    if len(raw) < 10:
        raise ValueError("shorter than 80 bits (16 base32 characters)")
    return value


def _client_id(value: str) -> str:
    if not CLIENT_ID.fullmatch(value):
        raise problem(f"client id must match {CLIENT_ID.pattern}")
    if value == "core":
        raise problem("`core` is reserved for agentd itself")
    return value


def _secret(value: str) -> str:
    try:
        return normalise_secret(value)
    except ValueError as exc:
        raise problem(str(exc)) from None


@section(frozen=True, config=ConfigDict(extra="forbid"))
class ClientSection:
    totp_secret: Annotated[str, AfterValidator(_secret)]
    profile: Text


def _shape(data: dict[str, Any]) -> list[Problem]:
    return [] if set(data) == {"clients"} else [Problem((), SHAPE, data)]


def _clients_only(data: Any) -> Any:
    """Past a wrong shape, the entries are still checked if there are any."""
    return {"clients": data.get("clients", {})} if isinstance(data, dict) else data


@section(frozen=True, config=ConfigDict(extra="forbid"))
class ClientsFile:
    clients: dict[Annotated[str, AfterValidator(_client_id)], ClientSection]

    _rules = rules(lambda data, _: _shape(data), "clients file", prepare=_clients_only)


def read_clients_text(text: str, source_name: str) -> dict[str, ClientEntry]:
    """The entries of a clients file; `ConfigError` listing every problem."""
    document, _ = validate_document(text, ClientsFile, source_name)
    return {
        client: ClientEntry(client, body.totp_secret, body.profile)
        for client, body in document.clients.items()
    }
