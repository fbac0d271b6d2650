"""Timers and approval gates in a real `agentd run` process, killed with SIGKILL:
a pending timer fires exactly once after the restart, a parked message is still
parked, and a decision committed before the kill runs the gated handler once."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from agentd.client import BusClient, frame_kind
from agentd.durable import Wait
from agentd.kernel import DB_NAME, verify_journal_main
from tests.daemon_process import DaemonProcess, make_home
from tests.organisms.durable import Pay

EXTRA: list[dict[str, Any]] = [
    {"name": "clock", "tool": {"kind": "timer", "max_delay_s": 600}},
    {"name": "pay", "payload_class": "tests.organisms.durable:Pay",
     "response_class": "tests.organisms.durable:Paid",
     "handler": "tests.organisms.durable:pay", "description": "Pays.",
     "approval": {"approvers": ["operator", "client"], "timeout_s": 600}},
]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home", EXTRA)
    return tmp_path / "home"


async def next_on(bus: BusClient, thread: str, kind: str, timeout: float = 30) -> bytes:
    while True:
        frame = await bus.recv(timeout=timeout)
        _, got, on = frame_kind(frame)
        if on == thread and got == kind:
            return frame


def out_frames(home: Path, thread: str, tag: str) -> int:
    """Frames journaled to the client on `thread` whose payload tag ends with `tag`."""
    conn = sqlite3.connect(f"file:{home / 'state' / DB_NAME}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT count(*) FROM journal WHERE thread = ? AND direction = 'out' "
            "AND tag LIKE ?", (thread, f"%}}{tag}")).fetchone()[0]
    finally:
        conn.close()


async def ctl(d: DaemonProcess, *args: str) -> Any:
    code, doc = await asyncio.to_thread(d.agentctl, *args)
    assert code == 0 and doc["ok"], doc
    return doc["result"]


async def test_a_timer_fires_exactly_once_across_kill_9(home: Path) -> None:
    # Long enough that the listing below comes before it fires, also on a loaded machine
    # (1.5 s fired before agentctl answered when the load average was 10).
    d = await DaemonProcess(home).start()
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        thread = await bus.send(Wait(seconds=Decimal("4"), note="after the crash"))
        await next_on(bus, thread, "accepted")
        session = bus.session
    listed = (await ctl(d, "introspect", "timers"))["timers"]
    assert [(t["thread"], t["listener"], t["note"]) for t in listed] == [
        (thread, "clock", "after the crash")]
    assert listed[0]["due"].endswith("Z")
    await d.stop(signal.SIGKILL)

    d2 = await DaemonProcess(home).start()
    try:
        async with BusClient(d2.url, "alice", session=session, cafile=d2.cafile) as bus:
            woke = await next_on(bus, thread, "woke")
            assert b"<note>after the crash</note>" in woke
        assert (await ctl(d2, "introspect", "timers"))["timers"] == []
    finally:
        assert await d2.stop() == 0
    assert out_frames(home, thread, "woke") == 1
    assert verify_journal_main(home / "state") == 0


async def test_a_parked_call_survives_kill_9_and_an_approval_runs_it_once(
        home: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    env = {"AGENTD_TEST_LEDGER": str(ledger), "AGENTD_TEST_PAY": "block"}
    d = await DaemonProcess(home, env=env).start()
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        thread = await bus.send(Pay(amount=42))
        await next_on(bus, thread, "accepted")
        required = await next_on(bus, thread, "approval-required")
        session = bus.session
    (pending,) = (await ctl(d, "approvals"))["approvals"]
    assert pending["thread"] == thread and pending["listener"] == "pay"
    assert pending["approvers"] == ["operator", "client"]
    assert f"<approval>{pending['id']}</approval>".encode() in required
    # Listings narrow (a listing of everything could pass the 1 MiB response).
    assert (await ctl(d, "approvals", "--thread", thread, "--limit", "1"))["approvals"] == [
        pending]
    other = "00000000-0000-4000-8000-000000000000"
    assert (await ctl(d, "approvals", "--thread", other))["approvals"] == []
    assert (await ctl(d, "status"))["status"]["approvals_pending"] == 1
    await d.stop(signal.SIGKILL)

    # Still parked after the crash; approved, then killed again while the handler
    # is running (it blocks): the decision had committed, so the restart runs it.
    d = await DaemonProcess(home, env=env).start()
    (again,) = (await ctl(d, "approvals"))["approvals"]
    assert again["id"] == pending["id"]
    decided = await ctl(d, "approve", pending["id"])
    assert decided["approve"]["outcome"] == "approved"
    assert (await ctl(d, "approvals"))["approvals"] == []
    await d.stop(signal.SIGKILL)
    assert not ledger.exists()  # it had not run

    d = await DaemonProcess(home, env={"AGENTD_TEST_LEDGER": str(ledger)}).start()
    try:
        async with BusClient(d.url, "alice", session=session, cafile=d.cafile) as bus:
            paid = await next_on(bus, thread, "paid")
            assert b"<amount>42</amount>" in paid
        code, doc = await asyncio.to_thread(d.agentctl, "approve", pending["id"])
        assert code == 1 and doc["error"]["code"] == "invalid"  # replayed: refused
    finally:
        assert await d.stop() == 0
    assert ledger.read_text().split() == ["42"]
    assert verify_journal_main(home / "state") == 0


async def test_an_operator_denial_reaches_the_client(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            thread = await bus.send(Pay(amount=5))
            await next_on(bus, thread, "approval-required")
            (pending,) = (await ctl(d, "approvals"))["approvals"]
            await ctl(d, "deny", pending["id"], "--reason", "not on a Friday")
            huh = await next_on(bus, thread, "huh")
            assert b"<code>denied</code>" in huh and b"not approved" in huh
        journal = (await ctl(d, "journal", "--thread", thread))["journal"]
        kinds = [e["kind"] for e in journal]
        assert "approval-request" in kinds and "approval-decision" in kinds
    finally:
        assert await d.stop() == 0


# ---- an agent's parked call across kill -9 ------------------------------------------------


def gate_the_calculator(home: Path, server: Any, isolated: bool = False) -> None:
    """The tutor on the fake model, with the timer among its peers; calculator.add
    behind an operator-only gate. `isolated`: the tutor's loop in a worker."""
    from tests.daemon_process import edit_config

    def edit(doc: dict[str, Any]) -> None:
        tutor = next(lst for lst in doc["listeners"] if lst["name"] == "tutor")
        tutor["peers"].append("clock")
        if isolated:
            tutor["isolation"] = {"workers": 1, "memory_mb": 2048}
        doc["llm"]["retries"] = 0
        doc["llm"]["backends"] = [{"name": "tutor-model", "provider": "openai",
                                   "base_url": server.base_url, "model": "fake-1"}]
        add = next(lst for lst in doc["listeners"] if lst["name"] == "calculator.add")
        add["approval"] = {"approvers": ["operator"], "timeout_s": 600}

    edit_config(home, edit)


