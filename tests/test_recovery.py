"""Crash recovery: an accepted message is never lost.

A real child process runs the organism over a real SQLite state directory and is
killed with SIGKILL at random moments under load; after each restart, every request
that was ever `accepted` must eventually be answered with the right value."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentd._envelope import build_envelope
from agentd._threads import new_uuid
from agentd._xmlify import spec_of
from agentd.demo import ORGANISM as DEMO_ORGANISM
from agentd.kernel import Kernel, ThreadRow
from agentd.pump.recovery import rebuild_frames
from agentd.testing import Harness
from agentd.tools.calculator import Add
from agentd.tools.relay import Relay
from tests.organisms import listeners as L

ROOT = Path(__file__).resolve().parent.parent
ORGANISM = Path(__file__).parent / "organisms" / "basic.yaml"


def run_child(state_dir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.crash_runner", str(state_dir), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_accepted_messages_survive_sigkill_at_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20261122)
    expected: dict[str, int] = {}
    replies: dict[str, set[int]] = {}

    def read(line: str) -> None:
        kind, *rest = line.split()
        if kind == "A":
            expected[rest[0]] = int(rest[1])
        elif kind == "R":
            replies.setdefault(rest[0], set()).add(int(rest[1]))

    for _round in range(6):
        child = run_child(tmp_path, "load", "3000")
        assert child.stdout is not None
        kill_after = rng.randint(5, 2500)
        for seen, line in enumerate(child.stdout, start=1):
            read(line)
            if seen >= kill_after:
                break
        child.send_signal(signal.SIGKILL)
        child.wait()
        # Lines already written before the kill are still ours to read.
        for line in child.stdout:
            read(line)
    drain = run_child(tmp_path, "drain")
    out, _ = drain.communicate(timeout=120)
    for line in out.splitlines():
        if line != "DONE":
            read(line)
    assert out.splitlines()[-1] == "DONE"
    assert len(expected) > 100
    missing = [t for t in expected if t not in replies]
    assert not missing, f"{len(missing)} accepted requests never answered"
    wrong = {t: v for t, v in replies.items() if t in expected and v != {expected[t]}}
    assert not wrong

    async def verify() -> tuple[bool, int | None, str]:
        async with await Kernel.open(tmp_path) as kernel:
            assert await kernel.pending_messages() == []
            return await kernel.verify()

    ok, bad, why = asyncio.run(verify())
    assert ok, (bad, why)


async def test_pending_messages_are_redelivered_with_the_flag(tmp_path: Path) -> None:
    """Requests accepted while their handler is still running are redelivered, marked
    `redelivered`, when the organism starts again on the same state directory, and
    their answers reach the client on the original threads."""
    hold = spec_of(L.Hold)
    threads = [new_uuid() for _ in range(5)]
    L.GATE["event"] = None  # the first run's handlers never return
    async with Harness.from_config(ORGANISM, {"alice": "public"}, state_dir=tmp_path) as h:
        for n, t in enumerate(threads):
            data = build_envelope("alice", t, hold.to_bytes(L.Hold(n=n)))
            assert (await h.pump.submit("alice", data)).accepted
    assert all(not redelivered for _, redelivered in L.SEEN.get("hold", []))
    L.SEEN.clear()
    gate = L.GATE["event"] = asyncio.Event()
    gate.set()
    async with Harness.from_config(ORGANISM, {"alice": "public"}, state_dir=tmp_path) as h:
        await h.run_until_idle()
        assert sorted(L.SEEN["hold"]) == [(n, True) for n in range(5)]
        for n, t in enumerate(threads):
            (done,) = [f for f in h.frames("alice", t) if b"<done" in f]
            assert f"<seq>{n}</seq>".encode() in done


async def test_an_answer_in_flight_when_the_writer_dies_reaches_its_client(
        tmp_path: Path) -> None:
    """The kernel's writer process dies (the OOM killer, say) while it holds the
    answer to an accepted message. The client used to wait for that answer until the
    daemon restarted; now the next writer commits it and the client gets it, once,
    from the one run of its handler."""
    hold = spec_of(L.Hold)
    thread = new_uuid()
    L.SEEN.clear()
    gate = L.GATE["event"] = asyncio.Event()
    async with Harness.from_config(ORGANISM, {"alice": "public"}, state_dir=tmp_path) as h:
        kernel = h.kernel
        assert kernel is not None
        data = build_envelope("alice", thread, hold.to_bytes(L.Hold(n=7)))
        assert (await h.pump.submit("alice", data)).accepted
        os.kill(kernel.writer.pid, signal.SIGSTOP)  # takes the answer, never writes it
        gate.set()
        async with asyncio.timeout(10):
            while not kernel.in_flight:  # loop turns until the answer is with the writer
                await asyncio.sleep(0)
        await kernel.writer.kill()
        async with asyncio.timeout(10):
            await kernel.wait_healthy()
            await h.run_until_idle()
        done = [f for f in h.frames("alice", thread) if b"<done" in f]
        assert len(done) == 1 and b"<seq>7</seq>" in done[0]
        assert L.SEEN["hold"] == [(7, False)]  # handled once, not again
        assert kernel.writer_restarts == 1
        assert await kernel.pending_messages() == []
        ok, _, message = await kernel.verify()
        assert ok, message


async def test_thread_chain_and_profile_survive_a_restart(tmp_path: Path) -> None:
    add = spec_of(Add)
    thread = new_uuid()
    async with Harness.from_config(ORGANISM, {"nina": "narrow"}, state_dir=tmp_path) as h:
        frames = await h.send("nina", build_envelope("nina", thread, add.to_bytes(Add(a=1, b=2))))
        assert b"<sum" in frames[-1]
    async with Harness.from_config(ORGANISM, {"nina": "narrow"}, state_dir=tmp_path) as h:
        frame = h.pump.registry.get(thread)
        assert frame is not None and frame.profile.name == "narrow" and frame.path == ("nina",)
        again = await h.send("nina", build_envelope("nina", thread, add.to_bytes(Add(a=2, b=2))))
        assert b"<value>4</value>" in again[-1]
        relay = build_envelope("nina", thread, spec_of(Relay).to_bytes(Relay(a=1, b=1)))
        refused = await h.send("nina", relay)
        assert b"<code>unroutable</code>" in refused[0]


FAN_ORGANISM = """
organism: {name: refs}
pump: {max_concurrency: 8, handler_timeout_s: 30, max_hops: 10}
profiles:
  public: {listeners: [fan, forward, hold]}
