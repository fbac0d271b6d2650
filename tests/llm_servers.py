"""Fake LLM providers on loopback, speaking the real wire protocols over real HTTP.

`FakeLLM("openai" | "anthropic", script)` is an HTTP/1.1 server (asyncio streams,
keep-alive) that answers `POST .../chat/completions` (OpenAI Chat Completions) or
`POST .../v1/messages` (Anthropic Messages) with bodies shaped exactly like the
providers'. `script` decides each answer from the request (`Seen`): a list of
replies played in order (the last repeats), or a callable. Every request is kept
in `requests` for assertions.

`Seen.conversation()` turns either protocol's body into one neutral view (system
text, messages, the spotlighted data blocks), so agent scripts are written once.

A request with `"stream": true` is answered with Server-Sent Events shaped like
the provider's (chunked transfer encoding): the reply's text in `pieces` (default:
one per word), the first after `first_s`, then one every `gap_s`, then the usage
and the terminator; `cut_after=N` drops the connection after N pieces, without
the end; `events` sends these raw SSE events instead. A reply's native `calls`
are streamed after its text, as the provider streams them.

Run as a script to re-record the demo cassette: `python -m tests.llm_servers`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentd.demo import DEMO_DIR

_BLOCK = re.compile(
    r"\u27e6data:(\w+) layer=(\d) source=([^\u27e7\n]*)\u27e7\n(.*?)\n\u27e6/data:\1\u27e7",
    re.DOTALL,
)
STATUS_TEXT = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
               429: "Too Many Requests", 500: "Internal Server Error",
               503: "Service Unavailable"}


@dataclass
class Reply:
    text: str = ""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None  # a raw body instead of the provider-shaped one
    input_tokens: int | None = None
    output_tokens: int | None = None
    delay_s: float = 0.0
    # Streamed replies only (see the module docstring).
    pieces: list[str] | None = None
    first_s: float = 0.0
    gap_s: float = 0.0
    cut_after: int | None = None
    events: list[str] | None = None
    # Native tool calls: (call id, tool name, arguments as JSON text), in order.
    calls: Sequence[tuple[str, str, str]] = ()


@dataclass(frozen=True)
class Block:
    layer: int
    source: str
    content: str


@dataclass(frozen=True)
class Conversation:
    system: str
    messages: tuple[tuple[str, str], ...]  # (role, content), system excluded

    @property
    def blocks(self) -> list[Block]:
        out: list[Block] = []
        for role, content in self.messages:
            if role in ("user", "tool"):
                out += [Block(int(m[2]), m[3], m[4]) for m in _BLOCK.finditer(content)]
        return out

    @property
    def task(self) -> str:
        return next(b.content for b in self.blocks if b.layer == 4)

    @property
    def results(self) -> list[Block]:
        return [b for b in self.blocks if b.layer == 5]

    @property
    def replies(self) -> list[str]:
        return [c for r, c in self.messages if r == "assistant"]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    protocol: str

    @property
    def json(self) -> dict[str, Any]:
        obj: dict[str, Any] = json.loads(self.body)
        return obj

    @property
    def streamed(self) -> bool:
        try:
            return self.json.get("stream") is True
        except ValueError:
            return False

    def conversation(self) -> Conversation:
        """Either protocol as (role, text) pairs; a tool result is a ("tool", text)
        pair of its own, right where the protocol puts it."""
        body = self.json
        if self.protocol == "anthropic":
            system = body.get("system", "")
            msgs = body["messages"]
        else:
            system = "\n".join(m["content"] for m in body["messages"] if m["role"] == "system")
            msgs = [m for m in body["messages"] if m["role"] != "system"]
        pairs: list[tuple[str, str]] = []
        for m in msgs:
            content = m["content"]
            if isinstance(content, list):  # Anthropic blocks
                for b in content:
                    if b["type"] == "tool_result":
                        pairs.append(("tool", b["content"]))
                text = "".join(b["text"] for b in content if b["type"] == "text")
                if text or not any(b["type"] == "tool_result" for b in content):
                    pairs.append((m["role"], text))
            else:
                pairs.append((m["role"], content or ""))
        return Conversation(system, tuple(pairs))

    def calls(self) -> list[tuple[str, str]]:
        """Every tool call of the request's assistant messages: (id, name)."""
        out: list[tuple[str, str]] = []
        for m in self.json["messages"]:
            if self.protocol == "openai":
                out += [(c["id"], c["function"]["name"]) for c in m.get("tool_calls") or ()]
            elif isinstance(m["content"], list):
                out += [(b["id"], b["name"]) for b in m["content"] if b["type"] == "tool_use"]
        return out

    def orphans(self) -> list[str]:
        """What a provider answers 400 to: a tool call whose result does not follow
        its message directly, or a result whose call is not in the message before."""
        problems: list[str] = []
        msgs = [m for m in self.json["messages"] if m["role"] != "system"]
        for i, m in enumerate(msgs):
            if self.protocol == "openai":
                ids = [c["id"] for c in m.get("tool_calls") or ()]
                follow = []
                for n in msgs[i + 1:]:
                    if n["role"] != "tool":
                        break
                    follow.append(n["tool_call_id"])
                if m["role"] == "assistant" and sorted(ids) != sorted(follow):
                    problems.append(f"message {i}: calls {ids}, results after it {follow}")
                if m["role"] == "tool":
                    j = i
                    while j > 0 and msgs[j - 1]["role"] == "tool":
                        j -= 1
                    owner = msgs[j - 1] if j else {}
                    if m["tool_call_id"] not in [c["id"] for c in owner.get("tool_calls") or ()]:
                        problems.append(f"message {i}: result {m['tool_call_id']} without call")
            else:
                blocks = m["content"] if isinstance(m["content"], list) else []
                ids = [b["id"] for b in blocks if b["type"] == "tool_use"]
                nxt = msgs[i + 1]["content"] if i + 1 < len(msgs) else []
                follow = [b["tool_use_id"] for b in (nxt if isinstance(nxt, list) else ())
                          if b["type"] == "tool_result"]
                if ids and sorted(ids) != sorted(follow):
                    problems.append(f"message {i}: calls {ids}, results after it {follow}")
                prev_blocks = msgs[i - 1]["content"] if i else []
                called = [b["id"] for b in (prev_blocks if isinstance(prev_blocks, list) else ())
                          if b["type"] == "tool_use"]
                for b in blocks:
                    if b["type"] == "tool_result" and b["tool_use_id"] not in called:
                        problems.append(f"message {i}: result {b['tool_use_id']} without call")
        return problems