async def ask_then_kill_9(home: Path, question: Any, kind: str,
                          before_kill: Callable[[DaemonProcess, str], Awaitable[Any]]
                          ) -> tuple[str, str, Any]:
    """Ask the tutor `question`, wait for a frame of `kind` on its thread, run
    `before_kill`, then SIGKILL the daemon: (thread, bus session, what it returned)."""
    d = await DaemonProcess(home).start()
    async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
        thread = await bus.send(question)
        await next_on(bus, thread, kind)
        session = bus.session
        seen = await before_kill(d, thread)
    await d.stop(signal.SIGKILL)
    return thread, session, seen


async def answer_after_restart(home: Path, thread: str, session: str,
                               act: Callable[[DaemonProcess], Awaitable[Any]]) -> bytes:
    """Restart the daemon, resume the bus session, run `act`, return the answer."""
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", session=session, cafile=d.cafile) as bus:
            await act(d)
            return await next_on(bus, thread, "answer")
    finally:
        assert await d.stop() == 0


@pytest.mark.parametrize("isolated", [False, True], ids=["in-process", "isolated"])
async def test_an_agents_parked_call_approved_after_kill_9_resumes_its_task(
        home: Path, isolated: bool) -> None:
    from agentd.platform.demo import MathQuestion
    from tests.llm_servers import FakeLLM, add_call, values

    def script(seen: Any) -> str:
        got = values(seen.conversation().results)
        if not got:
            return f"Let me add.\n{add_call(2, 40)}"
        return f"The sum is {got[0]}."

    async def parked(d: DaemonProcess, thread: str) -> Any:
        (pending,) = (await ctl(d, "approvals"))["approvals"]
        assert pending["listener"] == "calculator.add" and pending["thread"] == thread
        return pending

    async with FakeLLM("openai", script) as server:
        gate_the_calculator(home, server, isolated)
        thread, session, pending = await ask_then_kill_9(
            home, MathQuestion(text="What is 2 + 40?"), "approval-required", parked)
        assert len(server.requests) == 1

        async def approve(d: DaemonProcess) -> None:
            decided = await ctl(d, "approve", pending["id"])
            assert decided["approve"]["outcome"] == "approved"
            # The restarted process rebuilt the task from its durable history (an
            # isolated agent's worker asked the daemon for it; its log is its own).
            if not isolated:
                await d.wait_for_line(r"agent tutor: task restored .* iterations=1 pending=1")
            else:
                pools = (await ctl(d, "status"))["status"]["isolation"]["pools"]
                assert [p["listener"] for p in pools] == ["tutor"]

        answer = await answer_after_restart(home, thread, session, approve)
        assert b"The sum is 42." in answer
    # One model turn before the crash, one after the tool result: the history the
    # second turn saw holds the first reply and the gated call's result, once.
    assert len(server.requests) == 2
    second = server.requests[1].conversation()
    assert len(second.replies) == 1 and values(second.results) == [42]
    assert out_frames(home, thread, "answer") == 1
    assert verify_journal_main(home / "state") == 0


