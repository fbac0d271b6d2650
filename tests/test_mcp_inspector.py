"""`agentd mcp-serve` under the MCP Inspector's CLI from npm
(`@modelcontextprotocol/inspector`, installed by CI into .ci/node), as a user runs it:
one Inspector process per method, each starting its own `mcp-serve` within the same
TOTP step, against a real TLS bus on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from agentd.config import MetaConfig
from tests.daemon_process import DaemonProcess, make_home
from tests.test_bus_support import Rig, start_rig, stop_rig

ROOT = Path(__file__).resolve().parent.parent
INSPECTOR = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "mcp-inspector"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not INSPECTOR.is_file(),
    reason="needs node and .ci/node (npm install --prefix .ci/node "
           "@modelcontextprotocol/inspector, as .ci/run does)")


@pytest.fixture
async def rig(tmp_path: Path):
    r = await start_rig(tmp_path, meta=MetaConfig(True, True, True))
    yield r
    await stop_rig(r)


async def inspect(url: str, home: Path, cafile: Path, *method: str,
                  exit_code: int = 0) -> dict:
    """One Inspector CLI run against a fresh `mcp-serve`, as `docs/mcp.md` shows it:
    its JSON answer (stdout when it succeeds, stderr when it reports an error)."""
    proc = await asyncio.create_subprocess_exec(
        str(INSPECTOR), "--cli",
        sys.executable, "-m", "agentd.cli", "mcp-serve", "--url", url,
        "--client", "alice", "--secret-file", str(home / "alice.totp"),
        "--cafile", str(cafile), "--session-file", str(home / "alice.session"),
        *method,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "HOME": str(home)})
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == exit_code, err.decode(errors="replace")[-2000:]
    return json.loads(out if exit_code == 0 else err)


async def inspect_rig(rig: Rig, *method: str, exit_code: int = 0) -> dict:
    secret = rig.home / "alice.totp"
    secret.write_text(rig.secrets["alice"])
    os.chmod(secret, 0o600)
    return await inspect(rig.url, rig.home, rig.cafile, *method, exit_code=exit_code)


async def test_the_inspector_lists_and_calls_through_mcp_serve(rig: Rig) -> None:
    listed = await inspect_rig(rig, "--method", "tools/list")
    tools = {t["name"]: t for t in listed["tools"]}
    assert set(tools) == {"calculator.add", "echo", "relay", "gate"}
    assert tools["calculator.add"]["inputSchema"]["required"] == ["a", "b"]
    # A second server within the same 30 s TOTP step: the session file, not a reused code.
    called = await inspect_rig(rig, "--method", "tools/call", "--tool-name", "calculator.add",
                           "--tool-arg", "a=2", "b=40")
    assert not called.get("isError")
    assert "<value>42</value>" in called["content"][0]["text"]


async def test_the_inspector_sees_a_refused_call_as_a_tool_error(rig: Rig) -> None:
    # The Inspector exits 5 on a tool's `isError: true`, the daemon's refusal.
    called = await inspect_rig(rig, "--method", "tools/call", "--tool-name", "calculator.add",
                           "--tool-arg", "a=two", "b=1", exit_code=5)
    assert called["error"]["code"] == "tool_is_error"



async def test_the_demo_home_serves_the_inspector_as_the_guide_shows(tmp_path: Path) -> None:
    """The home `agentd init` writes (what `agentd run` serves from a checkout) turns
    the listing on: the guide's Inspector commands ran into `the daemon does not answer
    list-capabilities` against the demo."""
    make_home(tmp_path / "home")
    daemon = await DaemonProcess(tmp_path / "home").start()
    try:
        listed = await inspect(daemon.url, daemon.home, Path(daemon.cafile),
                               "--method", "tools/list")
        assert {"calculator.add", "files", "tutor"} <= {t["name"] for t in listed["tools"]}
        called = await inspect(daemon.url, daemon.home, Path(daemon.cafile),
                               "--method", "tools/call", "--tool-name", "calculator.add",
                               "--tool-arg", "a=2", "b=40")
        assert "<value>42</value>" in called["content"][0]["text"]
    finally:
        await daemon.stop()
