"""agentd against LiteLLM's proxy, the real one from PyPI: started here on loopback in
front of scripted upstreams (tests/llm_servers.py), with no telemetry, no database
and no network, and stopped at the end. An agent's native tool calls round-trip
through it on the OpenAI protocol and the Anthropic protocol (`/v1/messages`), two
parallel calls and an error result among them, from an agent in the daemon and from
one isolated in a worker process; a streamed answer reaches an
`agentd.client` stream as partials, in order, before its final, and its usage is
counted from the stream's usage chunk. A stream the upstream cuts ends interrupted
and is asked again; an upstream's 400 to tools lets `auto` fall back to XML.

The proxy is found through AGENTD_LITELLM (the `litellm` command of a venv of its
own: `.ci/run` installs it from .ci/litellm-requirements.txt); without it the tests
that need it skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentd.client import Answer, Client, Final, Partial
from agentd.platform.demo import MathQuestion
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.llm_servers import FakeLLM, Reply, Seen, add_call, values
from tests.test_agents import answered, organism
from tests.test_isolation_agents import ISOLATED, clean
from tests.test_isolation_agents import organism as isolated_organism
from tests.test_llm import backend, router
from tests.test_llm_stream import Sink, complete
from tests.test_llm_tools_wire import refuses_tools, with_tools
from tests.test_native_agents import call, files_organism

LITELLM = os.environ.get("AGENTD_LITELLM", "")
PROTOCOLS = ["openai", "anthropic"]
# (the proxy's model, the protocol agentd speaks to it, the upstream's protocol): the
# proxy passes each protocol through, and translates OpenAI to Anthropic, the way it
# fronts Claude for OpenAI clients.
ROUTES = [("via-openai", "openai", "openai"), ("via-anthropic", "anthropic", "anthropic"),
          ("openai-to-anthropic", "openai", "anthropic")]
STARTUP_S = 240  # the proxy imports a great deal (docs/llm-platform.md)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class Proxy:
    url: str
    key: str
    upstream: dict[str, int]  # the proxy's model -> the port its scripted upstream takes
    log: Path

    def backend(self, model: str, protocol: str) -> dict[str, Any]:
        """agentd's backend entry for the proxy's `model`, spoken to in `protocol`."""
        return {"name": "proxy", "provider": protocol,
                "base_url": self.url + ("/v1" if protocol == "openai" else ""),
                "model": model, "api_key_env": "AGENTD_TEST_LITELLM_KEY"}

    def backend_yaml(self, model: str, protocol: str) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.backend(model, protocol).items()) + "}"

    def upstream_server(self, model: str, protocol: str, script: Any) -> FakeLLM:
        return FakeLLM(protocol, script, port=self.upstream[model])


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    if not LITELLM:
        pytest.skip("AGENTD_LITELLM is not set: .ci/run installs LiteLLM's proxy")
    home = tmp_path_factory.mktemp("litellm")
    upstream = {model: free_port() for model, _, _ in ROUTES}
    config = {
        "model_list": [{"model_name": model, "litellm_params": {
            "model": f"{up}/fake-1", "api_key": "upstream-key",
            "api_base": f"http://127.0.0.1:{upstream[model]}" + ("/v1" if up == "openai" else "")},
        } for model, _, up in ROUTES],
        "litellm_settings": {"telemetry": False, "num_retries": 0},
        "general_settings": {"master_key": "os.environ/LITELLM_MASTER_KEY"},
    }
    (home / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    key = "sk-" + secrets.token_hex(16)
    port = free_port()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
           "LITELLM_MASTER_KEY": key, "LITELLM_TELEMETRY": "False",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the price list
           "NO_PROXY": "*", "no_proxy": "*"}
    log = home / "proxy.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [LITELLM, "--config", str(home / "config.yaml"), "--host", "127.0.0.1",
             "--port", str(port), "--num_workers", "1"],
            cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:  # the health endpoint answers once the app has started
            if proc.poll() is not None:
                raise RuntimeError("LiteLLM's proxy exited:\n" + log.read_text()[-3000:])
            try:
                with urllib.request.urlopen(url + "/health/liveliness", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError("LiteLLM's proxy did not start:\n"
                                       + log.read_text()[-3000:]) from None
                # the next try in half a second, or at once if it exits
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
        os.environ["AGENTD_TEST_LITELLM_KEY"] = key
        yield Proxy(url, key, upstream, log)
    finally:
        os.environ.pop("AGENTD_TEST_LITELLM_KEY", None)
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- native tool calls through the proxy ------------------------------------------------


def results(seen: Seen) -> dict[str, tuple[str, bool]]:
    """Call id -> (result text, flagged as an error) of every tool result the
    upstream got, in either protocol (a translated result's content may be blocks)."""
    out: dict[str, tuple[str, bool]] = {}
    for m in seen.json["messages"]:
        if seen.protocol == "openai" and m["role"] == "tool":
            out[m["tool_call_id"]] = (m["content"], m["content"].startswith("error:"))
        elif seen.protocol == "anthropic" and isinstance(m["content"], list):
            for b in m["content"]:
                if b["type"] == "tool_result":
                    content = b["content"]
                    if isinstance(content, list):
                        content = "".join(c.get("text", "") for c in content)
                    out[b["tool_use_id"]] = (content, b.get("is_error") is True)
    return out


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
@pytest.mark.parametrize("model, protocol, upstream", ROUTES)
async def test_native_calls_round_trip_through_the_proxy(
        model: str, protocol: str, upstream: str, isolated: bool, proxy: Proxy,
        tmp_path: Path) -> None:
    """Two parallel calls in one reply, one to a file that does not exist (the tool's
    `huh`, an error result) and one that reads: each result reaches the upstream
    through the proxy under its own call id, the error flagged as the protocol says.
    Isolated, the agent's loop runs in a worker process and the daemon's bridge
    decides and sends its calls: the same results, and no worker replaced."""
    script = [Reply("Reading both.", calls=[call("call_n1", "notes", path="missing.txt"),
                                             call("call_p1", "pages", path="a.txt")]),
              Reply("one of two")]
    text = files_organism(proxy.backend_yaml(model, protocol), tmp_path,
                          tutor_extra=ISOLATED if isolated else "")
    start = isolated_organism if isolated else organism
    async with proxy.upstream_server(model, upstream, script) as server, \
            start(text) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="read two files"))
        if isolated:
            assert clean(h, hs) and h.isolation.pools["tutor"].restarts == 0
    assert answered(frames) == "one of two", proxy.log.read_text()[-3000:]
    first, second = server.requests
    names = [t["function"]["name"] if upstream == "openai" else t["name"]
             for t in first.json["tools"]]
    assert names == ["notes", "pages"]
    assert second.calls() == [("call_n1", "notes"), ("call_p1", "pages")]
    assert second.orphans() == []
    got = results(second)
    assert "huh" in got["call_n1"][0] and "from pages" in got["call_p1"][0]
    if protocol == upstream:  # the error is flagged as agentd's protocol says
        assert got["call_n1"][1] and not got["call_p1"][1]
    else:  # translated: OpenAI has no flag; the text says it (Anthropic's is_error unset)
        assert got["call_n1"][0].startswith("error: ")
        assert not got["call_p1"][0].startswith("error: ")


