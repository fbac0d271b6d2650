"""The kernel against real SQLite files, and those of its tests that take `backend`
against real PostgreSQL too: each test tries to break one guarantee."""

from __future__ import annotations

import asyncio
import hashlib
import os
import select
import signal
import socket
import sqlite3
import stat
import time
from pathlib import Path

import psycopg
import pytest

from agentd.kernel import (
    DB_NAME,
    PRUNE_ON_DELIVERY,
    ContextLimitExceeded,
    Kernel,
    KernelUnavailable,
    Retention,
    SchemaTooNew,
    StateDirUnsafe,
    StateLocked,
    ThreadRow,
    TransactionRejected,
    _schema,
    retain_days,
    verify_journal_main,
)
from agentd.kernel._store import Store, verify_file


def thread_row(uuid: str, state: str = "active", *, profile: str = "public", hops: int = 0,
               parent: str | None = None, updated: float | None = None) -> ThreadRow:
    now = time.time()
    return ThreadRow(uuid=uuid, path=("client", "echo"), parent=parent, owner="alice",
                     profile=profile, table_version=3, state=state, created=now,
                     updated=now if updated is None else updated, hops=hops)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


class FakeClock:
    """A wall clock that moves only when told: the kernel's `clock`, so retention
    and TTLs expire without waiting them out."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def db_conn(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(state_dir / DB_NAME, isolation_level=None)


async def journal_one(kernel: Kernel, thread: str = "t1", *, payload: bytes = b"<m/>",
                      pending: bool = False, profile: str = "public",
                      direction: str = "in") -> int:
    tx = kernel.transaction()
    seq = tx.journal(thread=thread, direction=direction, handler="echo", sender="alice",
                     tag="{urn:test}m", payload=payload, profile=profile, pending=pending)
    await kernel.commit(tx)
    return seq


# -- durability and batching -----------------------------------------------------------


async def test_committed_transaction_is_readable_after_reopen(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as kernel:
        tx = kernel.transaction()
        seq = tx.journal(thread="t1", direction="in", handler="echo", sender="alice",
                         tag="{urn:test}m", payload=b"<m>hi</m>", profile="public", pending=True)
        row = thread_row("t1")
        tx.thread_put(row)
        oid = tx.outbox_put("alice", "t1", b"<reply/>")
        tx.context_append("t1", "user", b"hi")
        await kernel.commit(tx)
    async with await Kernel.open(state_dir, **backend) as kernel:
        [entry] = await kernel.journal()
        assert (entry.seq, entry.thread, entry.direction, entry.handler, entry.sender,
                entry.tag, entry.payload, entry.profile, entry.pending) == (
            seq, "t1", "in", "echo", "alice", "{urn:test}m", b"<m>hi</m>", "public", True)
        assert entry.payload_hash == hashlib.sha256(b"<m>hi</m>").hexdigest()
        assert await kernel.thread("t1") == row
        assert await kernel.outbox("alice") == [(oid, "t1", b"<reply/>")]
        assert await kernel.context("t1") == [(0, "user", b"hi")]
        assert [e.seq for e in await kernel.pending_messages()] == [seq]


async def test_group_commit_batches_many_transactions_into_few_commits(
        state_dir: Path, backend: dict) -> None:
    commits: list[tuple[float, int]] = []
    async with await Kernel.open(state_dir, **backend,
                                 on_commit=lambda s, n: commits.append((s, n))) as k:
        futures = []
        for i in range(300):
            tx = k.transaction()
            tx.journal(thread=f"t{i % 7}", direction="in", payload=b"<m/>")
            futures.append(k.commit(tx))
        await asyncio.gather(*futures)
    assert sum(n for _, n in commits) == 300
    assert len(commits) <= 10, f"{len(commits)} commits for 300 transactions"
    assert all(seconds >= 0 for seconds, _ in commits)


async def test_commit_max_entries_bounds_a_batch(state_dir: Path, backend: dict) -> None:
    commits: list[int] = []
    async with await Kernel.open(state_dir, **backend, commit_max_entries=16, commit_interval_s=0.5,
                                 on_commit=lambda s, n: commits.append(n)) as k:
        started = time.monotonic()
        futures = []
        for _ in range(64):
            tx = k.transaction()
            tx.journal(thread="t", direction="in")
            futures.append(k.commit(tx))
        await asyncio.gather(*futures)
        elapsed = time.monotonic() - started
    assert commits and max(commits) <= 16 and sum(commits) == 64
    assert elapsed < 1.0, "full batches must not wait for the interval"


async def test_single_transaction_commits_within_the_interval(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, commit_interval_s=0.002) as k:
        await journal_one(k)  # warm up
        started = time.monotonic()
        await journal_one(k)
        assert time.monotonic() - started < 0.5


async def test_transactions_commit_in_submission_order(state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, commit_max_entries=7) as k:
        built_first = k.transaction()
        early_seq = built_first.journal(thread="a", direction="in")
        built_second = k.transaction()
        late_seq = built_second.journal(thread="b", direction="in")
        done: list[int] = []
        futures = []
        # Submitted in the opposite order of building (and so of seq allocation).
        for i, tx in enumerate([built_second, built_first]):
            fut = k.commit(tx)
            fut.add_done_callback(lambda _f, i=i: done.append(i))
            futures.append(fut)
        for i in range(2, 100):
            tx = k.transaction()
            tx.journal(thread="c", direction="in")
            fut = k.commit(tx)
            fut.add_done_callback(lambda _f, i=i: done.append(i))
            futures.append(fut)
        await asyncio.gather(*futures)
        assert done == sorted(done)
        entries = await k.journal(limit=1000)
        assert [e.seq for e in entries][:2] == [late_seq, early_seq]  # commit order
        assert [e.pos for e in entries] == list(range(1, 101))
        assert (await k.verify())[:2] == (True, None)


async def test_flush_waits_for_everything_submitted(state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, commit_interval_s=0.01) as k:
        futures = []
        for _ in range(50):
            tx = k.transaction()
            tx.journal(thread="t", direction="in")
            futures.append(k.commit(tx))
        await k.flush()
        assert all(f.done() for f in futures)
        assert len(await k.journal(limit=100)) == 50


async def test_close_commits_what_was_submitted_without_waiting(
        state_dir: Path, backend: dict) -> None:
    k = await Kernel.open(state_dir, **backend, commit_interval_s=0.5)
    tx = k.transaction()
    seq = tx.journal(thread="t", direction="in", pending=True)
    k.commit(tx)  # not awaited
    await k.close()
    async with await Kernel.open(state_dir, **backend) as k:
        assert [e.seq for e in await k.pending_messages()] == [seq]


async def test_seqs_are_monotonic_across_reopen_even_after_pruning(
        state_dir: Path, backend: dict) -> None:
    seen: list[int] = []
    for _ in range(3):
        async with await Kernel.open(state_dir, **backend, retention=PRUNE_ON_DELIVERY) as k:
            for _ in range(5):
                seen.append(await journal_one(k))
            tx = k.transaction()
            tx.outbox_put("alice", "t", b"x")
            await k.commit(tx)
            await k.sweep()
            assert await k.journal() == []  # everything pruned: seqs come from the head
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        oid = tx.outbox_put("alice", "t", b"y")
        await k.commit(tx)
        assert [o[0] for o in await k.outbox("alice")] == [1, 2, 3, oid]
        assert (await k.verify())[0]


async def test_pending_messages_after_reopen_are_the_undelivered_ones(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        seqs = [await journal_one(k, f"t{i}", pending=True) for i in range(6)]
        await journal_one(k, "t9", pending=False)
        tx = k.transaction()
        tx.delivered(seqs[1])
        tx.delivered(seqs[4])
        await k.commit(tx)
        # Journaled and delivered in the same batch (and even the same transaction).
        tx = k.transaction()
        same_tx = tx.journal(thread="tx", direction="in", pending=True)
        tx.delivered(same_tx)
        k.commit(tx)
        tx = k.transaction()
        later = tx.journal(thread="ty", direction="in", pending=True)
        k.commit(tx)
        tx = k.transaction()
        tx.delivered(later)
        await k.commit(tx)
    async with await Kernel.open(state_dir, **backend) as k:
        pending = await k.pending_messages()
        assert [e.seq for e in pending] == [seqs[0], seqs[2], seqs[3], seqs[5]]
        assert all(e.pending and e.payload == b"<m/>" for e in pending)


# -- atomicity -------------------------------------------------------------------------


def install_poison_trigger(state_dir: Path, backend: dict) -> None:
    """A real database failure on demand: inserting an outbox row for client 'poison'."""
    if backend:
        with psycopg.connect(backend["dsn"], autocommit=True) as pg:
            pg.execute("CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ "
                       "BEGIN IF NEW.client = 'poison' THEN "
                       "RAISE EXCEPTION 'poisoned outbox row'; END IF; RETURN NEW; END $$")
            pg.execute("CREATE TRIGGER poison BEFORE INSERT ON outbox FOR EACH ROW "
                       "EXECUTE FUNCTION poison()")
        return
    with db_conn(state_dir) as conn:
        conn.execute("CREATE TRIGGER poison BEFORE INSERT ON outbox WHEN NEW.client = 'poison' "
                     "BEGIN SELECT RAISE(ABORT, 'poisoned outbox row'); END")


async def test_transaction_is_all_or_nothing_and_cannot_poison_its_batch(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend):
        pass
    install_poison_trigger(state_dir, backend)
    commits: list[int] = []
    async with await Kernel.open(state_dir, **backend, commit_interval_s=0.05,
                                 on_commit=lambda s, n: commits.append(n)) as k:
        good_before = k.transaction()
        seq_before = good_before.journal(thread="g1", direction="in", pending=True)
        good_before.thread_put(thread_row("g1"))
        bad = k.transaction()
        bad_seq = bad.journal(thread="bad", direction="in", pending=True)
        bad.thread_put(thread_row("bad"))
        bad.context_append("bad", "user", b"x")
        bad.outbox_put("alice", "bad", b"ok row")
        bad.outbox_put("poison", "bad", b"fails")
        good_after = k.transaction()
        seq_after = good_after.journal(thread="g2", direction="in", pending=True)
        good_after.outbox_put("alice", "g2", b"after")
        futures = [k.commit(tx) for tx in (good_before, bad, good_after)]
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert results[0] is None and results[2] is None
        assert isinstance(results[1], TransactionRejected)
        assert "poisoned outbox row" in str(results[1])
        assert k.healthy
        assert [e.seq for e in await k.pending_messages()] == [seq_before, seq_after]
        assert bad_seq not in [e.seq for e in await k.journal(limit=100)]
        assert await k.thread("bad") is None and await k.thread("g1") is not None
        assert await k.context("bad") == []
        assert [d for _, _, d in await k.outbox("alice")] == [b"after"]
        ok, _bad_at, message = await k.verify()
        assert ok, message
        # The failed transaction's context slot was released from the counters.
        assert "bad" not in k._ctx.ctx_count


# -- hash chain ------------------------------------------------------------------------


async def _journal_some(state_dir: Path, n: int = 5) -> list[int]:
    async with await Kernel.open(state_dir) as k:
        return [await journal_one(k, f"t{i}", payload=f"<m>{i}</m>".encode())
                for i in range(n)]


@pytest.mark.parametrize(
    ("tamper", "bad_index", "words"),
    [
        ("UPDATE journal SET payload_hash = '00' || substr(payload_hash, 3) WHERE seq = {s2}",
         2, "payload does not match"),
        ("UPDATE journal SET payload = X'3c6d3e656e656d793c2f6d3e' WHERE seq = {s2}", 2,
         "payload does not match"),
        ("UPDATE journal SET payload = NULL WHERE seq = {s2}", 2, "payload does not match"),
        ("INSERT INTO inflight SELECT seq, pos FROM journal WHERE seq = {s2}", 2,
         "names no pending journal entry"),
        ("UPDATE journal SET profile = 'admin' WHERE seq = {s2}", 2, "modified"),
        ("UPDATE journal SET handler = 'evil' WHERE seq = {s2}", 2, "modified"),
        ("UPDATE journal SET pending = 1 WHERE seq = {s2}", 2, "modified"),
        ("UPDATE journal SET ts = ts + 1 WHERE seq = {s2}", 2, "modified"),
        ("DELETE FROM journal WHERE seq = {s2}", 3, "missing"),
        ("DELETE FROM journal WHERE seq = {s4}", None, "missing"),
        ("UPDATE journal SET prev_hash = zeroblob(32) WHERE seq = {s2}", 2, "prev_hash"),
        ("INSERT INTO journal_gaps VALUES (3, 3, zeroblob(32), zeroblob(32)); "
         "DELETE FROM journal WHERE seq = {s2}", 3, "does not continue"),
    ],
)
async def test_tampering_with_the_journal_on_disk_is_detected(
        state_dir: Path, tamper: str, bad_index: int | None, words: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    seqs = await _journal_some(state_dir)
    assert verify_journal_main(state_dir) == 0
    with db_conn(state_dir) as conn:
        conn.executescript(tamper.format(s2=seqs[2], s4=seqs[4]))
    async with await Kernel.open(state_dir) as k:
        ok, bad_seq, message = await k.verify()
    assert not ok
    assert bad_seq == (seqs[bad_index] if bad_index is not None else None)
    assert words in message
    capsys.readouterr()
    assert verify_journal_main(state_dir) == 1
    assert "FAILED" in capsys.readouterr().out


async def test_rehashing_a_tampered_entry_breaks_the_next_link(state_dir: Path) -> None:
    seqs = await _journal_some(state_dir)
    from agentd.kernel._chain import encode, link

    with db_conn(state_dir) as conn:
        row = conn.execute("SELECT seq, ts, thread, direction, kind, handler, sender, tag, "
                           "payload_hash, profile, expires, pending, prev_hash FROM journal "
                           "WHERE seq = ?", (seqs[1],)).fetchone()
        forged = list(row)
        forged[5] = "evil"
        new_hash = link(row[12], encode(*forged[:11], bool(forged[11])))
        conn.execute("UPDATE journal SET handler = 'evil', hash = ? WHERE seq = ?",
                     (new_hash, seqs[1]))
    async with await Kernel.open(state_dir) as k:
        ok, bad_seq, message = await k.verify()
    assert (ok, bad_seq) == (False, seqs[2]) and "prev_hash" in message


async def test_verify_journal_runs_beside_a_live_kernel(
        state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with await Kernel.open(state_dir) as k:
        await journal_one(k)
        assert await asyncio.to_thread(verify_journal_main, state_dir) == 0
        assert "journal OK: 1 entries" in capsys.readouterr().out
        await journal_one(k)
    assert verify_journal_main(state_dir) == 0
    assert verify_journal_main(state_dir / "nope") == 1


async def test_fields_are_validated_when_the_transaction_is_built(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        with pytest.raises(ValueError, match="direction"):
            tx.journal(thread="t", direction="sideways")
        with pytest.raises(ValueError, match="U\\+001F"):
            tx.journal(thread="t\x1fx", direction="in")
        with pytest.raises(ValueError, match="state"):
            tx.thread_state("t", "sleeping")
        with pytest.raises(ValueError, match="state"):
            tx.thread_put(thread_row("t", state="zombie"))
        tx.journal(thread="t", direction="audit", kind="reload")
        await k.commit(tx)
        with pytest.raises(RuntimeError, match="already committed"):
            tx.journal(thread="t", direction="in")
        with pytest.raises(RuntimeError, match="already committed"):
            k.commit(tx)
        assert (await k.verify())[0]


# -- retention -------------------------------------------------------------------------


async def test_prune_on_delivery_deletes_delivered_entries_and_keeps_the_chain(
        state_dir: Path) -> None:
    async with await Kernel.open(state_dir, retention=PRUNE_ON_DELIVERY) as k:
        pending = [await journal_one(k, f"p{i}", pending=True) for i in range(6)]
        plain = await journal_one(k, "plain")
        tx = k.transaction()
        for seq in pending[:4]:
            tx.delivered(seq)
        await k.commit(tx)
        report = await k.sweep()
        assert report.journal_deleted == 5  # 4 delivered + 1 never pending
        left = [e.seq for e in await k.journal(limit=100)]
        assert left == pending[4:] and plain not in left
        assert (await k.verify())[0]
        tx = k.transaction()
        tx.delivered(pending[5])
        await k.commit(tx)
        await k.sweep()
        assert [e.seq for e in await k.journal()] == [pending[4]]
        ok, _, message = await k.verify()
        assert ok, message
    with db_conn(state_dir) as conn:  # adjacent gaps were merged around the survivor
        assert conn.execute("SELECT start_pos, end_pos FROM journal_gaps ORDER BY 1"
                            ).fetchall() == [(1, 4), (6, 7)]


async def test_retention_never_deletes_an_undelivered_pending_entry(
        state_dir: Path, clock: FakeClock, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend,
                                 retention=retain_days(1e-9), clock=clock) as k:
        seq = await journal_one(k, pending=True)
        other = await journal_one(k)
        clock.advance(0.01)
        await k.sweep()
        assert [e.seq for e in await k.journal()] == [seq]
        assert [e.seq for e in await k.pending_messages()] == [seq]
        assert other != seq and (await k.verify())[0]


async def test_retain_days_deletes_only_expired_entries(
        state_dir: Path, clock: FakeClock, backend: dict) -> None:
    policy = {"short": retain_days(0.5 / 86400), "*": retain_days(30)}
    async with await Kernel.open(state_dir, **backend, retention=policy, clock=clock) as k:
        short = [await journal_one(k, profile="short") for _ in range(3)]
        long = [await journal_one(k, profile="other") for _ in range(2)]
        clock.advance(0.4)
        assert (await k.sweep()).journal_deleted == 0
        clock.advance(0.2)
        late = await journal_one(k, profile="short")
        assert (await k.sweep()).journal_deleted == 3
        assert [e.seq for e in await k.journal()] == [*long, late]
        assert all(e.expires is not None for e in await k.journal())
        assert short and (await k.verify())[0]


async def test_policies_per_profile_interleave_with_retain_forever(
        state_dir: Path, backend: dict) -> None:
    policy = {"concierge": PRUNE_ON_DELIVERY, "coder": Retention("retain_forever")}
    async with await Kernel.open(state_dir, **backend, retention=policy, sweep_chunk=3) as k:
        kept = []
        for i in range(20):
            if i % 3 == 0:
                kept.append(await journal_one(k, profile="coder"))
            else:
                await journal_one(k, profile="concierge")
        kept.append(await journal_one(k, profile="unlisted"))  # default: forever
        report = await k.sweep()
        assert report.journal_deleted == 13
        assert [e.seq for e in await k.journal(limit=100)] == kept
        ok, _, message = await k.verify()
        assert ok, message
        assert "13" not in message or "gaps" in message


async def test_audit_entries_follow_the_audit_retention(
        state_dir: Path, clock: FakeClock, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, retention=PRUNE_ON_DELIVERY,
                                 audit_retention=retain_days(1e-9), clock=clock) as k:
        tx = k.transaction()
        tx.journal(thread="", direction="security", kind="forged-from", sender="mallory")
        tx.journal(thread="", direction="audit", kind="reload")
        await k.commit(tx)
        assert {e.kind for e in await k.journal(kinds=["forged-from", "reload"])} == {
            "forged-from", "reload"}
        clock.advance(0.01)
        assert (await k.sweep()).journal_deleted == 2
    async with await Kernel.open(state_dir, **backend, retention=PRUNE_ON_DELIVERY) as k:
        tx = k.transaction()
        tx.journal(thread="", direction="security", kind="lockout", sender="mallory")
        await k.commit(tx)
        assert (await k.sweep()).journal_deleted == 0  # audit default: forever


async def test_retention_refuses_an_unknown_mode_and_non_positive_days() -> None:
    # The written forms (`{retain_days: N}`, ...) are parsed by the configuration.
    assert Retention("retain_days", 7) == retain_days(7)
    assert Retention("prune_on_delivery") == PRUNE_ON_DELIVERY
    with pytest.raises(ValueError):
        Retention("keep_some")
    with pytest.raises(ValueError):
        Retention("retain_days", 0)


async def test_journal_query_filters_and_returns_newest_oldest_first(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        for i in range(10):
            await journal_one(k, "a" if i % 2 else "b")
        tx = k.transaction()
        tx.journal(thread="a", direction="audit", kind="oob-command")
        await k.commit(tx)
        newest_a = await k.journal(thread="a", limit=3)
        assert [e.thread for e in newest_a] == ["a"] * 3
        assert [e.seq for e in newest_a] == sorted(e.seq for e in newest_a)
        assert newest_a[-1].kind == "oob-command"
        assert [e.kind for e in await k.journal(kinds=["oob-command"])] == ["oob-command"]
        assert len(await k.journal(limit=4)) == 4


# -- threads, outboxes, context buffers -------------------------------------------------


async def test_thread_rows_survive_reopen_and_states_update(state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        tx.thread_put(thread_row("root"))
        tx.thread_put(thread_row("child", parent="root", profile="restricted"))
        tx.thread_state("child", "completed", hops=4)
        tx.thread_state("ghost", "failed")  # no such thread: no effect
        await k.commit(tx)
        tx = k.transaction()
        tx.thread_state("root", "failed", hops=2)
        await k.commit(tx)
        tx = k.transaction()
        tx.thread_state("root", "active")  # hops unchanged when not given
        await k.commit(tx)
    async with await Kernel.open(state_dir, **backend) as k:
        root, child = await k.thread("root"), await k.thread("child")
        assert root is not None and child is not None
        assert (root.state, root.hops, root.path) == ("active", 2, ("client", "echo"))
        assert (child.state, child.hops, child.parent, child.profile, child.table_version) == (
            "completed", 4, "root", "restricted", 3)
        assert child.updated >= child.created
        assert [t.uuid for t in await k.threads()] == ["root"]
        assert [t.uuid for t in await k.threads("completed")] == ["child"]
        assert {t.uuid for t in await k.threads(None)} == {"root", "child"}
        assert await k.thread("ghost") is None


async def test_finished_threads_are_collected_after_the_ttl(
        state_dir: Path, clock: FakeClock, backend: dict) -> None:
    ttl_hours = 0.5 / 3600
    async with await Kernel.open(state_dir, **backend,
                                 context_ttl_hours=ttl_hours, clock=clock) as k:
        tx = k.transaction()
        tx.thread_put(thread_row("done", "completed", updated=clock.now))
        tx.thread_put(thread_row("broken", "failed", updated=clock.now))
        tx.thread_put(thread_row("alive", "active", updated=clock.now - 3600))
        await k.commit(tx)
        clock.advance(0.4)
        assert (await k.sweep()).threads_deleted == 0
        clock.advance(0.2)
        assert (await k.sweep()).threads_deleted == 2
        assert [t.uuid for t in await k.threads(None)] == ["alive"]


async def test_outbox_reads_in_order_and_delivery_deletes(state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        ids = []
        for i in range(5):
            tx = k.transaction()
            ids.append(tx.outbox_put("alice", f"t{i % 2}", f"<r{i}/>".encode()))
            tx.outbox_put("bob", "tb", f"<b{i}/>".encode())
            k.commit(tx)
        await k.flush()
        assert [row[0] for row in await k.outbox("alice")] == ids
        assert [row[2] for row in await k.outbox("alice", limit=2)] == [b"<r0/>", b"<r1/>"]
        tx = k.transaction()
        tx.outbox_delivered("alice", ids[2])
        await k.commit(tx)
        # Put and delivered in the same batch: the row never shows up.
        tx = k.transaction()
        new = tx.outbox_put("alice", "t9", b"<now/>")
        k.commit(tx)
        tx = k.transaction()
        tx.outbox_delivered("alice", new)
        await k.commit(tx)
        assert await k.outbox("alice") == []
        assert len(await k.outbox("bob")) == 5
    async with await Kernel.open(state_dir, **backend) as k:
        assert await k.outbox("alice") == []
        assert next(row[2] for row in await k.outbox("bob")) == b"<b0/>"


async def test_context_buffer_is_append_only_and_drops_whole(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        tx.context_append("t", "user", b"one")
        tx.context_append("t", "assistant", b"two")
        tx.context_append("u", "user", b"other")
        await k.commit(tx)
        tx = k.transaction()
        tx.context_drop("t")
        tx.context_append("t", "user", b"fresh")
        await k.commit(tx)
        assert await k.context("t") == [(0, "user", b"fresh")]
        assert await k.context("u") == [(0, "user", b"other")]
        tx = k.transaction()
        tx.context_drop("u")
        await k.commit(tx)
        assert await k.context("u") == []


async def test_context_limits_are_enforced_when_building(state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, max_slots_per_thread=3, max_threads=2) as k:
        tx = k.transaction()
        for i in range(3):
            tx.context_append("t", "user", f"{i}".encode())
        with pytest.raises(ContextLimitExceeded, match="max_slots_per_thread=3"):
            tx.context_append("t", "user", b"too many")
        await k.commit(tx)
        tx = k.transaction()
        with pytest.raises(ContextLimitExceeded, match="max_slots_per_thread"):
            tx.context_append("t", "user", b"still too many")
        tx.context_append("u", "user", b"second buffer")
        with pytest.raises(ContextLimitExceeded, match="max_threads=2"):
            tx.context_append("v", "user", b"third buffer")
        await k.commit(tx)
        # Two transactions built against the same counters: the second is refused at
        # commit, before anything is queued.
        a, b = k.transaction(), k.transaction()
        a.context_drop("u")
        a.context_append("w", "user", b"x")
        b.context_append("u", "user", b"y")  # fits now: u exists
        await k.commit(a)
        with pytest.raises(ContextLimitExceeded, match="max_threads"):
            k.commit(b)  # u was dropped by a: b would start a third buffer
    async with await Kernel.open(state_dir, **backend, max_slots_per_thread=3, max_threads=2) as k:
        tx = k.transaction()
        with pytest.raises(ContextLimitExceeded):  # counters are reloaded on open
            tx.context_append("t", "user", b"after reopen")


async def test_idle_context_buffers_are_collected(
        state_dir: Path, clock: FakeClock, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend,
                                 context_ttl_hours=0.3 / 3600, clock=clock) as k:
        tx = k.transaction()
        tx.context_append("idle", "user", b"old")
        await k.commit(tx)
        clock.advance(0.2)
        assert (await k.sweep()).buffers_deleted == 0
        clock.advance(0.15)
        tx = k.transaction()
        tx.context_append("busy", "user", b"new")
        await k.commit(tx)
        assert (await k.sweep()).buffers_deleted == 1
        assert await k.context("idle") == []
        assert await k.context("busy") == [(0, "user", b"new")]


# -- the state directory ---------------------------------------------------------------


async def test_second_kernel_on_same_state_dir_is_refused(state_dir: Path) -> None:
    async with await Kernel.open(state_dir):
        with pytest.raises(StateLocked) as info:
            await Kernel.open(state_dir)
        assert str(state_dir) in str(info.value)
        assert f"process {os.getpid()}" in str(info.value)
    async with await Kernel.open(state_dir):  # released on close
        pass


async def test_state_dir_and_database_are_private(state_dir: Path) -> None:
    async with await Kernel.open(state_dir) as k:
        await journal_one(k)
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((state_dir / DB_NAME).stat().st_mode) == 0o600
        assert k.db_size_bytes() > 0


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
async def test_a_state_dir_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Another user could plant a link in place of the lock or the database, and a root
    daemon would write through it (before: a warning, and the file it named truncated)."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    with pytest.raises(StateDirUnsafe, match="writable by group or others"):
        await Kernel.open(state)
    assert list(state.iterdir()) == []


async def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    state, victim = tmp_path / "state", tmp_path / "victim"
    state.mkdir(mode=0o700)
    victim.write_text("precious")
    (state / "agentd.lock").symlink_to(victim)
    with pytest.raises(StateDirUnsafe, match="symbolic link"):
        await Kernel.open(state)
    assert victim.read_text() == "precious"
    (state / "agentd.lock").unlink()
    os.mkfifo(state / "agentd.lock")
    with pytest.raises(StateDirUnsafe, match="not a regular file"):
        await Kernel.open(state)


async def test_newer_schema_is_refused_with_a_clear_message(state_dir: Path) -> None:
    async with await Kernel.open(state_dir):
        pass
    with db_conn(state_dir) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    with pytest.raises(SchemaTooNew, match="schema version 99 is newer") as info:
        await Kernel.open(state_dir)
    assert str(state_dir) in str(info.value)
    async with await Kernel.open(state_dir.parent / "fresh"):  # the lock was released
        pass
    with db_conn(state_dir) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (_schema.code_version(),))
    async with await Kernel.open(state_dir):
        pass


async def test_foreign_database_is_refused(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o700)
    with db_conn(state_dir) as conn:
        conn.execute("CREATE TABLE something_else (x)")
    with pytest.raises(SchemaTooNew, match="not an agentd database"):
        await Kernel.open(state_dir)


async def test_older_schema_is_migrated(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with await Kernel.open(state_dir) as k:
        seq = await journal_one(k, pending=True)
    current = _schema.code_version()
    monkeypatch.setitem(_schema.MIGRATIONS, current + 1, (
        "CREATE TABLE extra (x INTEGER)", "ALTER TABLE threads ADD COLUMN note TEXT"))
    # The newer code's Store.open, in this process (the monkeypatch does not reach a
    # writer process): exactly what the kernel's writer runs first.
    store = Store.open(state_dir / DB_NAME)
    assert store.migrated_from == current
    store.close()
    assert verify_file(state_dir / DB_NAME).ok
    with db_conn(state_dir) as conn:
        assert conn.execute("SELECT seq FROM inflight").fetchall() == [(seq,)]
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (current + 1,)
        conn.execute("SELECT x FROM extra")
    monkeypatch.delitem(_schema.MIGRATIONS, current + 1)
    with pytest.raises(SchemaTooNew):
        await Kernel.open(state_dir)


def test_threads_of_a_version_6_database_keep_their_rows_and_check(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state_dir.mkdir(mode=0o700)
    later = {v: _schema.MIGRATIONS[v] for v in (7, 8, 9)}
    for version in later:
        monkeypatch.delitem(_schema.MIGRATIONS, version)
    Store.open(state_dir / DB_NAME).close()  # a database as version 6 left it
    with db_conn(state_dir) as conn:
        conn.execute("INSERT INTO threads VALUES ('t1', '[\"c\"]', NULL, 'c', 'public', 1, "
                     "'completed', 1.0, 2.0, 3)")
    for version, statements in later.items():
        monkeypatch.setitem(_schema.MIGRATIONS, version, statements)
    store = Store.open(state_dir / DB_NAME)
    assert store.migrated_from == 6
    store.close()
    insert = ("INSERT OR REPLACE INTO threads (uuid, path, parent, owner, profile, "
              "table_version, state, created, updated, hops) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
    with db_conn(state_dir) as conn:
        assert conn.execute("SELECT * FROM threads").fetchall() == [
            ("t1", '["c"]', None, "c", "public", 1, "completed", 1.0, 2.0, 3, "")]
        assert conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'threads' "
                            "AND type = 'index' AND sql IS NOT NULL").fetchall() == [
            ("threads_finished",)]
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            conn.execute(insert, ("t2", "[]", None, "c", "public", 1, "asleep", 1.0, 1.0, 0))
        # Each row written checks its state without building a temporary table.
        program = [row[1] for row in conn.execute("EXPLAIN " + insert, (None,) * 10)]
        assert "OpenEphemeral" not in program


def test_a_version_8_database_indexes_only_its_finished_threads(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema 9: the threads index holds finished threads only (a thread that starts
    adds no entry to it), and the thread GC finds them through it."""
    state_dir.mkdir(mode=0o700)
    finished = _schema.MIGRATIONS[9]
    monkeypatch.delitem(_schema.MIGRATIONS, 9)
    Store.open(state_dir / DB_NAME).close()  # a database as version 8 left it
    with db_conn(state_dir) as conn:
        conn.executemany("INSERT INTO threads VALUES (?, '[\"c\"]', NULL, 'c', 'public', 1, "
                         "?, 1.0, ?, 0, '')", [("old", "completed", 2.0),
                                               ("late", "failed", 50.0),
                                               ("live", "active", 2.0)])
    monkeypatch.setitem(_schema.MIGRATIONS, 9, finished)
    store = Store.open(state_dir / DB_NAME)
    assert store.migrated_from == 8
    assert store.gc(10.0, []) == (1, 0)  # finished before the cutoff: "old" alone
    store.close()
    with db_conn(state_dir) as conn:
        assert sorted(r[0] for r in conn.execute("SELECT uuid FROM threads")) == [
            "late", "live"]
        assert conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'threads' "
                            "AND type = 'index' AND sql IS NOT NULL").fetchall() == [
            ("threads_finished",)]
        plan = conn.execute("EXPLAIN QUERY PLAN DELETE FROM threads "
                            "WHERE state != 'active' AND updated < 1").fetchall()
        assert "USING INDEX threads_finished" in str(plan)
        # Its entries: the finished threads (read through the index alone).
        assert conn.execute("SELECT count(*) FROM threads INDEXED BY threads_finished "
                            "WHERE state != 'active'").fetchone() == (1,)