Script = Callable[[Seen], "Reply | str"] | Sequence["Reply | str"]


class FakeLLM:
    def __init__(
        self,
        protocol: str = "openai",
        script: Script = ("ok",),
        model: str = "fake-1",
        embed: Callable[[str], list[float]] | None = None,
        port: int = 0,  # a fixed port: one a proxy's config already names
    ):
        assert protocol in ("openai", "anthropic")
        self.protocol = protocol
        self.embed = embed  # openai only: answers POST /v1/embeddings with embed(input)
        self.script = script
        self.model = model
        self.requests: list[Seen] = []
        self.in_flight = 0
        self.peak = 0  # most requests being answered at once
        self.first_piece_at: list[float] = []  # time.monotonic() of each stream's first piece
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()  # connections being served
        self.port = port

    @property
    def base_url(self) -> str:
        suffix = "/v1" if self.protocol == "openai" else ""
        return f"http://127.0.0.1:{self.port}{suffix}"

    async def __aenter__(self) -> FakeLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> FakeLLM:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            # Kept-alive connections too: a client's pooled connection must not reach
            # this server's script after it stopped (a proxy in front of a server that
            # a later test starts on the same port would be answered by the old one).
            for writer in list(self._open):
                writer.transport.abort()
            await self._server.wait_closed()
            self._server = None

    def _next(self, seen: Seen) -> Reply:
        if callable(self.script):
            reply = self.script(seen)
        else:
            i = min(len(self.requests) - 1, len(self.script) - 1)
            reply = self.script[i]
        return Reply(reply) if isinstance(reply, str) else reply

    async def _request(self, reader: asyncio.StreamReader) -> Seen | None:
        """The next request on a keep-alive connection; None once it ends."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await reader.readexactly(n) if n else b""
        return Seen(method, path, headers, body, self.protocol)

    async def _delay(self, seen: Seen, reply: Reply) -> None:
        """What happens before an answer goes out: the reply's delay."""
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            while True:
                seen = await self._request(reader)
                if seen is None:
                    return
                headers = seen.headers
                self.requests.append(seen)
                reply = self._expected_path(seen) or self._next(seen)
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                try:
                    await self._delay(seen, reply)
                    if reply.status == 200 and reply.body is None and seen.streamed:
                        if not await self._stream(seen, reply, writer):
                            return  # cut: the connection goes without the end
                        continue
                    writer.write(self._response(seen, reply))
                    await writer.drain()
                finally:
                    self.in_flight -= 1
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._open.discard(writer)
            writer.close()

    async def _stream(self, seen: Seen, reply: Reply, writer: asyncio.StreamWriter) -> bool:
        """A streamed reply; False if it was cut."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()

        async def send(event: str) -> None:
            data = event.encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            await writer.drain()

        pieces = reply.pieces if reply.pieces is not None else [
            w + " " for w in reply.text.split(" ")[:-1]] + reply.text.split(" ")[-1:]
        tokens_in = reply.input_tokens if reply.input_tokens is not None else len(seen.body) // 4
        tokens_out = (reply.output_tokens if reply.output_tokens is not None
                      else len("".join(pieces)) // 4 + 1)
        events = reply.events
        if events is None:
            events = [self._sse_piece(p) for p in pieces]
            events += [e for i, c in enumerate(reply.calls) for e in self._sse_call(i, *c)]
            head, tail = self._sse_ends(tokens_in, tokens_out, bool(reply.calls))
            events = head + events + tail
        else:
            head = []
        for i, event in enumerate(events):
            n = i - len(head)  # pieces sent before this event
            if reply.cut_after is not None and n >= reply.cut_after:
                writer.transport.abort()
                return False
            if n == 0 and reply.first_s:
                await asyncio.sleep(reply.first_s)
            elif n > 0 and reply.gap_s:
                await asyncio.sleep(reply.gap_s)
            await send(event)
            if n == 0:
                self.first_piece_at.append(time.monotonic())
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    def _sse_piece(self, text: str) -> str:
        if self.protocol == "openai":
            return "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                          "model": self.model, "choices": [
                {"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + "\n\n"
        return "event: content_block_delta\ndata: " + json.dumps(
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text}}) + "\n\n"

    def _sse_call(self, i: int, call_id: str, name: str, arguments: str) -> list[str]:
        """A native call streamed as the provider does: id and name first, then the
        arguments in two pieces (an Anthropic tool_use block after the text block)."""
        half = [arguments[:len(arguments) // 2], arguments[len(arguments) // 2:]]
        if self.protocol == "openai":
            def delta(call: dict[str, Any]) -> str:
                return "data: " + json.dumps({"id": "c", "model": self.model, "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": i, **call}]},
                     "finish_reason": None}]}) + "\n\n"
            return [delta({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": ""}})] + [
                delta({"function": {"arguments": a}}) for a in half]

        def ev(kind: str, obj: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: " + json.dumps({"type": kind, **obj}) + "\n\n"
        close_text = [ev("content_block_stop", {"index": 0})] if i == 0 else []
        return [*close_text, ev("content_block_start", {"index": i + 1, "content_block": {
                    "type": "tool_use", "id": call_id, "name": name, "input": {}}}),
                *[ev("content_block_delta", {"index": i + 1, "delta": {
                    "type": "input_json_delta", "partial_json": a}}) for a in half],
                ev("content_block_stop", {"index": i + 1})]

    def _sse_ends(self, tokens_in: int, tokens_out: int,
                  calls: bool = False) -> tuple[list[str], list[str]]:
        if self.protocol == "openai":
            return [], [
                "data: " + json.dumps({"id": "c", "model": self.model, "choices": [
                    {"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls
                     else "stop"}]}) + "\n\n",
                "data: " + json.dumps({"id": "c", "model": self.model, "choices": [],
                                       "usage": {"prompt_tokens": tokens_in,
                                                 "completion_tokens": tokens_out}}) + "\n\n",
                "data: [DONE]\n\n"]
        def ev(kind: str, obj: dict[str, Any]) -> str:
            return f"event: {kind}\ndata: " + json.dumps({"type": kind, **obj}) + "\n\n"
        return [ev("message_start", {"message": {"id": "m", "model": self.model, "usage": {
                    "input_tokens": tokens_in, "output_tokens": 1}}}),
                ev("content_block_start", {"index": 0, "content_block": {"type": "text",
                                                                          "text": ""}})], [
                *([] if calls else [ev("content_block_stop", {"index": 0})]),
                ev("message_delta", {"delta": {"stop_reason": "tool_use" if calls
                                               else "end_turn"},
                                     "usage": {"output_tokens": tokens_out}}),
                ev("message_stop", {})]

    def _expected_path(self, seen: Seen) -> Reply | None:
        want = "/v1/chat/completions" if self.protocol == "openai" else "/v1/messages"
        if self.embed is not None and seen.path == "/v1/embeddings":
            want = seen.path
        if seen.method != "POST" or seen.path != want:
            return Reply(status=404, body=b'{"error": {"message": "not found"}}')
        return None

    def _response(self, seen: Seen, reply: Reply) -> bytes:
        if reply.body is not None:
            body = reply.body
        elif reply.status == 200 and seen.path == "/v1/embeddings" and self.embed is not None:
            inputs = seen.json["input"]
            obj = {"object": "list", "model": seen.json["model"],
                   "data": [{"object": "embedding", "index": i, "embedding": self.embed(text)}
                            for i, text in enumerate(inputs)],
                   "usage": {"prompt_tokens": sum(len(t) // 4 + 1 for t in inputs),
                             "total_tokens": sum(len(t) // 4 + 1 for t in inputs)}}
            body = json.dumps(obj).encode()
        elif reply.status != 200:
            body = json.dumps({"error": {"message": f"status {reply.status}"}}).encode()
        else:
            tokens_in = (
                reply.input_tokens if reply.input_tokens is not None else len(seen.body) // 4
            )
            tokens_out = (
                reply.output_tokens if reply.output_tokens is not None
                else (len(reply.text) + sum(len(a) + len(n) for _, n, a in reply.calls)) // 4
                + 1
            )
            if self.protocol == "openai":
                message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
                if reply.calls:
                    message["tool_calls"] = [
                        {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                        for i, n, a in reply.calls]
                obj: dict[str, Any] = {
                    "id": f"chatcmpl-{len(self.requests)}", "object": "chat.completion",
                    "model": self.model,
                    "choices": [{"index": 0,
                                 "finish_reason": "tool_calls" if reply.calls else "stop",
                                 "message": message}],
                    "usage": {"prompt_tokens": tokens_in, "completion_tokens": tokens_out,
                              "total_tokens": tokens_in + tokens_out},
                }
            else:
                content: list[dict[str, Any]] = (
                    [{"type": "text", "text": reply.text}] if reply.text or not reply.calls
                    else [])
                content += [{"type": "tool_use", "id": i, "name": n, "input": _input(a)}
                            for i, n, a in reply.calls]
                obj = {
                    "id": f"msg_{len(self.requests)}", "type": "message", "role": "assistant",
                    "model": self.model, "content": content,
                    "stop_reason": "tool_use" if reply.calls else "end_turn",
                    "usage": {"input_tokens": tokens_in, "output_tokens": tokens_out},
                }
            body = json.dumps(obj).encode()
        head = [f"HTTP/1.1 {reply.status} {STATUS_TEXT.get(reply.status, 'Status')}",
                "content-type: application/json", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in reply.headers.items()]
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _input(arguments: str) -> Any:
    """A call's `input` as Anthropic sends it: the object; arguments that are not
    JSON as a string (what a broken model or proxy could send)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- scripts for agents --------------------------------------------------------------

