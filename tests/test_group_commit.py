"""One commit on a conversation's critical path: the real pump over a real kernel
(SQLite WAL, the writer process). A handler that answers at once, and a delegation
chain of such handlers, commit their envelope's arrival and every step's answer in
one batch; `accepted` still precedes the answer, and both follow the commit."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from agentd._envelope import build_envelope
from agentd._routing import Routing
from agentd._wiring import pump_options
from agentd._xmlify import spec_of
from agentd.config import load_config
from agentd.kernel import Kernel
from agentd.pump import Pump
from agentd.tools.calculator import Add
from agentd.tools.relay import Relay

DEMO = Path(__file__).resolve().parent.parent / "agentd" / "demo" / "organism.yaml"


class Conversation:
    """The demo organism's pump on a kernel that counts its committed batches."""

    def __init__(self) -> None:
        self.batches = 0
        self.frames: list[tuple[str, int]] = []  # (kind, batches committed before it)
        self.answered = asyncio.Event()

    def committed(self, _seconds: float, _ops: int) -> None:
        self.batches += 1

    def deliver(self, client: str, thread: str, frame: bytes, oid: int | None) -> None:
        if b"<from>core</from>" in frame:
            self.frames.append(("accepted" if b"<accepted " in frame else "huh", self.batches))
        else:
            self.frames.append(("answer", self.batches))
            self.answered.set()


async def run_one(tmp_path: Path, payload: bytes) -> tuple[Conversation, Kernel, str]:
    conv = Conversation()
    config = load_config(DEMO, state_dir_override=tmp_path / "state")
    kernel = await Kernel.open(config.state_dir, on_commit=conv.committed)
    pump = Pump(Routing.build(config), {"alice": "public"}, conv.deliver, pump_options(config),
                kernel)
    await pump.start()
    try:
        await kernel.flush()  # start-up writes out of the way
        conv.batches = 0
        thread = str(uuid.uuid4())
        result = await pump.submit("alice", build_envelope("alice", thread, payload))
        assert result.accepted
        await asyncio.wait_for(conv.answered.wait(), 30)
        await pump.join()
        await kernel.flush()
    finally:
        await pump.stop()
    return conv, kernel, thread


async def test_answer_at_once_commits_with_its_arrival_in_one_batch(tmp_path: Path) -> None:
    conv, kernel, thread = await run_one(tmp_path, spec_of(Add).to_bytes(Add(a=2, b=3)))
    try:
        assert [kind for kind, _ in conv.frames] == ["accepted", "answer"]
        assert conv.batches == 1
        entries = await kernel.journal(thread=thread)
        assert {e.direction for e in entries} >= {"in", "out"}
    finally:
        await kernel.close()


async def test_delegation_chain_commits_every_step_in_one_batch(tmp_path: Path) -> None:
    conv, kernel, _ = await run_one(tmp_path, spec_of(Relay).to_bytes(Relay(a=4, b=5)))
    try:
        assert [kind for kind, _ in conv.frames] == ["accepted", "answer"]
        # The client's envelope, the relay's request, the calculator's answer and the
        # relay's answer: one SQLite transaction, not four commits in sequence.
        assert conv.batches == 1
    finally:
        await kernel.close()


async def test_nothing_reaches_the_client_before_the_commit_holding_the_arrival(
    tmp_path: Path,
) -> None:
    conv, kernel, thread = await run_one(tmp_path, spec_of(Relay).to_bytes(Relay(a=1, b=1)))
    try:
        # Client frames leave from commit callbacks: both came from the first
        # batch's callbacks (on_commit runs after them), and that batch holds the
        # envelope's journal entry.
        assert conv.frames == [("accepted", 0), ("answer", 0)]
        entries = await kernel.journal(thread=thread)
        assert any(e.direction == "in" and e.sender == "alice" for e in entries)
    finally:
        await kernel.close()
