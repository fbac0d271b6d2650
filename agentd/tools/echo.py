"""An echo tool: answers with the text it was given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from agentd import HandlerMetadata, HandlerResponse, MaxLen, xmlify


@xmlify(namespace="https://xml-pipeline.org/ns/echo/v1")
@dataclass
class Echo:
    """Text to be echoed back."""

    text: Annotated[str, MaxLen(4096), "the text to echo"]


@xmlify(namespace="https://xml-pipeline.org/ns/echo/reply/v1")
@dataclass
class EchoReply:
    """The echoed text."""

    text: Annotated[str, MaxLen(4096), "the same text"]


async def echo(payload: Echo, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(EchoReply(text=payload.text))
