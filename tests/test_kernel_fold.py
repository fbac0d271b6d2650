"""Folds: a batch sent to the writer in two parts that commit in one SQLite
transaction (the first part applied while the event loop still builds the second).
Against real SQLite files: the writer's side driven directly, then the kernel's."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from agentd.kernel import Kernel, KernelUnavailable, Transaction
from agentd.kernel._lock import _alive  # gone or a zombie: not alive
from agentd.kernel._store import verify_file
from agentd.kernel._transaction import TxContext
from agentd.kernel._writer import _Served

DB = "agentd.db"


@pytest.fixture
def served(tmp_path: Path) -> Any:
    s = _Served()
    s.open(str(tmp_path / DB), {"synchronous": "NORMAL"})
    yield s
    s.close()


def ctx_of(s: _Served) -> TxContext:
    head = s.store.head
    return TxContext(next_seq=head.seq + 1, next_outbox_id=head.outbox_id + 1,
                     full_sync_profiles={"bank"})


def entry(ctx: TxContext, thread: str, *, client: str = "alice", profile: str = "public"
          ) -> tuple:
    tx = Transaction(ctx)
    tx.journal(thread=thread, direction="in", payload=thread.encode(), profile=profile)
    tx.outbox_put(client, thread, thread.encode())
    return tx.wire()


def threads_in(db: Path) -> list[str]:
    """What another connection sees committed."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute("SELECT thread FROM journal ORDER BY pos")]
    finally:
        conn.close()


def committed(reply: tuple) -> tuple[int, list]:
    ok, (seconds, ops, rejected, storage) = reply
    assert ok and seconds >= 0 and storage is None
    return ops, rejected


def test_the_parts_of_a_fold_commit_together(served: _Served, tmp_path: Path) -> None:
    ctx = ctx_of(served)
    assert served.fold([entry(ctx, "a1"), entry(ctx, "a2")], True) is None
    assert served.folding
    assert threads_in(tmp_path / DB) == []  # applied, not committed: nobody sees it
    replies = served.fold([entry(ctx, "b1")], False)
    assert replies is not None and len(replies) == 2
    # one commit: the last part reports the fold's operations, the first none
    assert [committed(r) for r in replies] == [(0, []), (6, [])]
    assert not served.folding
    assert threads_in(tmp_path / DB) == ["a1", "a2", "b1"]
    verdict = verify_file(tmp_path / DB)  # one chain across the parts
    assert verdict.ok, verdict.message
    # the chain goes on from the fold's head in the next, ordinary batch
    served.write_batch([entry(ctx, "c1")])
    assert verify_file(tmp_path / DB).ok


def test_a_bad_transaction_in_a_fold_is_rejected_alone(served: _Served,
                                                       tmp_path: Path) -> None:
    served.store.conn.execute(
        "CREATE TRIGGER poison BEFORE INSERT ON outbox WHEN NEW.client = 'poison' "
        "BEGIN SELECT RAISE(ABORT, 'poisoned outbox row'); END")
    ctx = ctx_of(served)
    assert served.fold([entry(ctx, "a1")], True) is None
    replies = served.fold([entry(ctx, "b1"), entry(ctx, "bad", client="poison"),
                           entry(ctx, "b2")], False)
    assert replies is not None
    assert committed(replies[0]) == (2, [])
    ops, rejected = committed(replies[1])
    assert ops == 4  # the bad one was written as nothing
    assert [i for i, _ in rejected] == [1] and "poisoned" in rejected[0][1]
    assert threads_in(tmp_path / DB) == ["a1", "b1", "b2"]
    assert verify_file(tmp_path / DB).ok


def test_a_batch_that_wants_a_full_sync_commits_alone(served: _Served,
                                                      tmp_path: Path) -> None:
    ctx = ctx_of(served)
    assert served.fold([entry(ctx, "a1")], True) is None
    replies = served.fold([entry(ctx, "bank1", profile="bank")], False)
    assert replies is not None and [committed(r)[1] for r in replies] == [[], []]
    assert threads_in(tmp_path / DB) == ["a1", "bank1"]
    assert served.pragma("synchronous") == 1  # NORMAL again after the FULL commit


def test_a_request_other_than_the_next_part_commits_the_fold_first(
        served: _Served, tmp_path: Path) -> None:
    ctx = ctx_of(served)
    assert served.fold([entry(ctx, "a1")], True) is None
    replies = served.end_fold()
    assert len(replies) == 1 and committed(replies[0]) == (2, [])
    assert threads_in(tmp_path / DB) == ["a1"] and not served.folding


def test_a_fold_never_finished_is_undone(tmp_path: Path) -> None:
    s = _Served()
    s.open(str(tmp_path / DB), {"synchronous": "NORMAL"})
    ctx = ctx_of(s)
    s.write_batch([entry(ctx, "before")])
    assert s.fold([entry(ctx, "lost")], True) is None
    s.close()  # the daemon went away before sending the rest
    assert threads_in(tmp_path / DB) == ["before"]
    assert verify_file(tmp_path / DB).ok


def test_a_storage_error_fails_the_whole_fold(served: _Served, tmp_path: Path) -> None:
    ctx = ctx_of(served)
    assert served.fold([entry(ctx, "a1")], True) is None
    served.store.set_max_bytes(served.store.page_size * 2)  # far below the file's size
    big = Transaction(ctx)
    big.journal(thread="big", direction="in", payload=b"x" * 200_000)
    replies = served.fold([big.wire()], False)
    assert replies is not None and len(replies) == 2
    assert all(not ok for ok, *_ in replies)
    assert all(r[2] is not None and r[2] & 0xFF == sqlite3.SQLITE_FULL for r in replies)
    assert not served.folding
    served.store.set_max_bytes(None)
    assert threads_in(tmp_path / DB) == []  # neither part
    served.write_batch([entry(ctx_of(served), "after")])
    assert threads_in(tmp_path / DB) == ["after"]