listeners:
  - name: fan
    payload_class: tests.organisms.listeners:Fan
    response_class: tests.organisms.listeners:Done
    handler: tests.organisms.listeners:fan
    description: Calls twice.
    peers: [forward, hold]
  - name: forward
    payload_class: tests.organisms.listeners:Ask
    response_class: tests.organisms.listeners:Done
    handler: tests.organisms.listeners:forward
    description: Asks hold.
    peers: [hold]
  - name: hold
    payload_class: tests.organisms.listeners:Hold
    response_class: tests.organisms.listeners:Done
    handler: tests.organisms.listeners:hold
    description: Waits at a gate the tests control.
"""


async def test_a_calls_ref_comes_back_with_its_answer_after_a_restart(tmp_path: Path) -> None:
    """`fan` names its two calls; both are open when the organism stops: one's
    request is pending in the journal, the other's callee (`forward`) waits for a
    call of its own, its frame in the thread table. After the restart each answer
    comes back under the ref of the call it answers."""
    config = tmp_path / "organism.yaml"
    config.write_text(FAN_ORGANISM)
    thread = new_uuid()
    L.SEEN.clear()
    L.GATE["event"] = None  # the first run's holds never return
    async with Harness.from_config(config, {"alice": "public"}, state_dir=tmp_path) as h:
        data = build_envelope("alice", thread, spec_of(L.Fan).to_bytes(L.Fan(n=0)))
        assert (await h.pump.submit("alice", data)).accepted
        async with asyncio.timeout(10):
            while len(L.SEEN.get("hold", ())) < 2:
                await asyncio.sleep(0.01)
        assert h.kernel is not None
        await h.kernel.flush()
        rows = await h.kernel.threads()
        assert sorted(r.call_ref for r in rows) == ["", "", "first"]  # root, fan, forward
    gate = L.GATE["event"] = asyncio.Event()
    gate.set()
    async with Harness.from_config(config, {"alice": "public"}, state_dir=tmp_path) as h:
        await h.run_until_idle()
        assert sorted(L.SEEN["fan"]) == [("first", 1, "forward"), ("second", 2, "hold")]
        assert any(b"<by>fan</by>" in f for f in h.frames("alice", thread))


async def test_a_second_organism_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    from agentd.kernel import StateLocked

    async with Harness.from_config(ORGANISM, {"alice": "public"}, state_dir=tmp_path):
        with pytest.raises(StateLocked):
            async with Harness.from_config(ORGANISM, {"alice": "public"}, state_dir=tmp_path):
                pass


@contextlib.asynccontextmanager
async def nearly_full_disk(tmp_path: Path) -> AsyncIterator[tuple[Harness, Kernel]]:
    """The demo organism over a database allowed to grow by 64 KiB more."""
    async with Harness.from_config(
        DEMO_ORGANISM,
        {"alice": "public"},
        state_dir=tmp_path,
    ) as h:
        kernel = h.kernel
        assert kernel is not None
        await kernel.set_max_db_bytes(kernel.db_size_bytes() + 64 * 1024)
        yield h, kernel


async def test_disk_full_refuses_with_internal_and_acknowledges_nothing_unwritten(
    tmp_path: Path,
) -> None:
    from agentd.tools.echo import Echo

    async with nearly_full_disk(tmp_path) as (h, kernel):
        codes = []
        for _ in range(300):
            frames = await h.send("alice", Echo(text="x" * 4000))
            code = (
                frames[0].split(b"<code>")[1].split(b"</code>")[0] if b"<huh" in frames[0] else b""
            )
            codes.append(code)
            if code:
                break
        assert codes[-1] == b"internal"  # refused, never `accepted`
        assert not any(b"<accepted" in f for f in frames)
        assert all(c == b"" for c in codes[:-1])
        await kernel.set_max_db_bytes(None)
        async with asyncio.timeout(10):  # the kernel probes the disk by itself, with backoff
            await kernel.wait_healthy()
        frames = await h.send("alice", Echo(text="back"))
        assert b"<accepted" in frames[0] and b"<text>back</text>" in frames[-1]


async def test_submit_nowait_refuses_with_internal_when_the_disk_is_full(tmp_path: Path) -> None:
    """The provisional result of `submit_nowait` is not an acknowledgement: when the
    commit fails the client gets `huh internal`, never `accepted`."""
    from agentd.tools.echo import Echo

    async with nearly_full_disk(tmp_path) as (h, kernel):
        for _ in range(300):
            thread = new_uuid()
            result = h.pump.submit_nowait("alice", h.wrap("alice", Echo(text="x" * 4000), thread))
            assert result is not None and result.thread == thread
            await h.run_until_idle()
            frames = h.frames("alice", thread)
            if b"<huh" in frames[0]:
                break
        assert b"<code>internal</code>" in frames[0]
        assert not any(b"<accepted" in f for f in frames)
        await kernel.set_max_db_bytes(None)


def test_a_frame_whose_profile_is_gone_is_logged_under_its_clients_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    root, child = new_uuid(), new_uuid()
    rows = [
        ThreadRow(child, ("alice", "relay"), root, "alice", "removed", 1, "active", 0.0, 0.0),
        ThreadRow(root, ("alice",), None, "alice", "removed", 1, "active", 0.0, 0.0),
    ]
    with caplog.at_level(logging.WARNING, logger="agentd.pump"):
        assert rebuild_frames(rows, {}) == {}
    named = [r.getMessage() for r in caplog.records if "no longer exists" in r.getMessage()]
    assert named == [f"profile removed no longer exists thread={root} frame={child}",
                     f"profile removed no longer exists thread={root}"]
