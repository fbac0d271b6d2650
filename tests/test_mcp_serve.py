"""`agentd mcp-serve` as a real subprocess, driven by the SDK's own MCP client
(`ClientSession` over `stdio_client`), bridging to a real TLS bus on loopback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

import agentd
from agentd._xmlify import spec_of
from agentd.config import MetaConfig
from agentd.mcp.serve import input_schema, payload_xml, shape_of_xsd
from agentd.tools.calculator import Add
from tests.test_bus_support import Rig, start_rig, stop_rig


@pytest.fixture
async def rig(tmp_path: Path):
    r = await start_rig(tmp_path, meta=MetaConfig(True, True, True))
    yield r
    await stop_rig(r)


def params(rig: Rig, client: str) -> StdioServerParameters:
    secret = rig.home / f"{client}.totp"
    secret.write_text(rig.secrets[client])
    os.chmod(secret, 0o600)
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "agentd.cli", "mcp-serve", "--url", rig.url, "--client", client,
              "--secret-file", str(secret), "--cafile", str(rig.cafile)],
        env={"PATH": os.environ.get("PATH", "")})


async def test_an_mcp_client_sees_only_its_profiles_listeners_and_gets_answers(
        rig: Rig) -> None:
    async with stdio_client(params(rig, "alice")) as (read, write), \
            ClientSession(read, write) as session:
        init = await session.initialize()
        assert (init.serverInfo.name, init.serverInfo.version) == ("agentd", agentd.__version__)
        tools = {t.name: t for t in (await session.list_tools()).tools}
        # The public profile: never `admin`-only or unknown listeners.
        assert set(tools) == {"calculator.add", "echo", "relay", "gate"}
        assert tools["calculator.add"].inputSchema["required"] == ["a", "b"]
        result = await session.call_tool("calculator.add", {"a": 2, "b": 40})
        assert not result.isError
        assert "<value>42</value>" in result.content[0].text  # type: ignore[union-attr]


async def test_arguments_the_daemon_refuses_come_back_as_is_error(rig: Rig) -> None:
    async with stdio_client(params(rig, "alice")) as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        bad = await session.call_tool("calculator.add", {"a": "two", "b": 1})
        assert bad.isError
        unknown = await session.call_tool("vault", {})
        assert unknown.isError


async def test_a_second_server_within_the_totp_step_logs_in_with_the_session_file(
        rig: Rig) -> None:
    """An MCP client that starts the server twice within 30 s (the Inspector does):
    the second reused the TOTP code and got 4401, since mcp-serve only read the
    session file. Now the first writes its token there and the second uses it."""
    first = params(rig, "alice")
    session = rig.home / "alice.mcp-session"
    first.args += ["--session-file", str(session)]
    for _ in range(2):
        async with stdio_client(first) as (read, write), \
                ClientSession(read, write) as mcp:
            await mcp.initialize()
            assert "calculator.add" in {t.name for t in (await mcp.list_tools()).tools}
        assert session.read_text().split()[0] == rig.url


def test_the_input_schema_and_payload_come_from_the_xsd() -> None:
    shape = shape_of_xsd(spec_of(Add).xsd)
    schema = input_schema(shape)
    assert schema["properties"]["a"]["type"] == "integer"
    assert payload_xml(shape, {"a": 1, "b": 2}) == spec_of(Add).to_bytes(Add(a=1, b=2))
    with pytest.raises(ValueError):
        payload_xml(shape, {"a": 1, "c": 2})


async def test_a_daemon_that_offers_nothing_is_one_line_not_a_traceback(
        tmp_path: Path) -> None:
    """Without meta.allow_list_capabilities the daemon answers no capability list:
    `mcp-serve` ended in a RuntimeError traceback; it says why, in one line."""
    import asyncio

    r = await start_rig(tmp_path)  # meta questions all refused: the default
    try:
        p = params(r, "alice")
        proc = await asyncio.create_subprocess_exec(
            p.command, *p.args, env=p.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(b""), 60)
    finally:
        await stop_rig(r)
    assert proc.returncode == 3, err
    text = err.decode()
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1] == (
        "agentd mcp-serve: the daemon does not answer list-capabilities for this client "
        "(it needs meta.allow_list_capabilities and allow_schema_requests)")