# ---- a streamed answer through the proxy to an agentd.client stream --------------------


def streamed(seen: Seen) -> Reply:
    """The first reply calls calculator.add in XML (streamed, never shown), the
    second writes the answer; each with its own usage figures."""
    got = values(seen.conversation().results)
    if not got:
        return Reply(pieces=["Let me ", "add.\n", add_call(2, 40)[:9], add_call(2, 40)[9:]],
                     gap_s=0.01, input_tokens=1201, output_tokens=31)
    return Reply(pieces=["The ", "sum ", "is ", f"{got[0]}."], gap_s=0.01,
                 input_tokens=1302, output_tokens=42)


def tokens(metrics: str, kind: str) -> float:
    line = re.compile(r'^agentd_llm_tokens_total\{[^}]*backend="proxy"[^}]*kind="(\w+)"'
                      r'[^}]*\} (\S+)$', re.MULTILINE)
    m = next((m for m in line.finditer(metrics) if m.group(1) == kind), None)
    assert m is not None, metrics
    return float(m.group(2))


def demo_on_the_proxy(tmp_path: Path, proxy: Proxy, model: str, protocol: str) -> Path:
    """A demo home whose agents call `model` through the proxy, with no retries."""
    home = tmp_path / "home"
    make_home(home)

    def edit(doc: dict[str, Any]) -> None:
        doc["llm"]["retries"] = 0
        doc["llm"]["backends"] = [proxy.backend(model, protocol)]
        for lst in doc["listeners"]:
            if lst.get("agent"):
                lst["agent"]["model"] = "proxy"

    edit_config(home, edit)
    return home


