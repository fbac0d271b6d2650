"""Property tests: a batch's folded statements equal its operations applied one by one,
and retention in any pattern keeps the hash chain verifiable."""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agentd.kernel import (
    PRUNE_ON_DELIVERY,
    RETAIN_FOREVER,
    Kernel,
    Retention,
    ThreadRow,
    Transaction,
    retain_days,
)
from agentd.kernel._chain import GENESIS, Gap, encode, link, verify_chain
from agentd.kernel._store import Store, verify_file
from agentd.kernel._transaction import TxContext, plan_batch

UUIDS = ["a", "b"]
STATES = ["active", "completed", "failed"]
CLIENTS = ["x", "y"]

op = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(UUIDS), st.sampled_from(STATES),
              st.integers(0, 9)),
    st.tuples(st.just("state"), st.sampled_from(UUIDS), st.sampled_from(STATES),
              st.none() | st.integers(0, 9)),
    st.tuples(st.just("oput"), st.sampled_from(CLIENTS), st.sampled_from(UUIDS)),
    st.tuples(st.just("odlv"), st.sampled_from(CLIENTS), st.integers(0, 30)),
    st.tuples(st.just("osent"), st.sampled_from(CLIENTS), st.lists(st.integers(0, 30),
                                                                   max_size=3)),
    st.tuples(st.just("capp"), st.sampled_from(UUIDS), st.binary(max_size=3)),
    st.tuples(st.just("cdrop"), st.sampled_from(UUIDS)),
    st.tuples(st.just("journal"), st.booleans()),
    st.tuples(st.just("dlv"), st.integers(0, 30)),
)
# A program: transactions (lists of ops), each followed by `cut` (submit; the next
# transaction may share its batch) or `flush` (submit and wait: a batch boundary).
program_st = st.lists(
    st.tuples(st.lists(op, max_size=8), st.sampled_from(["cut", "flush"])), max_size=10
).map(lambda txs: [step for ops, end in txs for step in [*ops, (end,)]])


class Model:
    """The database as if every operation were applied alone, in order."""

    def __init__(self) -> None:
        self.threads: dict[str, tuple[str, int]] = {}
        self.outbox: dict[int, tuple[str, str, bytes]] = {}
        self.context: dict[str, list[bytes]] = {}
        self.inflight: set[int] = set()
        self.journal: list[int] = []
        self.seqs: list[int] = []
        self.ids: list[int] = []


