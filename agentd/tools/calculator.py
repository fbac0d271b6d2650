"""A calculator tool: the smallest useful listener."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from agentd import HandlerMetadata, HandlerResponse, xmlify

NS = "https://xml-pipeline.org/ns/calculator"


@xmlify(namespace=f"{NS}/add/v1")
@dataclass
class Add:
    """Adds two integers."""

    a: Annotated[int, "the first addend"]
    b: Annotated[int, "the second addend"]


@xmlify(namespace=f"{NS}/multiply/v1")
@dataclass
class Multiply:
    """Multiplies two integers."""

    a: Annotated[int, "the first factor"]
    b: Annotated[int, "the second factor"]


@xmlify(namespace=f"{NS}/sum/v1")
@dataclass
class Sum:
    """The result of a calculation."""

    value: Annotated[int, "the result"]


async def add(payload: Add, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Sum(value=payload.a + payload.b))


async def multiply(payload: Multiply, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Sum(value=payload.a * payload.b))
