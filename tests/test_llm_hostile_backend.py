"""A hostile or broken LLM backend (a real HTTP server on loopback, speaking the
OpenAI protocol badly on purpose) cannot hold a call past its timeout, fill the
daemon's memory, or drain budgets and token buckets with impossible usage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from agentd.config import LlmBackendConfig, LlmConfig
from agentd.llm import ChatMessage, LlmRequest, LlmRouter
from agentd.llm._http import MAX_RESPONSE_BYTES

GOOD = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


class Evil:
    """One behaviour per test: `drip` (a byte a second, forever), `huge` (a body over
    the limit), or a JSON document to answer with."""

    def __init__(self, behaviour: str | dict) -> None:
        self.behaviour = behaviour
        self.sent = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            if self.behaviour == "drip":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: 1000000\r\n\r\n")
                while True:
                    writer.write(b" ")
                    await writer.drain()
                    self.sent += 1
                    await asyncio.sleep(0.2)
            elif self.behaviour == "huge":
                size = MAX_RESPONSE_BYTES + (1 << 20)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % size)
                chunk = b" " * (1 << 20)
                for _ in range(size >> 20):
                    writer.write(chunk)
                    await writer.drain()
                    self.sent += len(chunk)
            else:
                body = json.dumps(self.behaviour).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def router_for(evil: Evil) -> AsyncIterator[LlmRouter]:
    server = await asyncio.start_server(evil.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    config = LlmConfig(strategy="failover", retries=0, cache_ttl_s=0.0, backends=(
        LlmBackendConfig(name="evil", provider="openai", base_url=f"http://127.0.0.1:{port}/v1",
                         model="m", timeout_s=1.0, tokens_per_minute=100_000),))
    router = LlmRouter(config)
    try:
        yield router
    finally:
        await router.aclose()
        server.close()


REQUEST = LlmRequest("sys", (ChatMessage("user", "hi"),), 64, 0.0, "", "tester")


@pytest.fixture
async def dripping() -> AsyncIterator[tuple[Evil, LlmRouter]]:
    evil = Evil("drip")
    async for router in router_for(evil):
        yield evil, router


async def test_a_backend_dripping_its_answer_fails_at_timeout_s(dripping) -> None:
    """timeout_s bounds the attempt, not each read: a byte every 0.2 s never ends a
    read timeout, so the call used to wait for as long as the server liked."""
    evil, router = dripping
    with pytest.raises(Exception, match="timed out"):
        await asyncio.wait_for(router.complete(REQUEST), 20)
    assert 0 < evil.sent < 20  # cut off after about 1 s, not after the whole body


async def test_a_backend_answering_too_much_is_cut_off() -> None:
    evil = Evil("huge")
    async for router in router_for(evil):
        with pytest.raises(Exception, match="response over"):
            await asyncio.wait_for(router.complete(REQUEST), 60)
    assert evil.sent <= MAX_RESPONSE_BYTES + (1 << 20)


async def test_impossible_usage_is_bounded_and_cannot_lock_the_bucket() -> None:
    evil = Evil({**GOOD, "usage": {"prompt_tokens": 10**15, "completion_tokens": 10**12}})
    async for router in router_for(evil):
        response = await asyncio.wait_for(router.complete(REQUEST), 20)
        bucket = router.backends["evil"].tpm
        assert bucket is not None
        assert response.input_tokens <= 4 * REQUEST.estimated_input_tokens + 1024
        assert response.output_tokens <= REQUEST.max_tokens
        assert bucket.level >= -bucket.capacity
        evil.behaviour = GOOD
        assert (await asyncio.wait_for(router.complete(REQUEST), 20)).text == "hi"


async def test_usage_of_zero_still_counts_against_budgets() -> None:
    """A backend reporting 0 tokens made every budget count nothing: an agent forking
    itself ran 567 model calls in 25 s under a 20,000-token budget. Usage below a
    quarter of the platform's own byte estimate is counted at that quarter."""
    text = "a fairly long answer " * 50
    evil = Evil({**GOOD, "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}],
                 "usage": {"prompt_tokens": 0, "completion_tokens": 0}})
    request = LlmRequest("sys " * 200, (ChatMessage("user", "hi " * 200),), 64, 0.0, "",
                         "tester")
    async for router in router_for(evil):
        response = await asyncio.wait_for(router.complete(request), 20)
        assert response.input_tokens >= request.estimated_input_tokens // 4 > 0
        assert response.output_tokens >= len(text) // 16 > 0