async def run_program(program: list[tuple[Any, ...]], directory: Path) -> None:
    model = Model()
    async with await Kernel.open(directory, commit_interval_s=0.001) as kernel:
        tx = kernel.transaction()
        for step in program:
            kind = step[0]
            if kind == "put":
                _, uuid, state, hops = step
                now = time.time()
                tx.thread_put(ThreadRow(uuid, ("p",), None, "o", "public", 1, state, now, now,
                                        hops))
                model.threads[uuid] = (state, hops)
            elif kind == "state":
                _, uuid, state, hops = step
                tx.thread_state(uuid, state, hops)
                if uuid in model.threads:
                    old = model.threads[uuid][1]
                    model.threads[uuid] = (state, old if hops is None else hops)
            elif kind == "oput":
                _, client, thread = step
                data = f"{client}{len(model.ids)}".encode()
                oid = tx.outbox_put(client, thread, data)
                model.ids.append(oid)
                model.outbox[oid] = (client, thread, data)
            elif kind == "odlv":
                _, client, k = step
                up_to = model.ids[k % len(model.ids)] if model.ids else 0
                tx.outbox_delivered(client, up_to)
                for oid in [i for i, v in model.outbox.items() if v[0] == client and i <= up_to]:
                    del model.outbox[oid]
            elif kind == "osent":  # these ids only (another client's ids are untouched)
                _, client, picks = step
                ids = [model.ids[k % len(model.ids)] for k in picks] if model.ids else []
                tx.outbox_sent(client, ids)
                for oid in ids:
                    if model.outbox.get(oid, ("",))[0] == client:
                        del model.outbox[oid]
            elif kind == "capp":
                _, thread, content = step
                tx.context_append(thread, "user", content)
                model.context.setdefault(thread, []).append(content)
            elif kind == "cdrop":
                tx.context_drop(step[1])
                model.context.pop(step[1], None)
            elif kind == "journal":
                seq = tx.journal(thread="j", direction="in", pending=step[1])
                model.seqs.append(seq)
                model.journal.append(seq)
                if step[1]:
                    model.inflight.add(seq)
            elif kind == "dlv":
                seq = model.seqs[step[1] % len(model.seqs)] if model.seqs else 0
                tx.delivered(seq)
                model.inflight.discard(seq)
            if kind in ("cut", "flush"):
                kernel.commit(tx)
                tx = kernel.transaction()
                if kind == "flush":
                    await kernel.flush()
        kernel.commit(tx)
        await kernel.flush()

        threads = {t.uuid: (t.state, t.hops) for t in await kernel.threads(None)}
        assert threads == model.threads
        for client in CLIENTS:
            expected = [(i, v[1], v[2]) for i, v in sorted(model.outbox.items())
                        if v[0] == client]
            assert await kernel.outbox(client) == expected
        for thread in UUIDS:
            got = [content for _, _, content in await kernel.context(thread)]
            assert got == model.context.get(thread, [])
        assert [e.seq for e in await kernel.pending_messages()] == sorted(model.inflight)
        assert [e.seq for e in await kernel.journal(limit=1000)] == model.journal
        ok, _, message = await kernel.verify()
        assert ok, message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program_st)
# Folding traps, kept as fixed examples: a delivery cancelling a put of the same batch,
# and a second state update without hops over a first one with hops.
@example([("oput", "x", "a"), ("odlv", "x", 0), ("cut",)])
@example([("oput", "x", "a"), ("oput", "x", "b"), ("flush",), ("osent", "x", [1]), ("cut",)])
@example([("put", "a", "active", 1), ("flush",), ("state", "a", "failed", 5),
          ("state", "a", "active", None), ("cut",)])
@example([("capp", "a", b"1"), ("cdrop", "a"), ("capp", "a", b"2"), ("journal", True),
          ("dlv", 0), ("put", "b", "active", 1), ("state", "b", "completed", None), ("cut",)])
def test_batched_operations_equal_operations_applied_one_by_one(
        program: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run_program(program, Path(tmp) / "state"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=60),
    st.integers(1, 7),
    st.integers(1, 4),
)
def test_any_retention_pattern_keeps_the_chain_verifiable(
        entries: list[tuple[bool, bool, bool]], chunk: int, sweeps: int) -> None:
    """entries: (pruned profile?, pending?, delivered?) per journal entry."""

    async def scenario(directory: Path) -> None:
        policy = {"prune": PRUNE_ON_DELIVERY, "keep": RETAIN_FOREVER}
        async with await Kernel.open(directory, retention=policy, sweep_chunk=chunk) as k:
            seqs = []
            for i, (prune, pending, _) in enumerate(entries):
                tx = k.transaction()
                seqs.append(tx.journal(thread=f"t{i}", direction="in", pending=pending,
                                       profile="prune" if prune else "keep"))
                k.commit(tx)
                if i % max(1, len(entries) // sweeps) == 0:
                    await k.flush()
                    await k.sweep()
                    assert (await k.verify())[0]
            tx = k.transaction()
            for seq, (_, pending, delivered) in zip(seqs, entries, strict=True):
                if pending and delivered:
                    tx.delivered(seq)
            await k.commit(tx)
            await k.sweep()
            ok, _, message = await k.verify()
            assert ok, message
            survivors = [e.seq for e in await k.journal(limit=1000)]
            expected = [s for s, (prune, pending, delivered) in zip(seqs, entries, strict=True)
                        if not prune or (pending and not delivered)]
            assert survivors == expected

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp) / "state"))