ADD_NS = "https://xml-pipeline.org/ns/calculator/add/v1"
MUL_NS = "https://xml-pipeline.org/ns/calculator/multiply/v1"


def add_call(a: int, b: int, ns: str = ADD_NS) -> str:
    return f'<add xmlns="{ns}"><a>{a}</a><b>{b}</b></add>'


def values(blocks: Sequence[Block]) -> list[int]:
    """The <value> of every result that is a calculator sum."""
    return [int(m) for b in blocks for m in re.findall(r"<value>(-?\d+)</value>", b.content)]


def numbers(text: str) -> list[int]:
    """The integers in the task's <text> (or in `text` when it has none)."""
    inner = re.search(r"<text>(.*?)</text>", text, re.DOTALL)
    return [int(x) for x in re.findall(r"-?\d+", inner.group(1) if inner else text)]


def tutor_script(seen: Seen) -> Reply | str:
    """The demo tutor: "what is (A + B) * C?" -> add, then multiply, then the answer;
    with provider tools offered, as native tool calls, else as XML payloads."""
    conv = seen.conversation()
    a, b, c = numbers(conv.task)[:3]
    sums = values(conv.results)
    if "tools" in seen.json and len(sums) < 2:
        n = len(seen.calls()) + 1
        if not sums:
            return Reply(f"First I add {a} and {b}.", calls=[
                (f"call_{n}", "calculator__add", json.dumps({"a": a, "b": b}))])
        return Reply("Now I multiply.", calls=[
            (f"call_{n}", "calculator__multiply", json.dumps({"a": sums[0], "b": c}))])
    if not sums:
        return (
            f"First I add {a} and {b}.\n```xml\n<add xmlns=\"{ADD_NS}\"><a>{a}</a><b>{b}</b>"
            "</add>\n```"
        )
    if len(sums) == 1:
        return f'Now I multiply.\n<multiply xmlns="{MUL_NS}"><a>{sums[0]}</a><b>{c}</b></multiply>'
    return f"({a} + {b}) * {c} = {sums[1]}."


