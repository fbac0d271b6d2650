"""Context segments and long-term memory through a real `agentd run` child process
and the real `agentctl`: a task's segments are listed after it ended, memories added
by the operator survive kill -9, and a bad memory command changes nothing."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from agentd.client import frame_kind
from agentd.platform.demo import MathQuestion
from tests.daemon_process import DaemonProcess, make_home
from tests.llm_servers import DEMO_QUESTIONS
from tests.test_daemon import ask_once, kinds


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


async def test_introspect_context_lists_a_finished_tasks_segments(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        frames = await ask_once(d, MathQuestion(text=DEMO_QUESTIONS[0]))
        assert kinds(frames)[-1] == ("tutor", "answer")
        thread = frame_kind(frames[0])[2]
        code, doc = await asyncio.to_thread(d.agentctl, "introspect", "context", thread)
    finally:
        assert await d.stop() == 0
    assert code == 0, doc
    result = doc["result"]
    assert result["thread"] == thread
    segments = result["segments"]
    # The cassette's tutor: add, multiply, answer: two tool segments and a reply.
    assert [s["kind"] for s in segments] == ["tool", "tool", "reply"]
    for s in segments:
        assert s["tier"] == "expanded"
        assert 0.0 <= s["relevance"] <= 1.0
        assert s["tokens"] == -(-s["bytes"] // 4)
        assert set(s) >= {"id", "kind", "tier", "relevance", "bytes", "tokens"}


async def test_operator_memories_survive_kill_9(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        code, doc = await asyncio.to_thread(
            d.agentctl, "memory", "add", "tutor", "The student prefers worked examples.",
            "--key", "style")
        assert code == 0, doc
        memory_id = doc["result"]["id"]
        code, doc = await asyncio.to_thread(d.agentctl, "memory", "add", "tutor",
                                            "Numbers are integers below 1000.")
        assert code == 0, doc
    finally:
        await d.stop(signal.SIGKILL)
    d = await DaemonProcess(home).start()
    try:
        code, listed = await asyncio.to_thread(d.agentctl, "memory", "list", "tutor")
        assert code == 0, listed
        memories = listed["result"]["memories"]
        assert [m["text"] for m in memories] == [
            "The student prefers worked examples.", "Numbers are integers below 1000."]
        assert memories[0]["key"] == "style" and memories[0]["id"] == memory_id
        assert memories[0]["created"].endswith("Z")
        code, doc = await asyncio.to_thread(d.agentctl, "memory", "forget", "tutor", memory_id)
        assert code == 0, doc
        code, doc = await asyncio.to_thread(d.agentctl, "memory", "forget", "tutor", memory_id)
        assert code == 1  # already gone
        # Memories are per agent: an unknown agent or an empty text is refused, and
        # nothing changes.
        code, doc = await asyncio.to_thread(d.agentctl, "memory", "add", "calculator.add",
                                            "x")
        assert code == 1 and doc["error"]["code"] == "invalid"
        code, doc = await asyncio.to_thread(d.agentctl, "memory", "add", "tutor", "   ")
        assert code == 1 and doc["error"]["code"] == "invalid"
        code, listed = await asyncio.to_thread(d.agentctl, "memory", "list", "tutor")
        assert [m["text"] for m in listed["result"]["memories"]] == [
            "Numbers are integers below 1000."]
    finally:
        assert await d.stop() == 0
