"""The event loop's bounded busy-poll while a child's reply is due (agentd._spin)."""

from __future__ import annotations

import asyncio

from agentd._spin import LoopSpin


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_the_loop_spins_until_the_reply_is_there() -> None:
    loop = asyncio.get_running_loop()
    spin = LoopSpin(spin_s=60.0)  # a deadline that cannot pass during the test
    reply: asyncio.Future[object] = loop.create_future()
    spin.until(reply)
    await turns(5)
    assert spin.spinning  # still polling: the reply is due
    reply.set_result(None)
    await turns(2)
    assert not spin.spinning


async def test_the_spin_ends_at_its_deadline_without_a_reply() -> None:
    loop = asyncio.get_running_loop()
    spin = LoopSpin(spin_s=0.0)
    reply: asyncio.Future[object] = loop.create_future()
    spin.until(reply)
    await turns(2)
    assert not spin.spinning  # bounded: it gave up, the reply will wake the loop
    reply.cancel()


async def test_one_chain_serves_the_latest_request() -> None:
    loop = asyncio.get_running_loop()
    spin = LoopSpin(spin_s=60.0)
    first: asyncio.Future[object] = loop.create_future()
    second: asyncio.Future[object] = loop.create_future()
    scheduled = len(loop._ready) if hasattr(loop, "_ready") else None  # asyncio's loop
    spin.until(first)
    spin.until(second)
    if scheduled is not None:
        assert len(loop._ready) == scheduled + 1  # one callback, not one per request
    first.set_result(None)
    await turns(3)
    assert spin.spinning  # the latest request's reply is still due
    second.set_result(None)
    await turns(2)
    assert not spin.spinning
