"""`agentctl trace THREAD`: the conversation as a tree from the journal, through a
real `agentd run` child process, its real OOB socket and the real `agentctl`,
after a real conversation with the demo's tutor (LLM agent, two tool calls) and
its relay; and the tree's rules on journal entries the daemon would write."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from agentd.client import BusClient, frame_kind
from agentd.kernel import JournalEntry
from agentd.platform.demo import MathQuestion
from agentd.telemetry import conversation_tree
from agentd.tools.relay import Relay
from tests.daemon_process import ROOT, DaemonProcess, make_home
from tests.llm_servers import DEMO_QUESTIONS
from tests.test_daemon import kinds


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


def shape(node: dict[str, Any]) -> list[Any]:
    """(kind, from, to) of a node and of its children, nested."""
    return [(node["kind"], node["from"], node["to"]), [shape(c) for c in node["children"]]]


async def test_trace_shows_the_tutors_llm_calls_tool_calls_and_the_relay(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            asked = await bus.exchange(MathQuestion(text=DEMO_QUESTIONS[0]))
            relayed = await bus.exchange(Relay(a=1, b=2))
        assert kinds(asked)[-1] == ("tutor", "answer")
        assert kinds(relayed)[-1] == ("relay", "sum")
        tutor_thread, relay_thread = frame_kind(asked[0])[2], frame_kind(relayed[0])[2]
        code, tutor = await asyncio.to_thread(d.agentctl, "trace", tutor_thread)
        code2, relay = await asyncio.to_thread(d.agentctl, "trace", relay_thread)
        code3, unknown = await asyncio.to_thread(d.agentctl, "trace", str(uuid.uuid4()))
        text = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "agentctl", "--socket", d.socket, "--key",
            str(home / "operator.key"), "trace", tutor_thread],
            capture_output=True, text=True, cwd=ROOT, timeout=60)
    finally:
        assert await d.stop() == 0
    assert (code, code2) == (0, 0), (tutor, relay)
    doc = tutor["result"]
    assert doc["thread"] == tutor_thread
    root = doc["root"]
    llm = ("llm", "tutor", "tutor-model")
    assert shape(root) == [("conversation", "alice", "tutor"), [
        [("hop", "alice", "tutor"), [
            [llm, []],
            [("tool", "tutor", "calculator.add"), [[("result", "calculator.add", "tutor"), []]]],
            [llm, []],
            [("tool", "tutor", "calculator.multiply"),
             [[("result", "calculator.multiply", "tutor"), []]]],
            [llm, []],
            [("reply", "tutor", "alice"), []],
        ]]]]
    hop = root["children"][0]
    assert hop["listener"] == "tutor" and hop["outcome"] == "ok"
    assert hop["duration_ms"] > 0 and root["duration_ms"] >= hop["duration_ms"]
    calls = [c for c in hop["children"] if c["kind"] == "llm"]
    for call in calls:
        assert call["backend"] == "tutor-model" and call["outcome"] == "ok"
        assert call["tokens"]["input"] > 0 and call["tokens"]["output"] > 0
        assert call["attempts"] == 1
        assert isinstance(call["model"], str) and call["model"]
        assert isinstance(call["duration_ms"], float) and call["duration_ms"] >= 0
        assert set(call) >= {"kind", "from", "to", "listener", "outcome", "duration_ms",
                             "children", "backend", "model", "tokens"}
    tools = [c for c in hop["children"] if c["kind"] == "tool"]
    assert [t["outcome"] for t in tools] == ["ok", "ok"]
    assert all(t["duration_ms"] >= 0 for t in tools)

    assert shape(relay["result"]["root"]) == [("conversation", "alice", "relay"), [
        [("hop", "alice", "relay"), [
            [("hop", "relay", "calculator.add"), [[("result", "calculator.add", "relay"), []]]],
            [("reply", "relay", "alice"), []],
        ]]]]

    assert code3 == 1 and unknown["error"]["code"] == "invalid"

    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"thread {tutor_thread}"
    assert lines[1].startswith("conversation  alice -> tutor")
    assert lines[3].startswith("    llm  tutor -> tutor-model") and "tokens=" in lines[3]
    assert lines[4].startswith("    tool  tutor -> calculator.add  ok")
    assert lines[5].startswith("      result  calculator.add -> tutor")


def entry(seq: int, thread: str, direction: str, kind: str, handler: str, sender: str,
          tag: str = "t", payload: bytes | None = None) -> JournalEntry:
    return JournalEntry(seq, 100.0 + seq / 10, thread, direction, kind, handler, sender, tag,
                        "0" * 64, payload, "", "")


def test_a_huh_answer_carries_its_code_and_ends_the_hop() -> None:
    huh = b"<huh><code>unknown-listener</code><message>m</message></huh>"
    tree = conversation_tree("t1", [
        entry(1, "t1", "in", "request/0", "relay", "alice"),
        entry(2, "t2", "in", "request/1", "peer.add", "relay"),
        entry(3, "t2", "in", "reply/2", "relay", "peer.add", "{core}huh", huh),
        entry(4, "t1", "out", "reply", "alice", "relay", "{core}huh", huh),
    ], state="completed", remote=["peer.add"])
    hop = tree["children"][0]
    federation, reply = hop["children"]
    assert federation["kind"] == "federation" and federation["outcome"] == "unknown-listener"
    assert federation["children"][0]["code"] == "unknown-listener"
    assert reply["code"] == "unknown-listener" and hop["outcome"] == "unknown-listener"
    assert hop["duration_ms"] == pytest.approx(300.0)
    assert tree["outcome"] == "completed"


def test_a_hop_without_an_answer_stays_open_and_a_bad_audit_body_is_kept_as_an_event() -> None:
    tree = conversation_tree("t1", [
        entry(1, "t1", "in", "request/0", "hold", "alice"),
        entry(2, "t1", "in", "parked", "", "hold"),
        entry(3, "t1", "audit", "approval-approved", "hold", "operator:ops-1", payload=b"{"),
        entry(4, "t1", "security", "llm.security", "hold", "platform", payload=b"[]"),
    ])
    hop = tree["children"][0]
    assert hop["outcome"] == "open" and hop["duration_ms"] is None
    assert [c["kind"] for c in hop["children"]] == ["approval", "approval", "security"]


def test_the_human_form_shows_an_llm_calls_content_under_it() -> None:
    from agentctl._render import render_trace

    llm = {"kind": "llm", "from": "tutor", "to": "m", "listener": "tutor", "outcome": "ok",
           "duration_ms": 1.0, "children": [], "content": {
               "system": "Be brief.",
               "input": [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
               "output": [{"role": "assistant", "parts": [
                   {"type": "tool_call", "id": "c1", "name": "add", "arguments": '{"a":2}'}]}]}}
    root = {"kind": "conversation", "from": "alice", "to": "tutor", "listener": None,
            "outcome": "active", "duration_ms": 2.0, "children": [llm]}
    lines = render_trace({"thread": "t", "root": root}).splitlines()
    assert lines[3:] == ["    | system: Be brief.", "    | user: 2+2?",
                         '    | assistant add: {"a":2}']