async def test_a_timer_an_agent_set_fires_after_kill_9_and_its_task_finishes(
        home: Path) -> None:
    """The agent's `wait` is answered by a `woke` from the restarted daemon: the task
    is rebuilt from its durable history and the model's next turn sees the note."""
    from agentd.durable.timers import NAMESPACE
    from agentd.platform.demo import MathQuestion
    from tests.llm_servers import FakeLLM

    wait = f'<wait xmlns="{NAMESPACE}"><seconds>3</seconds><note>ring</note></wait>'

    def script(seen: Any) -> str:
        results = seen.conversation().results
        if not results:
            return f"I will wait.\n{wait}"
        return "Woken: " + ("ring" if "<note>ring</note>" in results[0].content else "?")

    async def timer_set(d: DaemonProcess, thread: str) -> None:
        async with asyncio.timeout(60):  # each look is an agentctl round trip
            while not (await ctl(d, "introspect", "timers"))["timers"]:
                pass

    async def nothing(d: DaemonProcess) -> None:
        return None

    async with FakeLLM("openai", script) as server:
        gate_the_calculator(home, server)
        thread, session, _ = await ask_then_kill_9(
            home, MathQuestion(text="Wait, then answer."), "accepted", timer_set)
        answer = await answer_after_restart(home, thread, session, nothing)
        assert b"Woken: ring" in answer
    assert len(server.requests) == 2
    assert len(server.requests[1].conversation().replies) == 1
    assert out_frames(home, thread, "answer") == 1


# ---- the operator ends a conversation ------------------------------------------------------


