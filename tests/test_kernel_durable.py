"""The kernel's durable waits on real SQLite and PostgreSQL (`backend`): timers,
handler state and parked approvals commit with the transaction that carries them, or not at all."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agentd.kernel import ApprovalRow, Kernel, TimerRow, TransactionRejected


def timer(tid: str, due: float = 100.0, conversation: str = "c1") -> TimerRow:
    return TimerRow(tid, conversation, "f-" + tid, "clock", due, "note " + tid, 1, time.time())


def approval(aid: str) -> ApprovalRow:
    return ApprovalRow(aid, "c1", "c1", "alice", "payments", "alice", 0, b"<env/>",
                       b"<pay/>", "ab" * 32, ("operator", "client"), 1.0, 2.0)


async def test_timers_state_and_approvals_round_trip(tmp_path: Path, backend: dict) -> None:
    async with await Kernel.open(tmp_path / "s", **backend) as k:
        tx = k.transaction()
        tx.timer_put(timer("t2", 200.0))
        tx.timer_put(timer("t1", 100.0))
        tx.state_put("counter", "c1", "n", "1")
        tx.state_put("counter", "c2", "n", "7")
        tx.approval_put(approval("a1"))
        await k.commit(tx)
        assert [t.id for t in await k.timers()] == ["t1", "t2"]
        assert await k.handler_state() == [("counter", "c1", "n", "1"),
                                           ("counter", "c2", "n", "7")]
        (row,) = await k.approvals()
        assert row == approval("a1")
        tx = k.transaction()
        tx.timer_delete("t1")
        tx.state_delete("counter", "c1", "n")
        tx.state_drop("c2")
        tx.approval_decide("a1", "approved", "operator:ops-1", "ok", 3.0)
        await k.commit(tx)
        assert [t.id for t in await k.timers()] == ["t2"]
        assert await k.handler_state() == []
        assert await k.approvals() == []
        (decided,) = await k.approvals(state=None)
        assert (decided.state, decided.decided_by, decided.reason) == (
            "approved", "operator:ops-1", "ok")


async def test_a_second_decision_changes_nothing(tmp_path: Path, backend: dict) -> None:
    async with await Kernel.open(tmp_path / "s", **backend) as k:
        tx = k.transaction()
        tx.approval_put(approval("a1"))
        tx.approval_decide("a1", "denied", "alice", "", 3.0)
        tx.approval_decide("a1", "approved", "mallory", "", 4.0)
        await k.commit(tx)
        (row,) = await k.approvals(state=None)
        assert (row.state, row.decided_by) == ("denied", "alice")


async def test_a_rejected_transaction_writes_no_timer(tmp_path: Path, backend: dict) -> None:
    async with await Kernel.open(tmp_path / "s", **backend) as k:
        tx = k.transaction()
        tx.approval_put(approval("a1"))
        await k.commit(tx)
        bad = k.transaction()
        bad.timer_put(timer("t1"))
        bad.state_put("counter", "c1", "n", "1")
        bad.approval_put(approval("a1"))  # duplicate id: the whole transaction fails
        with pytest.raises(TransactionRejected):
            await k.commit(bad)
        assert await k.timers() == []
        assert await k.handler_state() == []


def test_decided_state_must_be_final(tmp_path: Path) -> None:
    from agentd.kernel._transaction import Transaction, TxContext

    tx = Transaction(TxContext(next_seq=1, next_outbox_id=1))
    with pytest.raises(ValueError):
        tx.approval_decide("a1", "pending", "x", "", 1.0)


async def test_decided_approvals_are_collected_with_old_threads(
        tmp_path: Path, backend: dict) -> None:
    now = time.time()
    async with await Kernel.open(tmp_path / "s", **backend, clock=lambda: now + 10 * 86400) as k:
        tx = k.transaction()
        tx.approval_put(approval("old"))
        tx.approval_decide("old", "denied", "ops", "", now)
        tx.approval_put(approval("waiting"))
        await k.commit(tx)
        await k.sweep()
        assert [a.id for a in await k.approvals(state=None)] == ["waiting"]