# -- failing storage -------------------------------------------------------------------


async def test_disk_full_makes_the_kernel_unavailable_then_it_recovers(
        state_dir: Path) -> None:
    async with await Kernel.open(state_dir) as k:
        acknowledged = [await journal_one(k, pending=True)]
        await k.set_max_db_bytes(k.db_size_bytes() + 64 * 1024)
        refused: list[int] = []
        big = os.urandom(8000)
        for _ in range(200):
            tx = k.transaction()
            seq = tx.journal(thread="t", direction="in", payload=big, pending=True)
            try:
                await k.commit(tx)
            except KernelUnavailable as exc:
                assert not isinstance(exc, TransactionRejected)
                refused.append(seq)
                break
            acknowledged.append(seq)
        assert refused, "the cap was never reached"
        assert not k.healthy and "full" in k.last_error
        with pytest.raises(KernelUnavailable):  # still failing: nothing is acknowledged
            await journal_one(k, payload=big)
        with pytest.raises(KernelUnavailable):  # an empty barrier is no proof of health
            await k.flush()
        assert not k.healthy
        await k.set_max_db_bytes(None)
        await recovers_with_nothing_lost(k, acknowledged)  # the writer probes the disk


async def recovers_with_nothing_lost(k: Kernel, acknowledged: list[int]) -> None:
    """The kernel becomes healthy again by itself (its probe runs with backoff),
    commits again, and every acknowledged entry is still pending."""
    async with asyncio.timeout(10):
        await k.wait_healthy()
    assert k.healthy
    acknowledged.append(await journal_one(k, pending=True))
    assert [e.seq for e in await k.pending_messages()] == acknowledged
    ok, _, message = await k.verify()
    assert ok, message