async def record_demo_cassette() -> None:  # pragma: no cover - a maintenance tool
    """Re-record agentd/demo/cassettes/agent-demo.jsonl from the tutor script: each
    question with native tool calls (the demo's `auto`), then with XML calls (what an
    isolated tutor, or `tool_calling: xml`, sends)."""
    import dataclasses

    from agentd.config import load_config
    from agentd.platform import make_agent_handlers
    from agentd.platform.demo import MathQuestion
    from agentd.testing import Harness

    cassette = DEMO_DIR / "cassettes" / "agent-demo.jsonl"
    demo = load_config(DEMO_DIR / "agent-demo.yaml")
    cassette.unlink(missing_ok=True)
    async with FakeLLM("openai", tutor_script) as server:
        for mode in ("auto", "xml"):
            assert demo.llm is not None
            live = dataclasses.replace(
                demo.llm.backends[0], provider="openai", base_url=server.base_url,
                model="fake-1", cassette=None, record=cassette,
            )
            listeners = tuple(
                dataclasses.replace(lst, agent=dataclasses.replace(lst.agent, tool_calling=mode))
                if lst.agent is not None else lst for lst in demo.listeners)
            config = dataclasses.replace(demo, llm=dataclasses.replace(demo.llm, backends=(
                live,)), listeners=listeners)
            handlers = make_agent_handlers(config)
            async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                               durable=False) as h:
                for question in DEMO_QUESTIONS:
                    frames = await h.send("alice", MathQuestion(text=question))
                    print(frames[-1].decode())
            await handlers.platform.aclose()


