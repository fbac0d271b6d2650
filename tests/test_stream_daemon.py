"""Previews of an agent's model text in a real `agentd run` process, its model a
loopback server streaming the OpenAI wire protocol: a client that asks gets core
`partial`s in order, a `final` per stream, then the answer; markup is not shown; a
client that does not ask gets the answer alone. Steps too: a tool call, its wait
for approval and its result; a timer's wait; an MCP server's progress."""

from __future__ import annotations

import asyncio
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from agentd._xmlify import spec_of
from agentd.client import Accepted, Answer, ApprovalRequired, Client, Final, Partial, Step
from agentd.platform.demo import MathQuestion
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.llm_servers import FakeLLM, Reply, add_call, values
from tests.test_client_daemon import agentd_send


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


def on_the_fake_model(home: Path, server: FakeLLM) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["llm"]["retries"] = 0
        doc["llm"]["backends"] = [{"name": "tutor-model", "provider": "openai",
                                   "base_url": server.base_url, "model": "fake-1"}]

    edit_config(home, edit)


def script(seen: Any) -> Reply:
    got = values(seen.conversation().results)
    if not got:  # the tool call's markup is streamed too, and never shown
        return Reply(pieces=["Let me ", "add.\n", add_call(2, 40)[:9], add_call(2, 40)[9:]],
                     gap_s=0.01)
    return Reply(pieces=["The ", "sum ", "is ", f"{got[0]}."], gap_s=0.01)


async def test_a_client_that_asks_sees_the_answer_being_written(home: Path) -> None:
    async with FakeLLM("openai", script) as server:
        on_the_fake_model(home, server)
        d = await DaemonProcess(home).start()
        try:
            # The session file spares `agentd send` below this step's used TOTP code.
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile,
                                      session_file=home / "alice.session") as c:
                events = [e async for e in c.stream(MathQuestion(text="What is 2 + 40?"))]
                plain: list[Any] = []
                answer = await c.call(MathQuestion(text="And 2 + 40?"), on_event=plain.append)
            rig = await agentd_send(d, "--stream", "-", stdin=spec_of(MathQuestion).to_bytes(
                MathQuestion(text="Once more: 2 + 40?")))
        finally:
            assert await d.stop() == 0
    assert isinstance(events[0], Accepted) and isinstance(events[-1], Answer)
    assert events[-1].text is not None and "The sum is 42." in events[-1].text
    streams: dict[str, list[Any]] = {}
    for e in events:
        if isinstance(e, Partial | Final):
            streams.setdefault(e.stream, []).append(e)
    assert len(streams) == 2  # one per model call
    first, second = streams.values()
    for stream in (first, second):
        partials = [e for e in stream if isinstance(e, Partial)]
        assert [p.seq for p in partials] == list(range(1, len(partials) + 1))
        assert isinstance(stream[-1], Final) and stream[-1].last_seq == len(partials)
        assert not stream[-1].interrupted
    assert "".join(p.text for p in first if isinstance(p, Partial)) == "Let me add.\n"
    assert "".join(p.text for p in second if isinstance(p, Partial)) == "The sum is 42."
    assert events.index(second[-1]) < len(events) - 1  # final before the answer
    # Without asking: the answer alone (no previews, no steps).
    assert not [e for e in plain if isinstance(e, Partial | Final | Step)]
    assert answer is not None
    # `agentd send --stream`: the text raw as it comes (`accepted`, committed while
    # the model writes, may come in between), each stream's end a line end, then the
    # answer as usual.
    code, out, err = rig
    assert code == 0, (out, err)
    assert "\nThe sum is 42.\n<- answer from tutor on thread " in out
    # What the agent did, on stderr: its call and the call's result.
    call = re.search(r"agentd send: calls calculator\.add \(call (\w+)\)", err)
    assert call is not None, err
    assert f"agentd send: answered: calculator.add (call {call[1]})" in err
    # Without the frame lines (one that comes mid-text starts a line of its own):
    text = [line for line in out.splitlines() if not line.startswith(("<- ", "   ", "-> "))]
    assert "".join(text) == "Let me add.The sum is 42.", out