async def test_a_killed_writer_process_is_replaced_and_nothing_acknowledged_is_lost(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend) as k:
        acknowledged = [await journal_one(k, pending=True) for _ in range(5)]
        first = k.writer_pid
        assert k.writer_restarts == 0
        await k.writer.kill()
        try:  # written by the next writer, or refused if it raced the death: never lost
            acknowledged.append(await journal_one(k, pending=True))
        except KernelUnavailable as exc:
            assert "exited" in str(exc)
        await recovers_with_nothing_lost(k, acknowledged)  # a new writer, by itself
        assert k.writer_pid != first and k.writer_restarts == 1


async def test_delivery_marks_in_flight_with_a_killed_writer_are_written_by_the_next(
        state_dir: Path, backend: dict) -> None:
    """Frames the bus wrote are marked delivered in a coalesced transaction. If the
    writer dies under it, the marks used to be dropped: the rows stayed, and the
    client got every one of those answers a second time at its next connection. The
    next writer sends the dead one's batch again; where the marks' transaction
    fails instead, the outbox keeps them (the next test)."""
    from agentd._daemon import KernelOutbox

    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        ids = [tx.outbox_put("alice", "t", b"<answer/>") for _ in range(3)]
        await k.commit(tx)
        outbox = KernelOutbox(k)
        os.kill(k.writer.pid, signal.SIGSTOP)  # takes the marks, never answers
        for oid in ids:
            outbox.delivered("alice", oid)
        for _ in range(100):  # loop turns until the marks' batch is with the writer
            if k.in_flight:
                break
            await asyncio.sleep(0)
        assert k.in_flight
        await k.writer.kill()  # dies with the marks' transaction in flight
        for _ in range(1000):  # loop turns until the kernel has seen it die
            if not k.healthy:
                break
            await asyncio.sleep(0)
        assert not k.healthy
        async with asyncio.timeout(10):
            await k.wait_healthy()
            await k.flush()
        async with asyncio.timeout(10):  # kept, not dropped: the retry timer writes them
            while await k.outbox("alice"):
                await asyncio.sleep(0.05)


