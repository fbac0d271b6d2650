"""The kernel across processes: the lock, and SIGKILL at random moments under load."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentd.kernel import Kernel, StateLocked
from agentd.kernel._lock import _alive  # gone or a zombie: not alive

REPO = Path(__file__).resolve().parent.parent

# Commits in a loop from several producers and prints each seq once its commit
# future resolved: a printed seq is one that agentd would have acknowledged.
WRITER = textwrap.dedent("""
    import asyncio, os, sys, time
    from agentd.kernel import Kernel, ThreadRow

    async def main():
        kernel = await Kernel.open(sys.argv[1])
        print("ready", flush=True)

        async def producer(p):
            n = 0
            while True:
                n += 1
                thread = f"{os.getpid()}-{p}-{n}"
                tx = kernel.transaction()
                seq = tx.journal(thread=thread, direction="in", payload=b"<m>%d</m>" % n,
                                 pending=True)
                now = time.time()
                tx.thread_put(ThreadRow(thread, ("c", "h"), None, "c", "public", 1,
                                        "active", now, now))
                tx.outbox_put("c", thread, str(seq).encode())
                tx.context_append(thread, "user", b"x")
                await kernel.commit(tx)
                sys.stdout.write(f"{seq} {thread}\\n")
                sys.stdout.flush()

        await asyncio.gather(*(producer(p) for p in range(16)))

    asyncio.run(main())
""")

HOLDER = textwrap.dedent("""
    import asyncio, sys
    from agentd.kernel import Kernel

    async def main():
        kernel = await Kernel.open(sys.argv[1])
        print("ready", flush=True)
        print(kernel.writer.pid, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def spawn(script: str, state_dir: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script, str(state_dir)],
                            stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"ready\n":
        proc.kill()
        proc.wait()
        raise AssertionError(f"child did not start: {line!r}")
    return proc


async def test_second_kernel_from_another_process_is_refused(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    holder = spawn(HOLDER, state_dir)
    try:
        with pytest.raises(StateLocked) as info:
            await Kernel.open(state_dir)
        assert f"process {holder.pid}" in str(info.value)
        assert str(state_dir) in str(info.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    async with await Kernel.open(state_dir):  # the OS released the dead holder's lock
        pass


async def test_the_writer_process_of_a_killed_holder_exits_and_frees_the_state_dir(
        tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    holder = spawn(HOLDER, state_dir)
    assert holder.stdout is not None
    writer = int(holder.stdout.readline())
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 10
    while _alive(writer) and time.monotonic() < deadline:  # orphaned: sees EOF, exits
        time.sleep(0.01)
    assert not _alive(writer), "the writer outlived its daemon"
    async with await Kernel.open(state_dir):
        pass


async def test_a_killed_holder_left_unreaped_does_not_keep_the_state_dir(tmp_path: Path) -> None:
    """A daemon SIGKILLed by a parent that has not reaped it yet is a zombie: the
    lock must treat it as dead and wait only for its writer to exit."""
    state_dir = tmp_path / "state"
    holder = spawn(HOLDER, state_dir)
    holder.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(holder.pid) and time.monotonic() < deadline:  # a zombie, not reaped
        time.sleep(0.01)
    try:
        async with await Kernel.open(state_dir):
            pass
    finally:
        holder.wait()


async def test_sigkill_at_random_moments_loses_no_acknowledged_commit(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    seed = int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)
    acknowledged: dict[int, str] = {}
    last_round_max = 0
    for round_ in range(5):
        proc = spawn(WRITER, state_dir)
        time.sleep(rng.uniform(0.05, 0.5))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        lines = out.split(b"\n")[:-1]  # the last piece may be a torn line
        printed = {int(s): t.decode() for s, t in (line.split() for line in lines)}
        context = f"seed {seed}, round {round_}"
        assert printed, f"nothing committed before the kill ({context})"
        assert min(printed) > last_round_max, f"seq reused after restart ({context})"
        last_round_max = max(printed)
        acknowledged.update(printed)
        async with await Kernel.open(state_dir) as kernel:
            pending = {e.seq: e for e in await kernel.pending_messages()}
            missing = set(acknowledged) - set(pending)
            assert not missing, f"acknowledged but lost: {sorted(missing)[:10]} ({context})"
            outbox = {int(data) for _, _, data in await kernel.outbox("c", limit=10**6)}
            assert set(acknowledged) <= outbox, context
            for seq in rng.sample(sorted(acknowledged), 5):
                thread = acknowledged[seq]
                assert pending[seq].thread == thread
                row = await kernel.thread(thread)
                assert row is not None and row.state == "active", context
                assert await kernel.context(thread) == [(0, "user", b"x")], context
            ok, _bad, message = await kernel.verify()
            assert ok, f"{message} ({context})"
