"""Previews of an agent's model text in a real `agentd run` process, its model a
loopback server streaming the OpenAI wire protocol: a client that asks gets core
`partial`s in order, a `final` per stream, then the answer; markup is not shown; a
client that does not ask gets the answer alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentd._xmlify import spec_of
from agentd.client import Accepted, Answer, Client, Final, Partial
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
    # Without asking: the answer alone.
    assert not [e for e in plain if isinstance(e, Partial | Final)]
    assert answer is not None
    # `agentd send --stream`: the text raw as it comes (`accepted`, committed while
    # the model writes, may come in between), each stream's end a line end, then the
    # answer as usual.
    code, out, err = rig
    assert code == 0, (out, err)
    assert "\nThe sum is 42.\n<- answer from tutor on thread " in out
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


async def test_mcp_serve_turns_partials_into_progress_for_a_client_with_a_token(
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
    assert values == sorted(values) and values[0] == 1.0  # increasing, one per partial
    assert "".join(m or "" for _, m in progress) == "Let me add.\nThe sum is 42."
    assert not quiet.isError