def refuse_outbox_deletes(state_dir: Path, backend: dict, refuse: bool) -> None:
    """A real database failure on demand: while `refuse`, deleting an outbox row fails
    (a trigger, switched by a row of a table of its own)."""
    if backend:
        with psycopg.connect(backend["dsn"], autocommit=True) as pg:
            if refuse:
                pg.execute("CREATE TABLE IF NOT EXISTS refuse_marks (x int)")
                pg.execute("INSERT INTO refuse_marks VALUES (1)")
                pg.execute("CREATE OR REPLACE FUNCTION refuse_marks() RETURNS trigger "
                           "LANGUAGE plpgsql AS $$ BEGIN IF EXISTS (SELECT 1 FROM refuse_marks) "
                           "THEN RAISE EXCEPTION 'marks refused'; END IF; RETURN OLD; END $$")
                pg.execute("CREATE OR REPLACE TRIGGER refuse_marks BEFORE DELETE ON outbox "
                           "FOR EACH ROW EXECUTE FUNCTION refuse_marks()")
            else:
                pg.execute("DELETE FROM refuse_marks")
        return
    with db_conn(state_dir) as conn:
        if refuse:
            conn.execute("CREATE TABLE IF NOT EXISTS refuse_marks (x)")
            conn.execute("INSERT INTO refuse_marks VALUES (1)")
            conn.execute("CREATE TRIGGER IF NOT EXISTS refuse_marks BEFORE DELETE ON outbox "
                         "WHEN EXISTS (SELECT 1 FROM refuse_marks) "
                         "BEGIN SELECT RAISE(ABORT, 'marks refused'); END")
        else:
            conn.execute("DELETE FROM refuse_marks")


