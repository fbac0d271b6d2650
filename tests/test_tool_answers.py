"""A tool's answer is output like any other: the pump checks it, and when it refuses
it (an answer over the envelope limit), the tool's caller hears that the call
failed instead of waiting for an answer that will never come."""

from __future__ import annotations

from pathlib import Path

from agentd._envelope import parse_envelope
from agentd.client import frame_kind
from agentd.config import load_config_text
from agentd.testing import Harness
from agentd.tools.files import ReadFile


async def test_an_answer_over_the_envelope_limit_reaches_the_caller_as_too_large(
    tmp_path: Path,
) -> None:
    (tmp_path / "big.txt").write_text("x" * 300_000)  # under max_bytes, over 256 KiB
    text = ("organism: {name: t}\nprofiles: {public: {listeners: all}}\nlisteners:\n"
            "  - name: files\n    tool: {kind: file-read, root: ., max_bytes: 1048576}\n")
    config = load_config_text(text, base_dir=tmp_path)
    async with Harness(config, {"alice": "public"}) as h:
        frames = await h.send("alice", ReadFile(path="big.txt"))
    assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"), ("core", "huh")]
    assert parse_envelope(frames[-1]).payload[0].text == "too-large"
    assert max(len(f) for f in frames) < 4096