async def test_agentctl_end_thread_cancels_timers_and_denies_parked_calls(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            paying = await bus.send(Pay(amount=9))
            await next_on(bus, paying, "approval-required")
            waiting = await bus.send(Wait(seconds=Decimal("600"), note="never"))
            await next_on(bus, waiting, "accepted")
            assert len((await ctl(d, "introspect", "timers"))["timers"]) == 1

            ended = await ctl(d, "end-thread", paying)
            assert ended["end-thread"] == {"thread": paying, "ended": True}
            huh = await next_on(bus, paying, "huh")
            assert b"<code>denied</code>" in huh and b"not approved" in huh
            assert (await ctl(d, "approvals"))["approvals"] == []
            await ctl(d, "end-thread", waiting)
            assert (await ctl(d, "introspect", "timers"))["timers"] == []
    finally:
        assert await d.stop() == 0


async def test_end_thread_refuses_unknown_ended_and_malformed_threads_alike(
        home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            thread = await bus.send(Wait(seconds=Decimal("600"), note="kept"))
            await next_on(bus, thread, "accepted")
        await ctl(d, "end-thread", thread)
        for bad in (thread, "7b5d3495-945c-42ec-97e6-1954d4969896", "../../etc/passwd",
                    thread.upper(), ""):
            code, doc = await asyncio.to_thread(d.agentctl, "end-thread", bad)
            assert code == 1, doc
            assert doc["error"] == {"code": "invalid",
                                    "message": "no active conversation with that thread"}
    finally:
        assert await d.stop() == 0


# ---- an isolated agent across a reload ----------------------------------------------------


def worker_pids(d: DaemonProcess) -> set[int]:
    """The daemon's isolation workers (its children running `agentd.isolation.worker`)."""
    assert d.proc is not None
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (int(stat.rsplit(")", 1)[1].split()[1]) == d.proc.pid
                and b"agentd.isolation.worker" in cmdline):
            found.add(int(entry.name))
    return found


async def test_an_isolated_agent_answers_before_and_after_a_reload_that_replaces_its_pool(
        home: Path) -> None:
    """A reload that changes the agent builds a new platform, and with it a new pool
    for the isolated agent (its bridge answers with the new platform); the replay
    model answers the same question through both."""
    from agentd.platform.demo import MathQuestion
    from tests.daemon_process import edit_config

    def tutor(change: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def edit(doc: dict[str, Any]) -> None:
            change(next(lst for lst in doc["listeners"] if lst["name"] == "tutor"))
        return edit

    edit_config(home, tutor(lambda t: t.update(isolation={"workers": 1})))
    question = MathQuestion(text="What is (2 + 3) * 7?")
    d = await DaemonProcess(home).start()
    try:
        before = worker_pids(d)
        assert before  # the tutor's worker and its spare
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            first = await next_on(bus, await bus.send(question), "answer")
            assert b"(2 + 3) * 7 = 35." in first
            edit_config(home, tutor(lambda t: t.update(timeout_s=120)))  # not in the prompt
            reloaded = await ctl(d, "reload")
            assert "tutor" in reloaded["reload"]["changed"]
            assert worker_pids(d) - before  # the new platform's pool
            second = await next_on(bus, await bus.send(question), "answer")
            assert b"(2 + 3) * 7 = 35." in second
        pools = (await ctl(d, "status"))["status"]["isolation"]["pools"]
        assert [(p["listener"], p["restarts"]) for p in pools] == [("tutor", 0)]
    finally:
        assert await d.stop() == 0


# ---- parked bytes are bounded, across kill -9 ----------------------------------------------

BULK_SIZE = 240_000
PARKED_CAP = 1_300_000  # five parked envelopes of ~240 KB fit, a sixth does not


async def test_a_client_parking_large_payloads_is_bounded_in_bytes_across_kill_9(
        tmp_path: Path) -> None:
    """900 envelopes of ~240 KB to an operator-only gate all parked (RSS 235 -> 627 MiB,
    and the restart after kill -9 loaded every one again): parked bytes are capped per
    client, past it the sender is answered `huh rate-limited`, nothing parked is lost
    across kill -9, and the cap still holds after the restart."""
    from agentd.client import frame_kind
    from tests.daemon_process import edit_config
    from tests.organisms.listeners import Bulk

    home = tmp_path / "home"
    make_home(home, [{
        "name": "bulk", "payload_class": "tests.organisms.listeners:Bulk",
        "response_class": "tests.organisms.listeners:Done",
        "handler": "tests.organisms.listeners:bulk", "description": "Takes a lot.",
        "approval": {"approvers": ["operator"], "timeout_s": 600}}])
    edit_config(home, lambda doc: doc["pump"].update(max_parked_bytes_per_client=PARKED_CAP))

    async def send_bulk(bus: BusClient, i: int) -> str:
        """Send one large envelope: what its sender hears first after `accepted` (or
        instead of it)."""
        thread = await bus.send(Bulk(text=f"{i:06d}" * (BULK_SIZE // 6)))
        while True:
            frame = await bus.recv(timeout=30)
            _, kind, on = frame_kind(frame)
            if on == thread and kind == "huh":
                return "huh " + frame.split(b"<code>")[1].split(b"</code>")[0].decode()
            if on == thread and kind != "accepted":
                return kind

    d = await DaemonProcess(home).start()
    try:
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            heard = [await send_bulk(bus, i) for i in range(8)]
            session = bus.session
        assert heard == ["approval-required"] * 5 + ["huh rate-limited"] * 3
        assert any("approval-limit" in line for line in d.log)
        parked = (await ctl(d, "approvals"))["approvals"]
        held = (await ctl(d, "status"))["status"]["approvals_parked_bytes"]
        assert len(parked) == 5 and 5 * BULK_SIZE < held <= PARKED_CAP
    finally:
        await d.stop(signal.SIGKILL)

    d = await DaemonProcess(home).start()
    try:
        # Everything accepted is still parked, holding what it held, and no more.
        assert [p["id"] for p in (await ctl(d, "approvals"))["approvals"]] == [
            p["id"] for p in parked]
        assert (await ctl(d, "status"))["status"]["approvals_parked_bytes"] == held
        async with BusClient(d.url, "alice", session=session, cafile=d.cafile) as bus:
            assert await send_bulk(bus, 8) == "huh rate-limited"
            await ctl(d, "deny", parked[0]["id"])  # a decision makes room
            assert await send_bulk(bus, 9) == "approval-required"
        assert (await ctl(d, "status"))["status"]["approvals_parked_bytes"] <= PARKED_CAP
    finally:
        assert await d.stop() == 0