async def test_delivery_marks_the_database_refused_are_kept_and_written_later(
        state_dir: Path, backend: dict, caplog: pytest.LogCaptureFixture) -> None:
    """The marks' transaction fails (here the database refuses the deletes; a full
    disk or a failing device alike): the marks are kept and tried again until they
    are written, not dropped (dropped, every frame would reach the client a second
    time at its next connection). A writer killed under the marks does not reach
    this path: the next writer sends the killed one's batch again."""
    from agentd._daemon import KernelOutbox

    async with await Kernel.open(state_dir, **backend) as k:
        tx = k.transaction()
        ids = [tx.outbox_put("alice", "t", b"<answer/>") for _ in range(3)]
        await k.commit(tx)
        refuse_outbox_deletes(state_dir, backend, refuse=True)
        outbox = KernelOutbox(k)
        with caplog.at_level("WARNING", logger="agentd"):
            for oid in ids:
                outbox.delivered("alice", oid)
            async with asyncio.timeout(10):  # the first try fails
                while not any("trying again" in r.getMessage() for r in caplog.records):
                    await asyncio.sleep(0.01)
        assert len(await k.outbox("alice")) == 3
        refuse_outbox_deletes(state_dir, backend, refuse=False)
        async with asyncio.timeout(10):  # kept, not dropped: the retry timer writes them
            while await k.outbox("alice"):
                await asyncio.sleep(0.05)
        ok, _, message = await k.verify()
        assert ok, message


