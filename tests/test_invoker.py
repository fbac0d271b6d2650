"""The invoker without a pump: a handler's value or its failure comes back as a
value, a busy listener's calls wait for a slot, and a handler that never suspends
is told apart and called without a task."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from types import MappingProxyType
from typing import Any

from agentd._errors import Denied, HuhCode
from agentd._handler import HandlerMetadata, never_suspends
from agentd._routing import Listener
from agentd.pump.invoker import RAISED, CallFailed, Invoker

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


async def plain(payload: int, meta: HandlerMetadata) -> int:
    return payload + 1


async def awaits(payload: int, meta: HandlerMetadata) -> int:
    await asyncio.sleep(0)
    return payload


async def enters(payload: Any, meta: HandlerMetadata) -> None:
    async with payload:
        pass


async def iterates(payload: Any, meta: HandlerMetadata) -> list[Any]:
    return [x async for x in payload]


class Handler:
    async def __call__(self, payload: int, meta: HandlerMetadata) -> int:
        return payload


def test_only_a_plain_coroutine_function_without_an_await_never_suspends() -> None:
    assert never_suspends(plain) and listener(plain).immediate
    for handler in (awaits, enters, iterates, Handler(), functools.partial(plain),
                    lambda payload, meta: None, None):
        assert not never_suspends(handler), handler
        assert not listener(handler).immediate


def test_a_handler_that_never_suspends_is_called_on_the_callers_stack() -> None:
    invoker = Invoker(lambda: 1.0)  # not started: no loop, no task is needed
    lst = listener(plain)
    assert invoker.call_now(lst, 41, META) == 42
    assert invoker.calls == 1 and lst.active == 0


SEEN: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="unset")


def test_what_an_immediate_handler_sets_in_its_context_stays_its_own() -> None:
    """On a task a handler runs in a copy of the context; on the caller's stack it
    must too, or it would change the caller's (the bus session's) variables."""
    async def sets(payload: int, meta: HandlerMetadata) -> str:
        before = SEEN.get()
        SEEN.set("handler")
        return before

    SEEN.set("caller")
    assert never_suspends(sets)
    assert Invoker(lambda: 1.0).call_now(listener(sets), 1, META) == "caller"
    assert SEEN.get() == "caller"


def test_an_immediate_handlers_failures_are_outcomes_too() -> None:
    async def raises(payload: int, meta: HandlerMetadata) -> int:
        raise ValueError("boom")

    async def denies(payload: int, meta: HandlerMetadata) -> int:
        raise Denied("path-outside-root", path="/etc")

    invoker = Invoker(lambda: 1.0)
    lst = listener(raises)
    assert invoker.call_now(lst, 1, META) is RAISED and lst.active == 0
    denied = invoker.call_now(listener(denies), 1, META)
    assert isinstance(denied, CallFailed) and denied.code is HuhCode.DENIED
    assert denied.event == {"path": "/etc", "cause": "path-outside-root", "listener": "l"}
