"""The invoker without a pump: a handler's value or its failure comes back as a
value, and a busy listener's calls wait for a slot."""

from __future__ import annotations

import asyncio
from types import MappingProxyType
from typing import Any

from agentd._handler import HandlerMetadata
from agentd._routing import Listener
from agentd.pump.invoker import RAISED, Invoker

META = HandlerMetadata("t", "alice", "l")


def listener(handler: Any, max_concurrency: int = 1) -> Listener:
    return Listener("l", handler, (), MappingProxyType({}), frozenset(), False, "", 5.0,
                    max_concurrency)


async def started() -> Invoker:
    invoker = Invoker(lambda: 1.0)
    invoker.start(asyncio.get_running_loop())
    return invoker


async def test_the_handlers_value_is_returned() -> None:
    async def handler(payload: int, meta: HandlerMetadata) -> int:
        return payload + 1

    invoker = await started()
    assert await invoker.call(listener(handler), 41, META) == 42
    assert invoker.calls == 1
    await invoker.stop()


async def test_a_raising_handler_is_an_outcome_not_an_exception() -> None:
    async def handler(payload: int, meta: HandlerMetadata) -> int:
        raise ValueError("boom")

    invoker = await started()
    lst = listener(handler)
    assert await invoker.call(lst, 1, META) is RAISED
    assert lst.active == 0  # the slot is given back
    await invoker.stop()


async def test_calls_beyond_a_listeners_concurrency_wait_for_a_slot() -> None:
    gate, entered = asyncio.Event(), asyncio.Event()
    running: list[int] = []

    async def handler(payload: int, meta: HandlerMetadata) -> int:
        running.append(payload)
        entered.set()
        await gate.wait()
        return payload

    invoker = await started()
    lst = listener(handler, max_concurrency=1)
    first = asyncio.ensure_future(invoker.call(lst, 1, META))
    second = asyncio.ensure_future(invoker.call(lst, 2, META))
    await entered.wait()  # the first call is inside its handler
    assert running == [1] and lst.active == 1 and not second.done()
    gate.set()
    assert await asyncio.gather(first, second) == [1, 2]
    assert running == [1, 2] and lst.active == 0
    await invoker.stop()