async def until_sent(k: Kernel) -> None:
    """Loop turns until the kernel has handed a batch to its writer."""
    async with asyncio.timeout(10):
        while not k.in_flight:
            await asyncio.sleep(0)


def take_answer_then_kill_writer(k: Kernel) -> None:
    """Without yielding to the event loop: take the writer's answer off the socket
    before the kernel reads it, then SIGKILL the writer (a commit whose answer is
    lost with its writer)."""
    proc = k.writer
    sock = socket.socket(fileno=os.dup(proc._writer.get_extra_info("socket").fileno()))
    try:
        assert select.select([sock], [], [], 10)[0], "the writer never answered"
        assert sock.recv(1 << 20, socket.MSG_DONTWAIT)
    finally:
        sock.close()
    os.kill(proc.pid, signal.SIGKILL)


async def test_a_batch_the_dying_writer_never_wrote_is_written_by_the_next(
        state_dir: Path, backend: dict) -> None:
    """A writer killed with a batch in flight (the OOM killer, say): the batch used to
    fail, and a handler's answer in it reached nobody until the daemon restarted. The
    next writer finds it was never written and writes it; its caller is acknowledged."""
    async with await Kernel.open(state_dir, **backend) as k:
        before = await journal_one(k, pending=True)
        os.kill(k.writer.pid, signal.SIGSTOP)  # takes the batch, never writes it
        tx = k.transaction()
        seq = tx.journal(thread="t1", direction="in", pending=True)
        tx.outbox_put("alice", "t1", b"<answer/>")
        committing = k.commit(tx)
        await until_sent(k)
        await k.writer.kill()
        async with asyncio.timeout(10):
            await committing  # acknowledged: written by the next writer
        assert k.writer_restarts == 1
        assert [e.seq for e in await k.pending_messages()] == [before, seq]
        assert [d for _, _, d in await k.outbox("alice")] == [b"<answer/>"]
        ok, _, message = await k.verify()
        assert ok, message