async def test_a_profile_that_streams_sends_previews_without_being_asked(home: Path) -> None:
    async with FakeLLM("openai", script) as server:
        on_the_fake_model(home, server)
        edit_config(home, lambda doc: doc["profiles"]["public"].update(stream=True))
        d = await DaemonProcess(home).start()
        try:
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile) as c:
                seen: list[Any] = []
                await c.call(MathQuestion(text="What is 2 + 40?"), on_event=seen.append)
        finally:
            assert await d.stop() == 0
    shown = "".join(e.text for e in seen if isinstance(e, Partial))
    assert shown == "Let me add.\nThe sum is 42."
    assert len([e for e in seen if isinstance(e, Final)]) == 2


async def test_mcp_serve_turns_partials_and_steps_into_progress_for_a_client_with_a_token(
    home: Path,
) -> None:
    import os
    import sys

    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    progress: list[tuple[float, str | None]] = []

    async def seen(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async with FakeLLM("openai", script) as server:
        on_the_fake_model(home, server)
        d = await DaemonProcess(home).start()
        try:
            params = StdioServerParameters(
                command=sys.executable,
                args=["-m", "agentd.cli", "mcp-serve", "--url", d.url, "--client", "alice",
                      "--secret-file", str(home / "alice.totp"), "--cafile", d.cafile],
                env={"PATH": os.environ.get("PATH", ""),
                     "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
            async with stdio_client(params) as (read, write), \
                    ClientSession(read, write) as session:
                await session.initialize()
                result = await session.call_tool("tutor", {"text": "What is 2 + 40?"},
                                                 progress_callback=seen)
                quiet = await session.call_tool("tutor", {"text": "And 2 + 40?"})
        finally:
            assert await d.stop() == 0
    assert not result.isError and "The sum is 42." in result.content[0].text  # type: ignore[union-attr]
    values = [v for v, _ in progress]
    assert values == sorted(values) and values[0] == 1.0  # increasing, one per event
    # The partials' text, and the agent's steps in words in between.
    assert re.fullmatch(r"Let me add\.\ncalls calculator\.add \(call (\w+)\)"
                        r"answered: calculator\.add \(call \1\)The sum is 42\.",
                        "".join(m or "" for _, m in progress))
    assert not quiet.isError


def steps_of(events: list[Any]) -> list[tuple[str, str, str]]:
    return [(e.kind, e.listener, e.call) for e in events if isinstance(e, Step)]


async def test_a_client_that_asks_sees_each_tool_call_its_approval_wait_and_its_result(
    home: Path,
) -> None:
    def gated(doc: dict[str, Any]) -> None:
        add = next(lst for lst in doc["listeners"] if lst["name"] == "calculator.add")
        add["approval"] = {"approvers": ["operator"], "timeout_s": 600}

    edit_config(home, gated)
    async with FakeLLM("openai", script) as server:
        on_the_fake_model(home, server)
        d = await DaemonProcess(home).start()
        try:
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile) as c:
                events: list[Any] = []
                async for event in c.stream(MathQuestion(text="What is 2 + 40?")):
                    events.append(event)
                    if isinstance(event, ApprovalRequired):
                        code, doc = await asyncio.to_thread(d.agentctl, "approve",
                                                            event.approval)
                        assert code == 0, doc
        finally:
            assert await d.stop() == 0
    steps = steps_of(events)
    assert [(k, lst) for k, lst, _ in steps] == [
        ("tool-call", "calculator.add"), ("approval-wait", "calculator.add"),
        ("tool-result", "calculator.add")]
    assert len({call for _, _, call in steps}) == 1 and steps[0][2]  # one id, shared
    tool_call = next(e for e in events if isinstance(e, Step))
    assert tool_call.payload is not None and b"<a>2</a><b>40</b>" in tool_call.payload
    assert all(isinstance(e, Step) and e.payload is None
               for e in events if isinstance(e, Step) and e is not tool_call)
    # In order: the call, its wait, the owner's approval-required, the result, the
    # agent's second stream, the answer.
    kinds = [type(e).__name__ if not isinstance(e, Step) else e.kind for e in events]
    assert kinds.index("tool-call") < kinds.index("approval-wait") \
        < kinds.index("ApprovalRequired") < kinds.index("tool-result") < len(kinds) - 1
    assert isinstance(events[-1], Answer) and "The sum is 42." in (events[-1].text or "")


async def test_a_timers_wait_and_an_mcp_servers_progress_are_steps(
    home: Path, tmp_path: Path,
) -> None:
    from agentd.durable.timers import Wait, Woke

    server = Path(__file__).resolve().parent / "mcp" / "fastmcp_server.py"
    reads = [str(Path(sys.prefix)), str(server.parent.parent), str(Path(sys.base_prefix))]

    def tools(doc: dict[str, Any]) -> None:
        doc["listeners"] += [
            {"name": "clock", "tool": {"kind": "timer", "max_delay_s": 600}},
            {"name": "calc", "description": "Counts.", "tool": {
                "kind": "mcp", "command": [sys.executable, str(server), "good"],
                "tools": ["count"], "read": reads, "root": str(tmp_path), "timeout_s": 30}}]
        doc["profiles"]["public"]["listeners"] += ["clock", "calc.count"]

    edit_config(home, tools)
    count = b'<count xmlns="https://xml-pipeline.org/ns/mcp/calc/count/v1"><n>3</n></count>'
    d = await DaemonProcess(home).start()
    try:
        async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile) as c:
            waited = [e async for e in c.stream(Wait(seconds=Decimal("0.2"), note="n"))]
            counted = [e async for e in c.stream(count, to="calc.count")]
            quiet: list[Any] = []
            await c.call(count, to="calc.count", on_event=quiet.append)
    finally:
        assert await d.stop() == 0
    (timer,) = [e for e in waited if isinstance(e, Step)]
    assert (timer.kind, timer.listener) == ("timer-wait", "clock") and timer.call
    assert isinstance(waited[-1], Answer) and isinstance(waited[-1].payload, Woke)
    progress = [e for e in counted if isinstance(e, Step)]
    assert [(e.kind, e.listener, e.progress, e.total, e.message) for e in progress] == [
        ("progress", "calc.count", float(i), 3.0, f"at {i}") for i in (1, 2, 3)]
    assert isinstance(counted[-1], Answer) and b"3" in counted[-1].xml
    assert not [e for e in quiet if isinstance(e, Step)]  # not asked: no token, no steps


async def test_a_stream_cut_by_kill_9_ends_interrupted_before_the_resumed_tasks_stream(
    home: Path,
) -> None:
    """The daemon is killed while its model writes: after the restart the same
    client, resumed with its session token, is told that stream ended interrupted
    (from its outbox, at login), then sees the resumed task's new stream and the
    answer."""
    import signal
    import socket

    asked = 0

    def slow_then_quick(_seen: Any) -> Reply:
        nonlocal asked
        asked += 1
        if asked == 1:  # cut by the kill
            return Reply(pieces=[f"word{i} " for i in range(400)], gap_s=0.05)
        # The resumed task's: late enough for the client to be back (its first
        # tries come while the daemon restarts, 0.2 s, 0.4 s, ... apart).
        return Reply(pieces=["The ", "sum ", "is ", "42."], first_s=5.0, gap_s=0.01)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    edit_config(home, lambda doc: doc["bus"].update(port=port))  # the same URL again
    async with FakeLLM("openai", slow_then_quick) as server:
        on_the_fake_model(home, server)
        d = await DaemonProcess(home).start()
        d2: DaemonProcess | None = None
        try:
            async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile,
                                      session_file=home / "alice.session") as c:
                events: list[Any] = []
                three = asyncio.Event()

                async def follow() -> None:
                    async for event in c.stream(MathQuestion(text="What is 2 + 40?"),
                                                timeout=120):
                        events.append(event)
                        if sum(isinstance(e, Partial) for e in events) >= 3:
                            three.set()

                following = asyncio.create_task(follow())
                await asyncio.wait_for(three.wait(), 60)
                await d.stop(signal.SIGKILL)
                d2 = await DaemonProcess(home).start()
                await asyncio.wait_for(following, 120)
        finally:
            if d2 is not None:
                assert await d2.stop() == 0
            elif d.proc is not None and d.proc.returncode is None:
                await d.stop(signal.SIGKILL)
    cut = next(e for e in events if isinstance(e, Partial)).stream
    before = [e for e in events if isinstance(e, Partial) and e.stream == cut]
    (told,) = [e for e in events if isinstance(e, Final) and e.stream == cut]
    assert told.interrupted and 1 <= told.last_seq <= len(before)
    after = events[events.index(told) + 1:]
    assert not [e for e in after if isinstance(e, Partial) and e.stream == cut]
    resumed = [e for e in after if isinstance(e, Partial)]
    assert resumed and "".join(p.text for p in resumed) == "The sum is 42."
    assert not any(isinstance(e, Partial) and e.stream != cut
                   for e in events[:events.index(told)])  # the final came first
    assert isinstance(events[-1], Answer) and "The sum is 42." in (events[-1].text or "")
