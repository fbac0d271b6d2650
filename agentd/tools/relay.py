"""A relay: asks the calculator and passes its answer back to its own caller.

It shows the call chain: the client's request runs the relay in a child frame; the
relay's request runs the calculator in a grandchild frame; the calculator's answer
returns to the relay (a caller accepts its peers' response classes), whose own
`respond()` returns to the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from agentd import HandlerMetadata, HandlerResponse, xmlify
from agentd.tools.calculator import Add, Sum


@xmlify(namespace="https://xml-pipeline.org/ns/relay/v1")
@dataclass
class Relay:
    """Adds two integers by asking the calculator."""

    a: Annotated[int, "the first addend"]
    b: Annotated[int, "the second addend"]


async def relay(payload: Relay | Sum, meta: HandlerMetadata) -> HandlerResponse:
    if isinstance(payload, Relay):
        return HandlerResponse(Add(a=payload.a, b=payload.b), to="calculator.add")
    return HandlerResponse.respond(payload)