async def test_a_batch_committed_by_a_writer_that_died_before_answering_is_not_written_twice(
        state_dir: Path) -> None:
    """The writer commits, then dies before its answer reaches the daemon: the next
    writer reads that the batch committed, so its caller is acknowledged and nothing
    is written a second time."""
    async with await Kernel.open(state_dir) as k:
        k.fold = False  # one batch, one answer: the one taken away below
        tx = k.transaction()
        seq = tx.journal(thread="t1", direction="in", pending=True)
        tx.outbox_put("alice", "t1", b"<answer/>")
        committing = k.commit(tx)
        await until_sent(k)
        take_answer_then_kill_writer(k)
        async with asyncio.timeout(10):
            await committing
        assert k.writer_restarts == 1
        assert [e.seq for e in await k.pending_messages()] == [seq]
        assert [d for _, _, d in await k.outbox("alice")] == [b"<answer/>"]
        rows = sqlite3.connect(state_dir / DB_NAME).execute(
            "SELECT count(*) FROM journal WHERE seq = ?", (seq,)).fetchone()
        assert rows == (1,)
        ok, _, message = await k.verify()
        assert ok, message


async def test_delivery_marks_whose_answer_was_lost_are_written_again_harmlessly(
        state_dir: Path, backend: dict) -> None:
    """A commit of deletes and updates only records no number (it costs the head's
    page nothing): when its answer is lost with the writer, it is sent again, which
    changes nothing."""
    async with await Kernel.open(state_dir, **backend) as k:
        k.fold = False
        tx = k.transaction()
        oid = tx.outbox_put("alice", "t1", b"<answer/>")
        await k.commit(tx)
        mark = k.transaction()
        mark.outbox_delivered("alice", oid)
        committing = k.commit(mark)
        await until_sent(k)
        take_answer_then_kill_writer(k)
        async with asyncio.timeout(10):
            await committing
        assert await k.outbox("alice") == []
        ok, _, message = await k.verify()
        assert ok, message


async def test_a_rejected_transaction_of_a_batch_whose_writer_died_stays_rejected(
        state_dir: Path, backend: dict) -> None:
    """Rejections are recorded durably too: a transaction the database refused, in a
    batch whose answer was lost with its writer, fails; its neighbours committed."""
    async with await Kernel.open(state_dir, **backend):
        pass
    install_poison_trigger(state_dir, backend)
    async with await Kernel.open(state_dir, **backend, commit_interval_s=0.05) as k:
        txs = [k.transaction() for _ in range(3)]
        for tx, client in zip(txs, ("alice", "poison", "alice"), strict=True):
            tx.outbox_put(client, "t1", client.encode())
        committing = [k.commit(tx) for tx in txs]  # one batch, after 50 ms
        await until_sent(k)
        take_answer_then_kill_writer(k)
        async with asyncio.timeout(10):
            outcomes = await asyncio.gather(*committing, return_exceptions=True)
        assert outcomes[0] is None and outcomes[2] is None
        assert isinstance(outcomes[1], TransactionRejected)
        assert [d for _, _, d in await k.outbox("alice")] == [b"alice", b"alice"]
        assert k.writer_restarts == 1


