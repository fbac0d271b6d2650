"""The reference MCP filesystem server from npm (`@modelcontextprotocol/server-filesystem`,
installed by CI into .ci/node) as a confined stdio tool behind the pump."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from agentd._envelope import build_envelope
from agentd.client import frame_kind
from agentd.config import load_config_text
from agentd.mcp import close_servers
from agentd.testing import Harness
from tests.mcp import mcp_organism

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / ".ci" / "node" / "node_modules" / "@modelcontextprotocol" / "server-filesystem"
NODE = shutil.which("node")
NS = "https://xml-pipeline.org/ns/mcp/fs/{}/v1"

pytestmark = pytest.mark.skipif(
    NODE is None or not (PACKAGE / "dist" / "index.js").is_file(),
    reason="needs node and .ci/node (npm install --prefix .ci/node "
           "@modelcontextprotocol/server-filesystem, as .ci/run does)")


@pytest.fixture(autouse=True)
async def _close_servers():
    yield
    await close_servers()


def organism(root: Path) -> str:
    return mcp_organism("fs", {
        "command": [NODE, str(PACKAGE / "dist" / "index.js"), str(root)],
        "tools": ["read_text_file", "list_directory"],
        "read": [str(ROOT / ".ci" / "node"), "/etc/ssl"], "root": str(root),
        "timeout_s": 20,
        "memory_mb": 8192,  # V8 reserves address space far beyond what it uses
    })


def call(tool: str, body: str) -> bytes:
    payload = f'<{tool} xmlns="{NS.format(tool)}">{body}</{tool}>'.encode()
    return build_envelope("alice", str(uuid.uuid4()), payload, to=f"fs.{tool}")


async def test_the_reference_filesystem_server_reads_inside_its_root_only(
        tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "hello.txt").write_text("hello from the root")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOTP-SECRET")
    config = load_config_text(organism(root), base_dir=tmp_path)
    assert {c.name for c in config.listeners} == {"fs.read_text_file", "fs.list_directory"}
    async with Harness(config, {"alice": "public"}) as h:
        frames = await h.send("alice", call("read_text_file",
                                            f"<path>{root / 'hello.txt'}</path>"))
        assert frame_kind(frames[-1])[1] == "mcp-result"
        assert b"hello from the root" in frames[-1]
        frames = await h.send("alice", call("read_text_file", f"<path>{secret}</path>"))
        assert b"TOTP-SECRET" not in frames[-1]
        assert b"<is-error>true</is-error>" in frames[-1] or b"huh" in frames[-1]
        body = b'<write_file xmlns="https://xml-pipeline.org/ns/mcp/fs/write_file/v1"/>'
        frames = await h.send("alice", build_envelope("alice", str(uuid.uuid4()), body,
                                                      to="fs.write_file"))
        assert b"unroutable" in frames[-1]  # not in the allowlist: not a listener
