"""Native tool calls in a real `agentd run` process killed with SIGKILL between the
model's reply and the dispatch of its calls: its model a loopback server speaking
the OpenAI protocol, the called tool gated by an operator's approval, which holds
both calls parked when the process dies. After the restart on the same home each
call id becomes one message and runs once (the tool's ledger), its result goes back
under its own id whatever order they are approved in, the model is not asked again
for that reply, and the task finishes. And killed while the tool runs: the
call's message is delivered again after the restart, like any other, and the model
sees the call once."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
from pathlib import Path
from typing import Any

from agentd.client import BusClient
from agentd.kernel import DB_NAME, verify_journal_main
from agentd.platform.demo import MathQuestion
from tests.daemon_process import DaemonProcess, edit_config, make_home
from tests.llm_servers import FakeLLM, Reply, Seen
from tests.test_durable_daemon import ctl, next_on

PAY: dict[str, Any] = {
    "name": "pay", "payload_class": "tests.organisms.durable:Pay",
    "response_class": "tests.organisms.durable:Paid",
    "handler": "tests.organisms.durable:pay", "description": "Pays an amount.",
    "approval": {"approvers": ["operator"], "timeout_s": 600}}


def unescaped(frame: bytes) -> str:
    return frame.decode().replace("&lt;", "<").replace("&gt;", ">")


def calls_of(seen: Seen) -> list[str]:
    return [i for i, _ in seen.calls()]


def tool_results(seen: Seen) -> dict[str, str]:
    return {m["tool_call_id"]: m["content"] for m in seen.json["messages"]
            if m["role"] == "tool"}


def pay_messages(home: Path) -> int:
    """Requests journaled to `pay` (approved ones are journaled when released)."""
    conn = sqlite3.connect(f"file:{home / 'state' / DB_NAME}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT count(*) FROM journal WHERE handler = 'pay' AND direction = 'in' "
            "AND tag LIKE '%}pay'").fetchone()[0]
    finally:
        conn.close()


def tutor_on(home: Path, server: FakeLLM, peers: list[str]) -> None:
    """The demo tutor on the fake model, with no retries, calling `peers`."""
    def edit(doc: dict[str, Any]) -> None:
        doc["llm"]["retries"] = 0
        doc["llm"]["backends"] = [{"name": "tutor-model", "provider": "openai",
                                   "base_url": server.base_url, "model": "fake-1"}]
        tutor = next(lst for lst in doc["listeners"] if lst["name"] == "tutor")
        tutor["peers"] = peers

    edit_config(home, edit)


async def test_a_call_id_is_dispatched_once_when_the_daemon_is_killed_before_dispatch(
        tmp_path: Path) -> None:
    """Two calls of one reply to one gated tool: both parked at once (they run in
    parallel) when the process dies. After the restart each call's approval, the
    second one's first, releases its call: each result goes back under its own id,
    matched by the ref kept with the approval and the journaled messages."""
    home = tmp_path / "home"
    make_home(home, [PAY])
    ledger = tmp_path / "ledger"
    script = [Reply("Paying twice.", calls=[
                  ("p1", "pay", json.dumps({"amount": 7})),
                  ("p2", "pay", json.dumps({"amount": 8}))]),
              Reply("Paid 7 and 8.")]
    async with FakeLLM("openai", script) as server:
        tutor_on(home, server, ["pay"])
        env = {"AGENTD_TEST_LEDGER": str(ledger)}
        d = await DaemonProcess(home, env=env).start()
        try:
            async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
                thread = await bus.send(MathQuestion(text="Pay 7, then 8."))
                parked = [unescaped(await next_on(bus, thread, "approval-required"))
                          for _ in range(2)]
                session = bus.session
            # The model's reply (p1, p2) is in the task's history; both calls are
            # parked: neither has run when the process dies.
            approval = {re.search(r"<amount>(\d+)</amount>", f)[1]:  # type: ignore[index]
                        re.search(r"<approval>(\w+)</approval>", f)[1]  # type: ignore[index]
                        for f in parked}
            assert set(approval) == {"7", "8"}
            assert len(server.requests) == 1
        finally:
            await d.stop(signal.SIGKILL)
        assert not ledger.exists()

        d = await DaemonProcess(home, env=env).start()
        try:
            async with BusClient(d.url, "alice", session=session, cafile=d.cafile) as bus:
                pending = (await ctl(d, "approvals"))["approvals"]
                assert sorted(p["id"] for p in pending) == sorted(approval.values())
                for amount in ("8", "7"):  # the second call's first
                    decided = await ctl(d, "approve", approval[amount])
                    assert decided["approve"]["outcome"] == "approved"
                answer = await next_on(bus, thread, "answer")
        finally:
            assert await d.stop() == 0
    assert b"Paid 7 and 8." in answer
    assert ledger.read_text().split() == ["8", "7"]  # each call ran once
    assert pay_messages(home) == 2  # each call id one message
    assert len(server.requests) == 2  # the model was not asked again for its reply
    last = server.requests[-1]
    assert calls_of(last) == ["p1", "p2"] and last.orphans() == []
    got = tool_results(last)
    assert set(got) == {"p1", "p2"}
    assert "<amount>7</amount>" in got["p1"] and "<amount>8</amount>" in got["p2"]
    assert verify_journal_main(home / "state") == 0


async def test_a_call_killed_while_its_tool_runs_is_processed_again_and_seen_once(
        tmp_path: Path) -> None:
    """The call's message is durable and its tool is running (it blocks) when the
    process dies: after the restart the message is delivered again, like any other,
    and its result goes to the model once, under the call's id. (The reply's other
    call is parked: the client hears of it once the step holding both calls has
    committed, so the kill comes after that commit.)"""
    home = tmp_path / "home"
    make_home(home, [PAY])
    ledger = tmp_path / "ledger"
    script = [Reply(calls=[("a1", "pay", json.dumps({"amount": 3})),
                           ("h1", "hold", json.dumps({"n": 5}))]),
              Reply("Held.")]
    async with FakeLLM("openai", script) as server:
        tutor_on(home, server, ["pay", "hold"])
        env = {"AGENTD_TEST_LEDGER": str(ledger)}
        d = await DaemonProcess(home, env={**env, "AGENTD_TEST_HOLD": "block"}).start()
        try:
            async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
                thread = await bus.send(MathQuestion(text="Pay 3 and hold 5."))
                await next_on(bus, thread, "approval-required")  # the step committed
                session = bus.session
            await d.wait_for_line(r"hold: n=5 blocking")
        finally:
            await d.stop(signal.SIGKILL)

        d = await DaemonProcess(home, env=env).start()
        try:
            async with BusClient(d.url, "alice", session=session, cafile=d.cafile) as bus:
                (pending,) = (await ctl(d, "approvals"))["approvals"]
                await ctl(d, "approve", pending["id"])
                answer = await next_on(bus, thread, "answer")
        finally:
            assert await d.stop() == 0
    assert b"Held." in answer
    assert ledger.read_text().split() == ["3"]
    assert len(server.requests) == 2
    last = server.requests[-1]
    assert calls_of(last) == ["a1", "h1"] and last.orphans() == []
    got = tool_results(last)
    assert "<by>redelivered</by>" in got["h1"] and "<seq>5</seq>" in got["h1"]
    assert "<amount>3</amount>" in got["a1"]