DEMO_QUESTIONS = ("What is (2 + 3) * 7?", "What is (40 + 2) * 10?")

if __name__ == "__main__":  # pragma: no cover
    asyncio.run(record_demo_cassette())


# ---- organisms for the tests -----------------------------------------------------------

CONFIG_DIR = DEMO_DIR  # the demo organisms, prompts and cassette (package data)


def organism_yaml(
    *backends: str,
    prompt: str = "You are a careful arithmetic tutor.\\n@fact refund_limit: 500 USD\\n"
                  "{tool_definitions}",
    agent: str = "",
    peers: str = "[calculator.add, calculator.multiply, echo]",
    profile_budget: str = "",
    strategy: str = "failover",
    retries: int = 0,
    cache_ttl_s: float = 0,
    extra_listeners: str = "",
    tutor_extra: str = "",
) -> str:
    """An organism with the agent `tutor` (MathQuestion), the calculator and echo.
    `backends` are YAML flow mappings for llm.backends; the first is the agent's."""
    first = re.search(r"name:\s*([\w.\-]+)", backends[0])
    assert first is not None
    budget = f", token_budget: {profile_budget}" if profile_budget else ""
    items = "\n".join(f"    - {b}" for b in backends)
    return f"""
organism: {{name: lab}}
pump: {{max_concurrency: 32, handler_timeout_s: 20, max_hops: 60}}
profiles:
  public: {{listeners: [tutor, calculator.add, calculator.multiply, echo]{budget}}}
  admin: {{listeners: all}}
prompts:
  no_paperclippers: file:prompts/no_paperclippers.md
  tutor_base: "{prompt}"
llm:
  strategy: {strategy}
  retries: {retries}
  cache_ttl_s: {cache_ttl_s}
  backends:
{items}
listeners:
  - name: tutor
    payload_class: agentd.platform.demo:MathQuestion
    description: Answers arithmetic questions.
    agent: {{prompt: "no_paperclippers & tutor_base", model: {first.group(1)}{agent}}}
    peers: {peers}{tutor_extra}
  - name: calculator.add
    payload_class: agentd.tools.calculator:Add
    response_class: agentd.tools.calculator:Sum
    handler: agentd.tools.calculator:add
    description: Adds two integers.
  - name: calculator.multiply
    payload_class: agentd.tools.calculator:Multiply
    response_class: agentd.tools.calculator:Sum
    handler: agentd.tools.calculator:multiply
    description: Multiplies two integers.
  - name: echo
    payload_class: agentd.tools.echo:Echo
    response_class: agentd.tools.echo:EchoReply
    handler: agentd.tools.echo:echo
    description: Echoes text back.
{extra_listeners}"""


def openai_backend(server: FakeLLM, name: str = "primary", extra: str = "") -> str:
    return (f"{{name: {name}, provider: {server.protocol}, base_url: \"{server.base_url}\", "
            f"model: fake-1{extra}}}")


def load(text: str) -> Any:
    from agentd.config import load_config_text

    return load_config_text(text, base_dir=CONFIG_DIR)