async def test_a_writer_that_cannot_start_fails_the_open_clearly_and_frees_the_lock(
        state_dir: Path, monkeypatch: pytest.MonkeyPatch, backend: dict) -> None:
    from agentd.kernel import _writer

    monkeypatch.setattr(_writer, "_CHILD", "import sys; sys.exit(3)")
    with pytest.raises(KernelUnavailable, match=r"kernel writer process \d+ exited \(status 3\)"):
        await Kernel.open(state_dir, **backend)
    monkeypatch.undo()
    async with await Kernel.open(state_dir, **backend) as k:  # nothing left behind: lock released
        await journal_one(k)


async def test_the_writer_process_ignores_sigterm_and_exits_with_its_parent(
        state_dir: Path, backend: dict) -> None:
    """systemd signals the whole control group; the writer must finish what the daemon
    sends it and stop when the daemon closes it, not on its own."""
    async with await Kernel.open(state_dir, **backend) as k:
        os.kill(k.writer.pid, signal.SIGTERM)
        os.kill(k.writer.pid, signal.SIGINT)
        await journal_one(k, pending=True)
        assert k.writer.alive
        pid = k.writer.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_commit_after_close_is_refused(state_dir: Path, backend: dict) -> None:
    k = await Kernel.open(state_dir, **backend)
    tx = k.transaction()
    tx.journal(thread="t", direction="in")
    await k.close()
    with pytest.raises(KernelUnavailable):
        k.commit(tx)
    await k.close()  # idempotent


async def test_two_concurrent_closes_both_wait_for_the_drain(
        state_dir: Path, backend: dict) -> None:
    k = await Kernel.open(state_dir, **backend)
    tx = k.transaction()
    seq = tx.journal(thread="t", direction="in", pending=True)
    committed = k.commit(tx)
    await asyncio.gather(k.close(), k.close())
    assert committed.done() and committed.exception() is None
    async with await Kernel.open(state_dir, **backend) as again:  # lock released once, cleanly
        assert [e.seq for e in await again.pending_messages()] == [seq]


# -- bounded growth --------------------------------------------------------------------


async def test_wal_is_truncated_when_the_writer_is_idle(state_dir: Path) -> None:
    async with await Kernel.open(state_dir, checkpoint_idle_s=0.05) as k:
        for _ in range(50):
            await journal_one(k, payload=os.urandom(2000))
        wal = Path(f"{state_dir / DB_NAME}-wal")
        assert wal.stat().st_size > 0
        async with asyncio.timeout(10):
            await k.wait_settled()
        assert wal.stat().st_size == 0


async def test_database_size_stays_bounded_under_steady_load(
        state_dir: Path, clock: FakeClock) -> None:
    sizes = []
    async with await Kernel.open(state_dir, retention=PRUNE_ON_DELIVERY,
                                 context_ttl_hours=0.01 / 3600, clock=clock) as k:
        for _round in range(8):
            for i in range(150):
                thread = f"r{_round}-{i}"
                tx = k.transaction()
                seq = tx.journal(thread=thread, direction="in", payload=os.urandom(300),
                                 pending=True)
                tx.thread_put(thread_row(thread))
                tx.context_append(thread, "user", os.urandom(300))
                k.commit(tx)
                tx = k.transaction()
                tx.delivered(seq)
                tx.journal(thread=thread, direction="out", payload=os.urandom(300))
                oid = tx.outbox_put("alice", thread, os.urandom(300))
                tx.thread_state(thread, "completed")
                tx.context_drop(thread)
                k.commit(tx)
                tx = k.transaction()
                tx.outbox_delivered("alice", oid)
                k.commit(tx)
            await k.flush()
            clock.advance(0.02)
            await k.sweep()
            assert (await k.checkpoint())[0] == 0
            sizes.append(k.db_size_bytes())
        assert await k.journal() == [] and await k.threads(None) == []
        assert await k.outbox("alice") == [] and await k.pending_messages() == []
        assert (await k.verify())[0]
    with db_conn(state_dir) as conn:
        assert conn.execute("SELECT count(*) FROM journal_gaps").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM context").fetchone() == (0,)
    assert max(sizes[3:]) <= sizes[2] * 1.25, sizes


async def test_checkpoint_never_waits_for_a_reader(state_dir: Path) -> None:
    async with await Kernel.open(state_dir) as k:
        await journal_one(k, payload=os.urandom(4000))
        reader = db_conn(state_dir)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM journal").fetchone()  # holds a snapshot
            await journal_one(k, payload=os.urandom(4000))
            started = time.monotonic()
            busy, _, _ = await k.checkpoint()
            assert busy == 1 and time.monotonic() - started < 0.5
            reader.execute("ROLLBACK")
        finally:
            reader.close()
        assert (await k.checkpoint())[0] == 0


async def test_full_sync_profiles_commit_with_synchronous_full(state_dir: Path) -> None:
    seen: list[int] = []
    async with await Kernel.open(state_dir, full_sync_profiles={"bank"}) as k:
        tx = k.transaction()
        tx.journal(thread="t", direction="in", profile="bank")
        assert tx.full_sync
        await k.commit(tx)
        seen.append(await k._call("pragma", "synchronous"))
        tx = k.transaction()
        tx.journal(thread="t", direction="in", profile="public")
        assert not tx.full_sync
        await k.commit(tx)
    assert seen == [1]  # back to NORMAL after the FULL commit
    async with await Kernel.open(state_dir, synchronous="FULL") as k:
        assert await k._call("pragma", "synchronous") == 2
    with pytest.raises(ValueError, match="synchronous"):
        await Kernel.open(state_dir, synchronous="SOMETIMES")
    async with await Kernel.open(state_dir):  # the failed open released the lock
        pass


async def test_outbox_of_an_absent_client_is_capped_keeping_the_newest(
        state_dir: Path, backend: dict) -> None:
    async with await Kernel.open(state_dir, **backend, max_outbox_per_client=5) as k:
        for i in range(12):
            tx = k.transaction()
            tx.outbox_put("gone", "t", f"<f{i}/>".encode())
            if i < 3:
                tx.outbox_put("present", "t", f"<p{i}/>".encode())
            await k.commit(tx)
        report = await k.sweep()
        assert report.outbox_deleted == 7
        assert [data for _, _, data in await k.outbox("gone")] == [
            f"<f{i}/>".encode() for i in range(7, 12)
        ]
        assert len(await k.outbox("present")) == 3
