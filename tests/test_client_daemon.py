"""`Client` and `agentd send` against a real `agentd run` process with an approval
gate (a home made by `agentd init`), decided with a real `agentctl`: a call waits
through `approval-required` to its outcome, `agentd send` prints only its own
threads, and `agentctl journal` shows who decided what and why."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentd import to_xml
from agentd.client import ApprovalRequired, Client, Event, Huh
from agentd.tools.echo import Echo
from tests.daemon_process import ROOT, DaemonProcess, make_home
from tests.organisms.durable import Paid, Pay

GATED: list[dict[str, Any]] = [
    {"name": "pay", "payload_class": "tests.organisms.durable:Pay",
     "response_class": "tests.organisms.durable:Paid",
     "handler": "tests.organisms.durable:pay", "description": "Pays.",
     "approval": {"approvers": ["operator"], "timeout_s": 600}},
]


@pytest.fixture
async def daemon(tmp_path: Path):
    home = tmp_path / "home"
    make_home(home, GATED)
    d = await DaemonProcess(home).start()
    yield d
    assert await d.stop() == 0


async def ctl(d: DaemonProcess, *args: str) -> Any:
    code, doc = await asyncio.to_thread(d.agentctl, *args)
    assert code == 0 and doc["ok"], doc
    return doc["result"]


def send_args(d: DaemonProcess, *args: str) -> list[str]:
    return [sys.executable, "-m", "agentd.cli", "send", "--url", d.url, "--client", "alice",
            "--secret-file", str(d.home / "alice.totp"), *args]


async def agentd_send(d: DaemonProcess, *args: str, stdin: bytes,
                      argv: list[str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *(argv or send_args(d, *args)), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    out, err = await asyncio.wait_for(proc.communicate(stdin), 90)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_a_call_waits_through_approval_and_returns_the_typed_answer(
    daemon: DaemonProcess,
) -> None:
    d = daemon
    parked: asyncio.Queue[ApprovalRequired] = asyncio.Queue()

    def seen(event: Event) -> None:
        if isinstance(event, ApprovalRequired):
            parked.put_nowait(event)

    async with Client.connect(d.url, "alice", secret_file=d.home / "alice.totp",
                              cafile=d.cafile) as c:
        call = asyncio.create_task(c.call(Pay(amount=7), timeout=60, on_event=seen))
        event = await asyncio.wait_for(parked.get(), 60)
        assert event.listener == "pay" and event.payload == to_xml(Pay(amount=7))
        assert not call.done()
        await ctl(d, "approve", event.approval)
        assert await asyncio.wait_for(call, 60) == Paid(amount=7)


async def test_send_waits_for_the_outcome_through_approval_required(
    daemon: DaemonProcess,
) -> None:
    """`agentd send` exited 0 at approval-required; the approved answer was printed by
    the next, unrelated `agentd send`."""
    d = daemon
    proc = await asyncio.create_subprocess_exec(
        *send_args(d, "--timeout", "60", "-"), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdin is not None and proc.stderr is not None and proc.stdout is not None
    proc.stdin.write(to_xml(Pay(amount=3)))
    proc.stdin.close()
    try:
        line = (await asyncio.wait_for(proc.stderr.readline(), 60)).decode()
        waiting = re.search(r"waiting for approval (\S+) of a call to pay .*"
                            r"agentctl approve (\S+)", line)
        assert waiting is not None, line  # (it had exited, without waiting)
        assert waiting.group(1) == waiting.group(2)
        await ctl(d, "approve", waiting.group(1))
        out = (await asyncio.wait_for(proc.stdout.read(), 60)).decode()
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert out.index("<- approval-required from core") < out.index("<- paid from pay")
    assert "<amount>3</amount>" in out


async def test_send_prints_only_its_own_threads_and_marks_the_others_on_stderr(
    daemon: DaemonProcess,
) -> None:
    """A call left parked by an earlier client is approved while nobody is connected;
    the next `agentd send` (resuming the session) gets that answer from the outbox and
    must not print it as its own."""
    d = daemon
    session = d.home / "alice.session"  # what `agentd send` uses beside alice.totp
    async with Client.connect(d.url, "alice", secret_file=d.home / "alice.totp",
                              session_file=session, cafile=d.cafile) as c:
        async for event in c.stream(Pay(amount=9)):
            if isinstance(event, ApprovalRequired):
                approval, left = event.approval, event.thread
                break
    await ctl(d, "approve", approval)
    code, out, err = await agentd_send(d, "-", stdin=to_xml(Echo(text="mine")))
    assert code == 0, err
    assert "paid" not in out and "<text>mine</text>" in out
    assert f"<- [other thread] paid from pay on thread {left}" in err
    code, out, err = await agentd_send(d, "--json", "-", stdin=to_xml(Echo(text="again")))
    report = json.loads(out)
    assert [f["kind"] for f in report["frames"]] == ["accepted", "echoreply"]
    assert report["others"] == []  # delivered once


async def test_journal_shows_who_decided_an_approval_and_why(daemon: DaemonProcess) -> None:
    """The decision's `by`, `reason` and `outcome` were in the database but not in
    `agentctl journal`."""
    d = daemon
    async with Client.connect(d.url, "alice", secret_file=d.home / "alice.totp",
                              cafile=d.cafile) as c:
        exchange = await c.start(Pay(amount=5))
        with pytest.raises(Huh) as denied:
            async for event in exchange.events():
                if isinstance(event, ApprovalRequired):
                    await ctl(d, "deny", event.approval, "--reason", "not on a Friday")
    assert (denied.value.code, denied.value.message) == ("denied", "not approved")
    journal = (await ctl(d, "journal", "--thread", exchange.thread))["journal"]
    (decision,) = [e for e in journal if e["kind"] == "approval-decision"]
    details = decision["details"]
    assert details["reason"] == "not on a Friday" and details["outcome"] == "denied"
    assert details["by"].startswith("operator") and details["listener"] == "pay"
    (request,) = [e for e in journal if e["kind"] == "approval-request"]
    assert request["details"]["sender"] == "alice"
    assert all("details" not in e for e in journal if e["direction"] in ("in", "out"))
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "agentctl", "--socket", d.socket, "--key",
         str(d.home / "operator.key"), "--key-id", "ops-1", "journal", "--thread",
         exchange.thread], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = done.stdout
    assert "reason: not on a Friday" in text and "outcome: denied" in text
