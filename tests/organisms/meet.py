"""`meet`: a listener whose call waits (up to 10 s) for a second call to arrive
before either answers, so two calls meet only if they run at the same time."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from agentd import HandlerMetadata, HandlerResponse, xmlify

NS = "https://xml-pipeline.org/ns/test/meet"
ARRIVED: list[str] = []
BOTH = asyncio.Event()  # each test sets a new one, on its own loop


@xmlify(namespace=f"{NS}/meet/v1")
@dataclass
class Meet:
    side: str


@xmlify(namespace=f"{NS}/met/v1")
@dataclass
class Met:
    side: str
    met: bool


async def meet(payload: Meet, meta: HandlerMetadata) -> HandlerResponse:
    ARRIVED.append(payload.side)
    if len(ARRIVED) >= 2:
        BOTH.set()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            await BOTH.wait()
    return HandlerResponse.respond(Met(side=payload.side, met=BOTH.is_set()))


RETURNED = asyncio.Event()  # the second call has answered (each test sets a new one)


async def meet_last_first(payload: Meet, meta: HandlerMetadata) -> HandlerResponse:
    """`meet`, and the first call to arrive answers only once the second one has:
    their answers come back in the opposite order of the calls."""
    first = not ARRIVED
    reply = await meet(payload, meta)
    if first:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await RETURNED.wait()
    else:
        RETURNED.set()
    return reply


def listeners(*names: str, handler: str = "meet") -> str:
    """The `listeners:` entries (organism YAML) of meeting listeners `names`, each
    served by this module's `handler`."""
    return "".join(f"""\
  - name: {name}
    payload_class: tests.organisms.meet:Meet
    response_class: tests.organisms.meet:Met
    handler: tests.organisms.meet:{handler}
    description: Meets another call.
""" for name in names)
