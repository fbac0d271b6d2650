"""The fixed schemas of the wire protocol, loaded once from the package data
in `agentd/schemas/`.

They are compiled with lxml (libxml2) for the hot path. `xmlschema` is used only by
tooling that needs its richer error messages.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from lxml import etree

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"

NS_ENV = "https://xml-pipeline.org/ns/envelope/v1"
NS_CORE = "https://xml-pipeline.org/ns/core/v1"
NS_AUTH = "https://xml-pipeline.org/ns/auth/v1"
NS_PRIV = "https://xml-pipeline.org/ns/privileged/v1"
# Meta extensions of streaming and acknowledged delivery (no schema of their own:
# the envelope takes them laxly, and `_delivery` reads them).
NS_DELIVERY = "https://xml-pipeline.org/ns/delivery/v1"
NS_STREAM = "https://xml-pipeline.org/ns/stream/v1"

_FILES = {
    NS_ENV: "envelope.xsd",
    NS_CORE: "core.xsd",
    NS_AUTH: "auth.xsd",
    NS_PRIV: "privileged.xsd",
}


@cache
def schema_text(namespace: str) -> str:
    return (SCHEMA_DIR / _FILES[namespace]).read_text(encoding="utf-8")


@cache
def schema(namespace: str) -> etree.XMLSchema:
    doc = etree.fromstring(
        schema_text(namespace).encode(), etree.XMLParser(resolve_entities=False, no_network=True)
    )
    return etree.XMLSchema(doc)
