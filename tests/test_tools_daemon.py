"""The native tools in a real `agentd run`: the demo's `files` tool answers, and a
refusal reaches the client as a generic `huh denied` while `agentctl journal` shows
it as a security event naming the cause."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentd.client import BusClient, frame_kind
from agentd.tools.files import ReadFile
from tests.daemon_process import DaemonProcess, make_home


async def test_a_denied_read_is_a_generic_huh_and_a_journaled_security_event(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    make_home(home)
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            read = await bus.exchange(ReadFile(path="welcome.txt"))
            assert frame_kind(read[-1])[:2] == ("files", "file-content")
            assert b"Welcome to agentd." in read[-1]
            refused = await bus.exchange(ReadFile(path="../clients.yaml"))
            assert frame_kind(refused[-1])[:2] == ("core", "huh")
            assert b"<code>denied</code>" in refused[-1]
            assert b"clients" not in refused[-1] and b"escapes" not in refused[-1]
        code, doc = await asyncio.to_thread(d.agentctl, "journal", "--limit", "100")
        assert code == 0
        (entry,) = [e for e in doc["result"]["journal"] if e["kind"] == "tool-denied"]
        assert entry["direction"] == "security"
        assert entry["sender"] == "files" and entry["tag"] == "path escapes the root"
        assert any("kind=tool-denied" in line and "path=../clients.yaml" in line
                   for line in d.log)
    finally:
        assert await d.stop() == 0
