"""Payload classes the WASM tool tests' modules read and write."""

from __future__ import annotations

from dataclasses import dataclass

from agentd import xmlify

NS = "https://xml-pipeline.org/ns/test/wasm/v1"


@xmlify(namespace=NS)
@dataclass
class WasmIn:
    """A request for a WASM test module."""

    text: str


@xmlify(namespace=NS)
@dataclass
class WasmOut:
    """What a WASM test module answers."""

    text: str
