"""The LLM layer against real HTTP servers on loopback speaking each provider's wire
protocol: encoding, secrets, failover, retries and Retry-After, 4xx handling, token
buckets, concurrency, the response cache, record and replay."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from agentd._errors import ConfigError
from agentd.config import LlmBackendConfig, LlmConfig
from agentd.llm import (
    BackendError,
    Cassette,
    ChatMessage,
    LlmRequest,
    LlmRouter,
    NoBackendAvailable,
    ReplayMiss,
    RequestTooLarge,
    TokenBucket,
    retry_after_s,
)
from agentd.llm._wire import alternate
from tests.llm_servers import FakeLLM, Reply


class FakeClock:
    """Virtual time: `sleep` advances it at once (and yields to the loop)."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


def backend(name: str, server: FakeLLM | None = None, **kw: object) -> LlmBackendConfig:
    provider = kw.pop("provider", server.protocol if server else "openai")
    base_url = kw.pop("base_url", server.base_url if server else None)
    return LlmBackendConfig(
        name=name, provider=provider, base_url=base_url, model=kw.pop("model", "m-1"),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def router(*backends: LlmBackendConfig, clock: FakeClock | None = None, **kw: object) -> LlmRouter:
    cfg = LlmConfig(
        strategy=kw.pop("strategy", "failover"),  # type: ignore[arg-type]
        backends=backends,
        retries=kw.pop("retries", 2),  # type: ignore[arg-type]
        cache_ttl_s=kw.pop("cache_ttl_s", 0.0),  # type: ignore[arg-type]
    )
    return LlmRouter(cfg, clock=clock or FakeClock(), rng=lambda: 0.5, **kw)  # type: ignore[arg-type]


def request(text: str = "hello", *, system: str = "You are terse.", max_tokens: int = 64,
            nonce: str = "") -> LlmRequest:
    return LlmRequest(system, (ChatMessage("user", text),), max_tokens, 0.2, nonce, "tester")


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- wire protocols -------------------------------------------------------------------


async def test_openai_request_has_the_system_prompt_first_and_the_key_from_the_env() -> None:
    async with FakeLLM("openai", ["hi there"]) as server:
        r = router(backend("a", server, api_key_env="TEST_OPENAI_KEY"),
                   env={"TEST_OPENAI_KEY": "sk-secret-1"})
        resp = await r.complete(request())
        await r.aclose()
    assert resp.text == "hi there" and resp.backend == "a"
    seen = server.requests[0]
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == "Bearer sk-secret-1"
    body = seen.json
    assert body["model"] == "m-1" and body["max_tokens"] == 64 and body["temperature"] == 0.2
    assert body["messages"][0] == {"role": "system", "content": "You are terse."}
    assert body["messages"][1] == {"role": "user", "content": "hello"}
    assert resp.input_tokens == len(seen.body) // 4  # the provider's usage, not an estimate


async def test_anthropic_system_prompt_goes_in_its_own_field() -> None:
    async with FakeLLM("anthropic", ["bonjour"]) as server:
        r = router(backend("c", server, api_key_env="TEST_ANTHROPIC_KEY"),
                   env={"TEST_ANTHROPIC_KEY": "sk-ant-2"})
        req = LlmRequest("Be brief.", (ChatMessage("user", "one"), ChatMessage("user", "two"),
                                       ChatMessage("assistant", "ok")), 32, 1.5)
        resp = await r.complete(req)
        await r.aclose()
    seen = server.requests[0]
    assert seen.path == "/v1/messages"
    assert seen.headers["x-api-key"] == "sk-ant-2"
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in seen.headers
    body = seen.json
    assert body["system"] == "Be brief."
    assert all(m["role"] != "system" for m in body["messages"])
    assert body["messages"][0] == {"role": "user", "content": "one\n\ntwo"}  # merged: alternation
    assert body["temperature"] == 1.0  # clamped to Anthropic's range
    assert resp.text == "bonjour" and resp.output_tokens == len("bonjour") // 4 + 1


def test_alternation_starts_with_user() -> None:
    out = alternate((ChatMessage("assistant", "a"), ChatMessage("user", "u")))
    assert [m.role for m in out] == ["user", "assistant", "user"]


async def test_a_missing_key_variable_is_named_never_its_value_and_fails_over() -> None:
    async with FakeLLM("openai", ["from b"]) as b:
        r = router(backend("a", base_url="http://127.0.0.1:9/v1", api_key_env="NOT_SET_VAR"),
                   backend("b", b), env={})
        resp = await r.complete(request(), prefer="a")
        await r.aclose()
    assert resp.backend == "b"


async def test_no_auth_header_without_api_key_env() -> None:
    async with FakeLLM("openai", ["ok"]) as server:
        r = router(backend("local", server))
        await r.complete(request())
        await r.aclose()
    assert "authorization" not in server.requests[0].headers


# ---- failover, retries, Retry-After, 4xx ---------------------------------------------------


async def test_failover_from_a_failing_backend_to_a_healthy_one() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", [Reply(status=500)]) as bad, \
            FakeLLM("anthropic", ["healthy"]) as good:
        r = router(backend("bad", bad), backend("good", good), clock=clock, retries=2)
        resp = await r.complete(request(), prefer="bad")
        await r.aclose()
    assert resp.text == "healthy" and resp.backend == "good"
    assert len(bad.requests) == 3  # one attempt and two retries
    assert len(good.requests) == 1
    assert resp.attempts == 4
    assert clock.sleeps == [0.375, 0.75]  # exponential (0.5, 1.0) with "equal jitter" at 0.5


async def test_a_backend_that_refuses_connections_is_skipped() -> None:
    async with FakeLLM("openai", ["up"]) as good:
        r = router(backend("down", base_url=f"http://127.0.0.1:{closed_port()}/v1"),
                   backend("up", good), retries=1)
        resp = await r.complete(request(), prefer="down")
        await r.aclose()
    assert resp.backend == "up"


async def test_429_with_retry_after_is_honoured() -> None:
    clock = FakeClock()
    script = [Reply(status=429, headers={"retry-after": "7"}), Reply(text="after the wait")]
    async with FakeLLM("openai", script) as server:
        r = router(backend("a", server), clock=clock)
        resp = await r.complete(request())
        await r.aclose()
    assert resp.text == "after the wait"
    assert len(server.requests) == 2
    assert clock.sleeps == [7.0]  # exactly what the provider asked, not the backoff


async def test_a_retry_after_longer_than_allowed_fails_over_instead_of_stalling() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", [Reply(status=429, headers={"retry-after": "3600"})]) as slow, \
            FakeLLM("openai", ["other"]) as other:
        r = router(backend("slow", slow), backend("other", other), clock=clock)
        resp = await r.complete(request(), prefer="slow")
        await r.aclose()
    assert resp.backend == "other" and clock.sleeps == [] and len(slow.requests) == 1


def test_retry_after_forms() -> None:
    assert retry_after_s({"retry-after": "3"}) == 3.0
    assert retry_after_s({"retry-after-ms": "250"}) == 0.25
    assert retry_after_s({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=1445412470.0) == 10
    assert retry_after_s({"retry-after": "soon"}) is None
    assert retry_after_s({}) is None


async def test_no_retry_and_no_failover_on_400() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", [Reply(status=400)]) as server, \
            FakeLLM("openai", ["never"]) as other:
        r = router(backend("a", server), backend("b", other), clock=clock, retries=3)
        with pytest.raises(BackendError) as err:
            await r.complete(request())
        await r.aclose()
    assert err.value.status == 400 and not err.value.retryable
    assert len(server.requests) == 1 and len(other.requests) == 0 and clock.sleeps == []


async def test_401_fails_over_without_retry() -> None:
    async with FakeLLM("openai", [Reply(status=401)]) as server, \
            FakeLLM("openai", ["ok"]) as other:
        r = router(backend("a", server), backend("b", other), retries=3)
        resp = await r.complete(request())
        await r.aclose()
    assert resp.backend == "b" and len(server.requests) == 1


async def test_every_backend_failing_reports_each() -> None:
    async with FakeLLM("openai", [Reply(status=503)]) as a, \
            FakeLLM("openai", [Reply(body=b"not json")]) as b:
        r = router(backend("a", a), backend("b", b), retries=0)
        with pytest.raises(NoBackendAvailable) as err:
            await r.complete(request())
        await r.aclose()
    assert [e.backend for e in err.value.errors] == ["a", "b"]  # type: ignore[union-attr]
    assert "HTTP 503" in str(err.value) and "not JSON" in str(err.value)
    assert err.value.retry_allowed  # a 503 can pass: the client may ask again


async def test_round_robin_spreads_calls() -> None:
    async with FakeLLM("openai", ["x"]) as a, FakeLLM("openai", ["y"]) as b:
        r = router(backend("a", a), backend("b", b), strategy="round-robin")
        got = [(await r.complete(request(str(i)))).backend for i in range(4)]
        await r.aclose()
    assert got == ["a", "b", "a", "b"]


# ---- limits -------------------------------------------------------------------------------


async def test_token_bucket_paces_requests_per_minute() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", ["ok"]) as server:
        r = router(backend("a", server, requests_per_minute=2), clock=clock)
        for i in range(5):
            await r.complete(request(str(i)))
        await r.aclose()
    # Two go at once (the bucket holds a minute's worth); then one every 30 s.
    assert len(server.requests) == 5
    assert clock.sleeps == pytest.approx([30.0, 30.0, 30.0])


async def test_token_bucket_paces_tokens_per_minute_and_settles_with_actual_usage() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", [Reply("ok", input_tokens=10, output_tokens=10)]) as server:
        r = router(backend("a", server, tokens_per_minute=600), clock=clock)
        for i in range(4):
            await r.complete(request(str(i), max_tokens=250))
        await r.aclose()
    # ~260 tokens are reserved per call but only 20 are charged afterwards: no waiting.
    assert clock.sleeps == []
    bucket = r.backends["a"].tpm
    assert bucket is not None and bucket.level == pytest.approx(600 - 4 * 20)


async def test_a_request_larger_than_the_bucket_fails_clearly() -> None:
    async with FakeLLM("openai", ["never"]) as server:
        r = router(backend("a", server, tokens_per_minute=100))
        with pytest.raises(RequestTooLarge, match="tokens_per_minute is 100"):
            await r.complete(request(max_tokens=500))
        await r.aclose()
    assert server.requests == []


async def test_token_bucket_unit() -> None:
    clock = FakeClock()
    bucket = TokenBucket(10, 1.0, clock)
    assert await bucket.take(10) == 0
    assert await bucket.take(4) == pytest.approx(4.0)
    bucket.adjust(-100)  # refunds never overflow the capacity
    assert bucket.level == 10
    with pytest.raises(RequestTooLarge):
        await bucket.take(11)


async def test_concurrency_is_limited_per_backend() -> None:
    async with FakeLLM("openai", [Reply("slow", delay_s=0.05)]) as server:
        r = router(backend("a", server, max_concurrency=2))
        await asyncio.gather(*(r.complete(request(str(i))) for i in range(6)))
        await r.aclose()
    assert len(server.requests) == 6 and server.peak == 2


class Gate:
    """An OpenAI-compatible server that holds every request until `expect` are open at
    once (or `hold_s` passed), then answers them all: the most requests it saw open
    at once, and the connections they came on, are counted."""

    ANSWER = json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()

    def __init__(self, expect: int, hold_s: float = 5.0) -> None:
        self.expect, self.hold_s = expect, hold_s
        self.open = self.peak = self.connections = self.answered = 0
        self.full = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.open += 1
                self.peak = max(self.peak, self.open)
                if self.open >= self.expect:
                    self.full.set()
                try:
                    async with asyncio.timeout(self.hold_s):
                        await self.full.wait()
                except TimeoutError:
                    pass
                self.open -= 1
                self.answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(self.ANSWER) + self.ANSWER)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_the_default_lets_hundreds_of_calls_wait_on_one_backend_at_once() -> None:
    """Agents wait seconds on a model: the default max_concurrency (8) made one backend
    answering in 2 s serve 4 calls a second to the whole organism. 200 calls are now
    open at the backend at once, on at most 200 connections, reused afterwards."""
    gate = Gate(expect=200)
    server = await asyncio.start_server(gate.serve, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    try:
        r = router(backend("a", base_url=f"http://127.0.0.1:{port}/v1"), retries=0)
        answers = await asyncio.gather(*(r.complete(request(str(i))) for i in range(200)))
        assert gate.peak == 200 and gate.connections <= 200
        again = await asyncio.gather(*(r.complete(request(f"again {i}")) for i in range(20)))
        await r.aclose()
    finally:
        server.close()
    assert {a.text for a in answers + again} == {"ok"}
    assert gate.connections <= 200  # the second round reused kept-alive connections


async def test_a_backend_dropping_the_connection_mid_answer_fails_over() -> None:
    """A reply cut off below HTTP (headers promise a body that never comes) is a
    retryable connection failure, then the next backend answers."""
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n{\"choi")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clock = FakeClock()
    try:
        async with FakeLLM("openai", ["from the other"]) as good:
            r = router(backend("cut", base_url=f"http://127.0.0.1:{port}/v1"),
                       backend("good", good), clock=clock, retries=1)
            resp = await r.complete(request(), prefer="cut")
            await r.aclose()
    finally:
        server.close()
    assert resp.backend == "good" and resp.text == "from the other"
    assert resp.attempts == 3 and len(clock.sleeps) == 1  # retried once, then failed over


async def test_a_proxy_named_in_the_environment_carries_the_calls(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY is honoured (as it was with httpx): the request reaches the proxy in
    absolute form, for a backend host the proxy alone can reach."""
    seen: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        seen.append(head.split(b"\r\n")[0])
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(Gate.ANSWER) + Gate.ANSWER)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    try:
        r = router(backend("far", base_url="http://model.invalid/v1"), retries=0)
        resp = await r.complete(request())
        await r.aclose()
    finally:
        server.close()
    assert resp.text == "ok"
    assert seen == [b"POST http://model.invalid/v1/chat/completions HTTP/1.1"]


# ---- cache --------------------------------------------------------------------------------


async def test_cache_hit_answers_an_identical_request_without_a_call() -> None:
    clock = FakeClock()
    async with FakeLLM("openai", ["first"]) as server:
        r = router(backend("a", server), clock=clock, cache_ttl_s=60)
        one = await r.complete(request(nonce="aaaa", text="q aaaa"))
        two = await r.complete(request(nonce="bbbb", text="q bbbb"))  # only the nonce differs
        assert len(server.requests) == 1
        assert not one.cached and two.cached and two.text == "first"
        await r.complete(request(text="another question"))
        assert len(server.requests) == 2
        clock.t += 61  # expired
        three = await r.complete(request(nonce="cccc", text="q cccc"))
        await r.aclose()
    assert not three.cached and len(server.requests) == 3


# ---- record and replay --------------------------------------------------------------------


async def test_record_then_replay_the_same_answers_offline(tmp_path: Path) -> None:
    cassette = tmp_path / "c.jsonl"
    async with FakeLLM("anthropic", ["alpha", "beta"]) as server:
        r = router(backend("live", server, api_key_env="K", record=cassette), env={"K": "sk-9"})
        live = [(await r.complete(request(f"{t} 0123abcd", nonce="0123abcd"))).text
                for t in ("1", "2")]
        await r.aclose()
    text = cassette.read_text()
    assert "sk-9" not in text and "0123abcd" not in text and "1 NONCE" in text
    assert len(Cassette.load(cassette).exchanges) == 2
    replay = router(LlmBackendConfig(name="tape", provider="replay", cassette=cassette))
    again = [(await replay.complete(request(f"{t} ffff0000", nonce="ffff0000"))).text
             for t in ("1", "2")]
    with pytest.raises(NoBackendAvailable, match="no recorded exchange") as miss:
        await replay.complete(request("never recorded"))
    assert isinstance(miss.value.errors[0], ReplayMiss)
    assert not miss.value.retry_allowed  # the recording will not grow: asking again is futile
    await replay.aclose()
    assert again == live == ["alpha", "beta"]


def test_a_broken_cassette_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "k", "response": {"text": "t"}}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        Cassette.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        Cassette.load(tmp_path / "missing.jsonl")


def test_cassette_replays_by_conversation_when_the_system_prompt_changed(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    old = request("same question", system="old prompt")
    path.write_text(json.dumps({
        "key": old.key, "conversation": old.conversation_key, "request": old.normalised(),
        "response": {"text": "recorded", "input_tokens": 1, "output_tokens": 1},
    }) + "\n")
    found = Cassette.load(path).lookup(request("same question", system="new prompt"))
    assert found is not None and found.to_response("tape").text == "recorded"
