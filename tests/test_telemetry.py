"""OpenTelemetry traces from a real `agentd run` child process to a real OTLP/HTTP
receiver on loopback (tests/otlp_receiver.py): a conversation with the demo's tutor
is one trace whose id is the client's thread, each hop a child of the span that
sent its message, its spans named and attributed as the GenAI conventions spell
them, no prompt text in any span unless capture_content; without a
`telemetry:` section nothing is built or sent, whatever OTEL_* says."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentd.client import BusClient, frame_kind
from agentd.platform.demo import MathQuestion
from agentd.tools.relay import Relay
from tests.daemon_process import ROOT, DaemonProcess, edit_config, make_home
from tests.llm_servers import DEMO_QUESTIONS
from tests.organisms.listeners import Hold
from tests.otlp_receiver import OtlpReceiver, tree
from tests.test_daemon import kinds


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


async def converse(d: DaemonProcess) -> tuple[str, str]:
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        asked = await bus.exchange(MathQuestion(text=DEMO_QUESTIONS[0]))
        relayed = await bus.exchange(Relay(a=1, b=2))
    assert kinds(asked)[-1] == ("tutor", "answer")
    assert kinds(relayed)[-1] == ("relay", "sum")
    return frame_kind(asked[0])[2], frame_kind(relayed[0])[2]


def nodes_of(node: dict[str, Any], kind: str) -> Iterator[dict[str, Any]]:
    """The nodes of `kind` in an `agentctl trace` tree, depth first."""
    if node["kind"] == kind:
        yield node
    for child in node["children"]:
        yield from nodes_of(child, kind)


def with_telemetry(home: Path, url: str, **extra: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["telemetry"] = {"otlp_endpoint": url, **extra}
    edit_config(home, edit)


async def test_a_conversation_is_one_trace_with_genai_spans_and_no_content(
        home: Path, receiver: OtlpReceiver) -> None:
    (home / "otlp-headers").write_text("Authorization: Bearer sekrit\n")
    (home / "otlp-headers").chmod(0o600)
    with_telemetry(home, receiver.url, headers_file="otlp-headers")
    d = await DaemonProcess(home).start()
    try:
        tutor_thread, relay_thread = await converse(d)
        code, shown = await asyncio.to_thread(d.agentctl, "trace", tutor_thread, "--content")
    finally:
        assert await d.stop() == 0
    assert code == 0, shown  # capture_content off: no prompt was kept to show
    assert not any("content" in n for n in nodes_of(shown["result"]["root"], "llm"))
    assert "What is" not in json.dumps(shown)
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: len(
        [x for x in s if x.name.startswith("chat ")]) >= 3)
    tutor_trace = uuid.UUID(tutor_thread).hex
    in_trace = [s for s in spans if s.trace_id == tutor_trace]
    # Each hop hangs from the span whose work sent its message: the client's envelope
    # admitted, the agent's turn, its tool call, the agent again on the tool's result.
    chat, commit = ["chat tutor-model", []], "agentd.commit"
    assert tree(spans, tutor_trace) == [
        ["agentd.admit", [
            ["invoke_agent tutor", [chat, ["execute_tool calculator.add", [
                ["invoke_agent tutor", [chat, ["execute_tool calculator.multiply", [
                    ["invoke_agent tutor", [chat]]]]]]]]]]]]]
    by_id = {s.span_id: s for s in in_trace}
    commits = [s for s in in_trace if s.name == commit]
    assert len(commits) == 5  # each handler's step, its output and journal mark together
    assert all(by_id[c.parent_id].name.startswith(("invoke_agent", "execute_tool"))
               for c in commits)
    (admit,) = [s for s in in_trace if s.name == "agentd.admit"]
    assert admit.parent_id == "" and admit.attributes["agentd.client"] == "alice"
    for chat_span in (s for s in in_trace if s.name.startswith("chat ")):
        assert chat_span.attributes["gen_ai.operation.name"] == "chat"
        assert chat_span.attributes["gen_ai.request.model"] == "tutor-model"
        assert chat_span.attributes["gen_ai.conversation.id"] == tutor_thread
        assert chat_span.attributes["gen_ai.usage.input_tokens"] > 0
        assert chat_span.attributes["gen_ai.usage.output_tokens"] > 0
        assert "gen_ai.response.model" in chat_span.attributes
        assert "gen_ai.response.finish_reasons" in chat_span.attributes
        assert not any(k.endswith(("input.messages", "output.messages", "instructions"))
                       for k in chat_span.attributes)
    for tool in (s for s in in_trace if s.name.startswith("execute_tool")):
        assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
        assert tool.attributes["gen_ai.tool.name"] == tool.name.split(" ", 1)[1]
        assert tool.attributes["gen_ai.tool.call.id"]
        assert tool.attributes["gen_ai.conversation.id"] == tutor_thread
    # The relay runs twice: on the client's request, then on the calculator's answer.
    assert tree(spans, uuid.UUID(relay_thread).hex) == [["agentd.admit", [
        ["execute_tool relay", [["execute_tool calculator.add", [
            ["execute_tool relay", []]]]]]]]]
    assert {s.service for s in spans} == {"agent-demo"}  # the organism's name
    assert all(h.get("authorization") == "Bearer sekrit" for h in receiver.headers)
    # No payload, prompt or completion in any span: the question's text is nowhere.
    everything = repr([(s.attributes, s.events) for s in spans])
    assert "(2 + 3) * 7" not in everything and "What is" not in everything
    assert "35" not in [str(v) for s in spans for v in s.attributes.values()]


async def test_otel_environment_variables_never_enable_an_exporter(
        home: Path, receiver: OtlpReceiver) -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_TRACES_EXPORTER": "otlp",
           "OTEL_SERVICE_NAME": "sneaky", "OTEL_SDK_DISABLED": "false"}
    d = await DaemonProcess(home, env=env).start()
    try:
        await converse(d)
    finally:
        assert await d.stop() == 0
    assert receiver.requests == 0 and receiver.spans == []


def test_without_the_section_no_opentelemetry_module_is_loaded() -> None:
    """The daemon's modules, the pump and the LLM router imported and a handler
    span asked for: OpenTelemetry stays unimported, the tracer is the no-op."""
    code = (
        "import sys, agentd._daemon, agentd.llm._router, agentd.pump.invoker\n"
        "from agentd import telemetry\n"
        "t = telemetry.configure(None, 'x')\n"
        "assert t is telemetry.OFF and t.handler('a', True, 'c', 1, False) is None\n"
        "assert t.chat('b', 'm') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                         "OTEL_TRACES_EXPORTER": "otlp"}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


async def test_a_bad_headers_file_stops_the_start_with_the_line_to_fix(
        home: Path, receiver: OtlpReceiver) -> None:
    (home / "otlp-headers").write_text("no header here\n")
    (home / "otlp-headers").chmod(0o600)
    with_telemetry(home, receiver.url, headers_file="otlp-headers")
    d = DaemonProcess(home)
    with pytest.raises(RuntimeError, match=r"otlp-headers:1: expected `Name: value`"):
        await d.start()


async def test_work_resumed_after_kill_9_is_in_the_same_trace_with_a_link_and_nothing_twice(
        home: Path, receiver: OtlpReceiver) -> None:
    with_telemetry(home, receiver.url)
    d = await DaemonProcess(home, env={"AGENTD_TEST_HOLD": "block"}).start()
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        relayed = await bus.exchange(Relay(a=1, b=2))
        relay_thread = frame_kind(relayed[0])[2]
        # Done work is exported (within the batch delay) before the kill.
        await asyncio.to_thread(receiver.wait_for, lambda s: len(
            [x for x in s if x.name.startswith("execute_tool")]) >= 3)
        held = await bus.send(Hold(n=7))
        assert frame_kind(await bus.recv(timeout=30)) == ("core", "accepted", held)
        await d.wait_for_line(r"hold: n=7 blocking")
        session = bus.session
    await d.stop(signal.SIGKILL)
    d2 = await DaemonProcess(home, env={"AGENTD_TEST_HOLD": "pass"}).start()
    try:
        async with BusClient(d2.url, "alice", session=session, cafile=d2.cafile) as bus:
            while frame_kind(await bus.recv(timeout=30))[:2] != ("hold", "done"):
                pass
    finally:
        assert await d2.stop() == 0
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: any(
        x.name == "execute_tool hold" for x in s))
    assert tree(spans, uuid.UUID(relay_thread).hex) == [["agentd.admit", [
        ["execute_tool relay", [["execute_tool calculator.add", [
            ["execute_tool relay", []]]]]]]]]
    assert len({s.span_id for s in spans}) == len(spans)  # nothing emitted twice
    (resumed,) = [s for s in spans if s.name == "execute_tool hold"]
    assert resumed.trace_id == uuid.UUID(held).hex  # the same trace as before the kill
    assert resumed.attributes["agentd.redelivered"] is True
    ((link_trace, link_span),) = resumed.links
    assert link_trace == resumed.trace_id and link_span != resumed.span_id
    assert link_span not in {s.span_id for s in spans}  # the interrupted span never ended


async def test_content_is_captured_only_when_asked_and_never_an_env_value(
        home: Path, receiver: OtlpReceiver) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["telemetry"] = {"otlp_endpoint": receiver.url, "capture_content": True}
        (echo,) = [lst for lst in doc["listeners"] if lst["name"] == "echo"]
        # An env value that happens to be in the question: never in a span.
        echo["isolation"] = {"workers": 1, "env": {"DEMO_SECRET": "2 + 3"}}
    edit_config(home, edit)
    d = await DaemonProcess(home).start()
    try:
        tutor_thread, _ = await converse(d)
        code, shown = await asyncio.to_thread(d.agentctl, "trace", tutor_thread, "--content")
        code2, plain = await asyncio.to_thread(d.agentctl, "trace", tutor_thread)
    finally:
        assert await d.stop() == 0
    assert (code, code2) == (0, 0), (shown, plain)
    # The journal kept each call's prompt and completion: `trace --content` shows them.
    llm_nodes = list(nodes_of(shown["result"]["root"], "llm"))
    assert len(llm_nodes) == 3
    first = llm_nodes[0]["content"]
    assert "tutor" in first["system"]
    assert "What is ([redacted]) * 7?" in json.dumps(first["input"])
    assert "35" in json.dumps(llm_nodes[-1]["content"]["output"])
    assert "2 + 3" not in json.dumps(shown)
    assert not any("content" in n for n in nodes_of(plain["result"]["root"], "llm"))
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: len(
        [x for x in s if x.name.startswith("chat ")]) >= 3)
    chats = sorted((s for s in spans if s.name.startswith("chat ")), key=lambda s: s.start)
    first = json.loads(chats[0].attributes["gen_ai.input.messages"])
    assert first[0]["role"] == "user"
    (text,) = [p["content"] for p in first[0]["parts"] if p["type"] == "text"]
    assert "What is ([redacted]) * 7?" in text
    assert "tutor" in chats[0].attributes["gen_ai.system_instructions"]
    for chat in chats:
        out = json.loads(chat.attributes["gen_ai.output.messages"])
        assert out[0]["role"] == "assistant" and out[0]["parts"]
    assert "35" in chats[-1].attributes["gen_ai.output.messages"]  # the final answer
    everything = repr([(s.attributes, s.events) for s in spans])
    assert "2 + 3" not in everything
    # Only the LLM calls carry content: a handler's span has no payload.
    assert not any("messages" in k for s in spans if not s.name.startswith("chat ")
                   for k in s.attributes)
    assert all(s.attributes["gen_ai.conversation.id"] == tutor_thread for s in chats)


async def test_an_approval_wait_is_a_span_from_parked_to_decided_parent_of_the_call(
        receiver: OtlpReceiver) -> None:
    """In process (the harness, a real kernel and pump), the tracer configured through
    its public seam: the wait is timed from the kernel's parked time, and the
    released call hangs from it."""
    from agentd import telemetry
    from agentd.config import TelemetryConfig
    from tests.test_approvals import FakeClock, decision, harness, park, tag

    clock = FakeClock()
    parked_at = clock.now
    telemetry.configure(TelemetryConfig(otlp_endpoint=receiver.url), "gates")
    try:
        async with harness(clock) as h:
            thread, approval, sha = await park(h)
            clock.now += 42.0
            frames = await h.send("alice", decision("alice", thread, approval, sha))
            assert [tag(f) for f in frames] == ["accepted", "paid"]
    finally:
        await asyncio.to_thread(telemetry.shutdown)
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: any(
        x.name == "execute_tool pay" for x in s))
    (wait,) = [s for s in spans if s.name == "agentd.approval"]
    assert wait.trace_id == uuid.UUID(thread).hex
    assert wait.attributes["agentd.outcome"] == "approved"
    assert wait.attributes["agentd.listener"] == "pay"
    assert wait.start == int(parked_at * 1e9)
    (paid,) = [s for s in spans if s.name == "execute_tool pay"]
    assert paid.parent_id == wait.span_id and paid.trace_id == wait.trace_id


async def test_a_streamed_llm_calls_span_has_its_time_to_first_chunk(
        receiver: OtlpReceiver) -> None:
    """The router against a real streaming HTTP server on loopback, the tracer
    configured through its public seam: the streamed attempt's `chat` span says how
    long the first text took; a whole reply's span has no such attribute."""
    from agentd import telemetry
    from agentd.config import TelemetryConfig
    from tests.llm_servers import FakeLLM, Reply
    from tests.test_llm import backend, request, router
    from tests.test_llm_stream import Sink

    telemetry.configure(TelemetryConfig(otlp_endpoint=receiver.url), "streams")
    try:
        async with FakeLLM("openai", [Reply(pieces=["4", "2"]), Reply(text="42")]) as server:
            r = router(backend("a", server))
            try:
                await r.complete(request(), sink=Sink())  # type: ignore[arg-type]
                await r.complete(request(text="again"))
            finally:
                await r.aclose()
    finally:
        await asyncio.to_thread(telemetry.shutdown)
    spans = await asyncio.to_thread(receiver.wait_for, lambda s: len(s) == 2)
    streamed, whole = sorted(spans, key=lambda s: s.start)
    assert 0 < streamed.attributes["agentd.time_to_first_chunk_s"] < 30
    assert "agentd.time_to_first_chunk_s" not in whole.attributes