async def test_a_lone_envelope_and_its_answer_are_sent_as_a_fold(tmp_path: Path) -> None:
    calls: list[tuple[int, Any]] = []
    commits: list[int] = []
    async with await Kernel.open(tmp_path / "state",
                                 on_commit=lambda s, n: commits.append(n)) as k:
        proc = k.writer
        real = proc.call

        def record(method: str, *args: Any, **kw: Any) -> asyncio.Future[Any]:
            if method == "write_batch":
                calls.append((len(args[0]), args[2] if len(args) > 2 else None))
            return real(method, *args, **kw)

        proc.call = record  # type: ignore[method-assign]
        arrival = k.transaction()
        arrival.journal(thread="t", direction="in", pending=True)
        answer = k.transaction()
        seq = arrival.rows[0][0]

        def handler() -> None:  # answers in the next loop turn, as a handler does
            answer.delivered(seq)
            answer.journal(thread="t", direction="out")
            answer.outbox_put("alice", "t", b"<answer/>")
            k.commit_then(answer, lambda exc: done.append(exc))

        done: list[BaseException | None] = []
        first = k.commit(arrival)
        asyncio.get_running_loop().call_soon(handler)
        await first
        await k.flush()
        assert calls[:2] == [(1, True), (1, False)]
        assert len(commits) == 1  # one SQLite transaction for both parts
        assert done == [None]
        assert await k.pending_messages() == []
        assert [d for _, _, d in await k.outbox("alice")] == [b"<answer/>"]
        ok, _, message = await k.verify()
        assert ok, message
        # Nothing a handler is to take (a delivery mark): one ordinary batch, no fold.
        calls.clear()
        mark = k.transaction()
        mark.outbox_delivered("alice", 10**9)
        await k.commit(mark)
        assert calls == [(1, None)]
        assert await k.outbox("alice") == []


async def test_a_close_cancelled_mid_fold_leaves_no_caller_waiting(tmp_path: Path) -> None:
    """close() cancelled while the writer holds a fold's first part: every caller of
    both parts hears an outcome, and the fold is in the database whole or not at all."""
    state = tmp_path / "state"
    k = await Kernel.open(state)
    loop = asyncio.get_running_loop()
    proc = k.writer
    real = proc.call
    closing: list[asyncio.Task[None]] = []
    started = asyncio.Event()

    def record(method: str, *args: Any, **kw: Any) -> asyncio.Future[Any]:
        if method == "write_batch" and len(args) > 2 and args[2] is True and not closing:
            closing.append(loop.create_task(k.close()))
            started.set()
            loop.call_soon(closing[0].cancel)  # once close() has started waiting
        return real(method, *args, **kw)

    proc.call = record  # type: ignore[method-assign]
    arrival = k.transaction()
    arrival.journal(thread="t", direction="in", pending=True)
    done: list[BaseException | None] = []

    def handler() -> None:
        answer = k.transaction()
        answer.delivered(arrival.rows[0][0])
        answer.journal(thread="t", direction="out")
        k.commit_then(answer, done.append)

    first = k.commit(arrival)
    loop.call_soon(handler)
    await asyncio.wait_for(started.wait(), 5)
    with pytest.raises(asyncio.CancelledError):
        await closing[0]
    outcome = await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), 5)
    assert outcome[0] is None or isinstance(outcome[0], KernelUnavailable)
    assert len(done) == 1 and (done[0] is None or isinstance(done[0], KernelUnavailable))
    assert threads_in(state / DB) in ([], ["t", "t"])  # both parts or neither
    assert verify_file(state / DB).ok


# A daemon that sends the first part of a fold and is SIGKILLed before the second:
# it prints the writer's pid once the writer has read and applied the first part (it
# woke and waits again), then waits to be killed.
HALF_FOLD = textwrap.dedent("""
    import asyncio, sys
    from agentd.kernel import Kernel

    async def main():
        kernel = await Kernel.open(sys.argv[1])
        before = kernel.transaction()
        before.journal(thread="before", direction="in")
        await kernel.commit(before)
        sent = asyncio.Event()
        pid = kernel.writer.pid

        def read_so_far():  # how often the writer has waited, and whether it waits
            status = open(f"/proc/{pid}/status").read()
            waits = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
            state = status.split("State:")[1].split()[0]
            return waits, state

        async def half(self):
            before = read_so_far()[0]
            self._write(self._take(), more=True)
            sent.set()
            # The writer has read the first part and applied it once it has woken
            # and waits again (for the second part, which never comes).
            while True:
                waits, state = read_so_far()
                if waits > before and state == "S":
                    break
                await asyncio.sleep(0.005)
            applied.set()
            await asyncio.Event().wait()

        applied = asyncio.Event()
        type(kernel)._send_folded = half
        lost = kernel.transaction()
        lost.journal(thread="lost", direction="in", pending=True)
        kernel.commit(lost)
        await sent.wait()
        await applied.wait()
        print(kernel.writer.pid, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def test_a_daemon_killed_between_the_parts_of_a_fold_commits_neither(tmp_path: Path) -> None:
    state = tmp_path / "state"
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-c", HALF_FOLD, str(state)], cwd=repo,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        writer_pid = int(proc.stdout.readline())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        # The writer sees EOF, rolls the open fold back and exits.
        deadline = time.monotonic() + 30
        while _alive(writer_pid):
            assert time.monotonic() < deadline, "writer did not exit"
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert threads_in(state / DB) == ["before"]
    verdict = verify_file(state / DB)
    assert verdict.ok, verdict.message