@pytest.mark.parametrize("model, protocol, upstream", ROUTES)
async def test_a_streamed_answer_through_the_proxy_reaches_the_client_in_order(
        model: str, protocol: str, upstream: str, proxy: Proxy, tmp_path: Path) -> None:
    home = demo_on_the_proxy(tmp_path, proxy, model, protocol)
    async with proxy.upstream_server(model, upstream, streamed) as server:
        d = await DaemonProcess(home, env={"AGENTD_TEST_LITELLM_KEY": proxy.key}).start()
        try:
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile) as c:
                events = [e async for e in c.stream(MathQuestion(text="What is 2 + 40?"))]
            with urllib.request.urlopen(d.metrics_url + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
        finally:
            assert await d.stop() == 0
    assert all(s.streamed for s in server.requests) and len(server.requests) == 2
    assert isinstance(events[-1], Answer), (events, d.log[-20:])
    assert events[-1].text is not None and "The sum is 42." in events[-1].text
    streams: dict[str, list[Any]] = {}
    for e in events:
        if isinstance(e, Partial | Final):
            streams.setdefault(e.stream, []).append(e)
    assert len(streams) == 2
    first, second = streams.values()
    for stream in (first, second):
        partials = [e for e in stream if isinstance(e, Partial)]
        assert [p.seq for p in partials] == list(range(1, len(partials) + 1))
        assert isinstance(stream[-1], Final) and not stream[-1].interrupted
        assert stream[-1].last_seq == len(partials)
    assert "".join(p.text for p in first if isinstance(p, Partial)) == "Let me add.\n"
    assert "".join(p.text for p in second if isinstance(p, Partial)) == "The sum is 42."
    assert events.index(second[-1]) < events.index(events[-1])  # the final, then the answer
    # the usage the upstream's stream reported, as the proxy passed it on
    assert tokens(metrics, "input") == 1201 + 1302
    assert tokens(metrics, "output") == 31 + 42


def streamed_call(seen: Seen) -> Reply:
    """The first reply calls calculator.add natively, its call streamed in pieces
    after the text; the second writes the answer from the call's result."""
    got = [int(v) for text, _ in results(seen).values()
           for v in re.findall(r"<value>(-?\d+)</value>", text)]
    if not got:
        return Reply(pieces=["Let me ", "add."], gap_s=0.01, input_tokens=1201,
                     output_tokens=31, calls=[call("call_s1", "calculator__add", a=2, b=40)])
    return Reply(pieces=["The ", "sum ", "is ", f"{got[0]}."], gap_s=0.01,
                 input_tokens=1302, output_tokens=42)


@pytest.mark.parametrize("model, protocol, upstream", ROUTES)
async def test_a_streamed_native_call_through_the_proxy_is_dispatched_and_answered(
        model: str, protocol: str, upstream: str, proxy: Proxy, tmp_path: Path) -> None:
    """The call's pieces (OpenAI `tool_calls` deltas, Anthropic `input_json_delta`),
    re-chunked or translated by the proxy, are put together into one call that is
    dispatched; its markup is never shown as a partial."""
    home = demo_on_the_proxy(tmp_path, proxy, model, protocol)
    async with proxy.upstream_server(model, upstream, streamed_call) as server:
        d = await DaemonProcess(home, env={"AGENTD_TEST_LITELLM_KEY": proxy.key}).start()
        try:
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile) as c:
                events = [e async for e in c.stream(MathQuestion(text="What is 2 + 40?"))]
        finally:
            assert await d.stop() == 0
    assert isinstance(events[-1], Answer), (events, d.log[-20:])
    assert events[-1].text is not None and "The sum is 42." in events[-1].text
    first, second = server.requests
    assert first.streamed and second.streamed
    assert second.calls() == [("call_s1", "calculator__add")] and second.orphans() == []
    shown = "".join(e.text for e in events if isinstance(e, Partial))
    assert shown == "Let me add.The sum is 42."


# ---- what the proxy makes of an upstream's failures ------------------------------------


@pytest.mark.parametrize("model, protocol, upstream", ROUTES)
async def test_a_stream_the_upstream_cuts_ends_interrupted_and_is_retried(
        model: str, protocol: str, upstream: str, proxy: Proxy) -> None:
    """The proxy turns an upstream's cut into an error event (an OpenAI stream then
    ends with `[DONE]` all the same): agentd ends the stream interrupted and asks
    again, never taking the pieces before the cut for the answer."""
    script = [Reply(text="one two three four", cut_after=2), Reply(text="the whole answer")]
    async with proxy.upstream_server(model, upstream, script) as server:
        live = router(backend("proxy", **{k: v for k, v in proxy.backend(model, protocol).items()
                                          if k != "name"}), retries=1)
        sink = Sink()
        response = await complete(live, sink)
    assert sink.log == ["one ", "two ", None, "the ", "whole ", "answer"]
    assert response.text == "the whole answer" and len(server.requests) == 2


async def test_auto_falls_back_to_xml_when_the_upstream_behind_the_proxy_refuses_tools(
        proxy: Proxy) -> None:
    """A server without tool support behind the proxy: its 400 comes through as a 400,
    so `auto` sends the request again without tools, once."""
    async with proxy.upstream_server("via-openai", "openai", refuses_tools) as server:
        live = router(backend("proxy", **{k: v for k, v in proxy.backend(
            "via-openai", "openai").items() if k != "name"}))
        first = await live.complete(with_tools(optional=True))
        second = await live.complete(with_tools(optional=True))
        await live.aclose()
    assert first.without_tools and second.without_tools and first.text == "<add>...</add>"
    assert ["tools" in seen.json for seen in server.requests] == [True, False, False]


async def test_a_stopped_upstream_does_not_answer_on_a_kept_alive_connection() -> None:
    """The scripted upstreams take fixed ports one test after another: a stopped one
    closes the connections it kept alive, so the proxy's next request reaches the
    server of the next test, not the old one's script."""
    import httpx

    port = free_port()
    async with httpx.AsyncClient() as client:
        async with FakeLLM("openai", ["old"], port=port) as old:
            first = await client.post(f"{old.base_url}/chat/completions", json={})
        async with FakeLLM("openai", ["new"], port=port) as new:
            second = await client.post(f"{new.base_url}/chat/completions", json={})
    assert first.json()["choices"][0]["message"]["content"] == "old"
    assert second.json()["choices"][0]["message"]["content"] == "new"
    assert len(old.requests) == 1 and len(new.requests) == 1