def _chain(n: int) -> list[tuple[Any, ...]]:
    rows, prev = [], GENESIS
    for pos in range(1, n + 1):
        payload = f"<m>{pos}</m>".encode()  # the writer always stores the payload's bytes
        fields = (pos, 1.5 + pos, "t", "in", "message", "h", "s", "{u}t",
                  hashlib.sha256(payload).hexdigest(), "p", None, False)
        h = link(prev, encode(*fields))
        rows.append((pos, pos, *fields[1:9], payload, "p", None, 0, prev, h))
        prev = h
    return rows


def test_chain_verifier_accepts_gaps_that_continue_the_chain() -> None:
    rows = _chain(6)
    assert verify_chain(rows, [], 6, rows[-1][15]).ok
    gap = Gap(2, 4, rows[1][14], rows[3][15])
    kept = [rows[0], rows[4], rows[5]]
    assert verify_chain(kept, [gap], 6, rows[-1][15]).ok
    tail_gap = Gap(5, 6, rows[4][14], rows[5][15])
    assert verify_chain(rows[:4], [tail_gap], 6, rows[-1][15]).ok
    assert verify_chain([], [Gap(1, 6, GENESIS, rows[5][15])], 6, rows[-1][15]).ok
    assert verify_chain([], [], 0, GENESIS).ok


def test_chain_verifier_rejects_overlaps_and_holes() -> None:
    rows = _chain(6)
    head = rows[-1][15]
    overlapping = Gap(2, 5, rows[1][14], rows[4][15])
    verdict = verify_chain([rows[0], rows[4], rows[5]], [overlapping], 6, head)
    assert not verdict.ok and verdict.bad_seq == 5 and "overlaps" in verdict.message
    verdict = verify_chain([rows[0], rows[1], rows[5]], [], 6, head)
    assert not verdict.ok and verdict.bad_seq == 6 and "missing" in verdict.message
    verdict = verify_chain(rows[:5], [], 6, head)
    assert not verdict.ok and verdict.bad_seq is None and "head" in verdict.message


text = st.text(st.characters(blacklist_characters="\x1f", blacklist_categories=("Cs",)),
               max_size=12)


@given(thread=text, kind=text, handler=text, sender=text, tag=text, profile=text,
       payload=st.binary(max_size=40), pending=st.booleans(),
       direction=st.sampled_from(["in", "out", "audit", "security"]),
       policy=st.sampled_from([RETAIN_FOREVER, PRUNE_ON_DELIVERY, retain_days(2.5)]))
def test_entries_written_by_the_writer_verify_whatever_their_fields(
        thread: str, kind: str, handler: str, sender: str, tag: str, profile: str,
        payload: bytes, pending: bool, direction: str, policy: Retention) -> None:
    """The writer encodes and chains each entry from its fields; the verifier
    re-encodes them from the stored columns (ts and expires went through REAL).
    They must agree for any field values the builder accepts."""
    ctx = TxContext(next_seq=41, next_outbox_id=1, retention=policy, audit_retention=policy)
    txs = []
    for _ in range(2):  # the second entry is chained on the first
        tx = Transaction(ctx)
        tx.journal(thread=thread, direction=direction, kind=kind, handler=handler,
                   sender=sender, tag=tag, payload=payload, profile=profile, pending=pending)
        ts = tx.rows[0][1]
        assert round(ts * 1_000_000) / 1_000_000 == ts  # whole microseconds survive REAL
        txs.append(tx)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(Path(tmp) / "j.db")
        try:
            for tx in txs:
                store.write(plan_batch([tx.wire()]))
        finally:
            store.close()
        verdict = verify_file(Path(tmp) / "j.db")
    assert verdict.ok, verdict.message
