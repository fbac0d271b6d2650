"""Journal benchmark: raw sqlite3 executemany vs the kernel's append path.

    python benchmarks/journal.py [--quick]

Baseline: stdlib sqlite3, WAL, synchronous=NORMAL, `executemany` of fully built
journal rows (hashes precomputed, not timed) into the kernel's own journal table, one
transaction per `BATCH` rows. Kernel: `PRODUCERS` asyncio tasks each building and
committing one-entry transactions (the same row: the kernel hashes the payload,
encodes and chains the entry, batches, commits and resolves a future per
transaction), each keeping up to `WINDOW` commits in flight and awaiting the oldest
(as the pump does while it waits to send `accepted`). A second kernel run journals
the entries `pending` (crash-recoverable ingress: one more row, in `inflight`).
Commit latency is commit() -> future resolved, sampled on every 8th commit.

Baseline and kernel runs alternate, `ROUNDS` times; the ratio is the median of the
per-round ratios, so a machine whose speed drifts (shared CI boxes) skews it less.
The postgres arm (`postgres` in the JSON; see _postgres.py for where its server comes
from, and its "skipped" reason when there is none): the pump's workload over the
kernel on PostgreSQL and on SQLite, alternately, pairs/s and the p50 of a pair under
that load, and this benchmark's kernel run on each; the round trips to PostgreSQL
per committed batch, counted in libpq's trace. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentd._runtime import tune_gc
from agentd.kernel import Kernel
from agentd.kernel._chain import GENESIS, encode, link
from agentd.kernel._schema import migrate
from agentd.kernel._store import INSERT_JOURNAL

BATCH = 512
PRODUCERS = 50
WINDOW = 8
SAMPLE = 8  # latency measured on every 8th commit (the callback is not free)
PAYLOAD = (
    b'<greeting xmlns="https://example.org/ns/hello/v1"><name>'
    + b"Ada Lovelace, Countess of Lovelace " * 5
    + b"</name><lang>en</lang></greeting>"
)
TAG = "{https://example.org/ns/hello/v1}greeting"
THREADS = [f"7f1c6a52-3d1e-4b7a-9c1f-{i:012d}" for i in range(500)]


def baseline_rows_per_s(n: int, directory: Path) -> float:
    db = directory / "baseline.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    migrate(conn, db)
    rows = []
    prev = GENESIS
    payload_hash = hashlib.sha256(PAYLOAD).hexdigest()
    now = time.time()
    for i in range(1, n + 1):
        thread = THREADS[i % len(THREADS)]
        enc = encode(i, now, thread, "in", "message", "greeter", "alice", TAG, payload_hash,
                     "public", None, True)
        h = link(prev, enc)
        rows.append((i, now, thread, "in", "message", "greeter", "alice", TAG, payload_hash,
                     PAYLOAD, "public", None, 1, i, prev, h))
        prev = h
    t0 = time.perf_counter()
    for k in range(0, n, BATCH):
        conn.execute("BEGIN")
        conn.executemany(INSERT_JOURNAL, rows[k:k + BATCH])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    conn.close()
    return n / elapsed


async def kernel_run(n: int, directory: Path, pending: bool = False, dsn: str | None = None
                     ) -> tuple[float, list[float]]:
    kernel = await Kernel.open(directory / "kernel", commit_max_entries=BATCH, dsn=dsn,
                               lease="journal-bench" if dsn else None)
    latencies: list[float] = []
    per_producer = n // PRODUCERS
    perf = time.perf_counter

    async def producer(p: int) -> None:
        inflight: deque[asyncio.Future[None]] = deque()
        thread = THREADS[p % len(THREADS)]
        for i in range(per_producer):
            tx = kernel.transaction()
            tx.journal(thread=thread, direction="in", handler="greeter", sender="alice",
                       tag=TAG, payload=PAYLOAD, profile="public", pending=pending)
            if i % SAMPLE == 0:
                t0 = perf()
                fut = kernel.commit(tx)
                fut.add_done_callback(lambda _f, t0=t0: latencies.append(perf() - t0))
            else:
                fut = kernel.commit(tx)
            inflight.append(fut)
            if len(inflight) >= WINDOW:
                await inflight.popleft()
        while inflight:
            await inflight.popleft()

    t0 = time.perf_counter()
    await asyncio.gather(*(producer(p) for p in range(PRODUCERS)))
    elapsed = time.perf_counter() - t0
    ok, _, message = await kernel.verify()
    await kernel.close()
    if not ok:
        raise SystemExit(f"journal does not verify after the run: {message}")
    return per_producer * PRODUCERS / elapsed, latencies


def pump_journal_ratio(quick: bool) -> float | None:
    """The pump benchmark's workload (benchmarks/pump.py: a request to a tool that
    replies, each on its own thread, 256 concurrent clients) with the journal on,
    over the journal off, measured alternately in this process; the median of the
    per-round ratios (this box's speed drifts by tens of percent within seconds)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import pump as pump_bench

    n = 3000 if quick else 20000
    data = pump_bench.envelopes(n)
    asyncio.run(pump_bench.real_pump(data))  # warm-up (imports, schema caches)
    ratios: list[float] = []
    on_rates: list[float] = []
    off_rates: list[float] = []
    for _ in range(7 if quick else 5):
        off = asyncio.run(pump_bench.real_pump(data))[0]
        with tempfile.TemporaryDirectory(prefix="agentd-bench-") as tmp:
            on = asyncio.run(pump_bench.real_pump(data, Path(tmp)))[0]
        off_rates.append(off)
        on_rates.append(on)
        ratios.append(on / off)
    print(f"pump with journal: {statistics.median(on_rates):,.0f}/s; without: "
          f"{statistics.median(off_rates):,.0f}/s (medians); per-round ratios "
          + " ".join(f"{r:.2f}" for r in ratios))
    return statistics.median(ratios)


def postgres_arm(quick: bool) -> dict[str, Any]:
    """The kernel on PostgreSQL beside the kernel on SQLite, alternately in this run:
    the pump's workload with the journal on (pairs/s, p50 of a pair under load) and
    this benchmark's kernel run (entries/s), plus the round trips per committed batch
    (see _postgres.py). Skipped, and said so, without a server."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _postgres as postgres
    import pump as pump_bench

    with postgres.database() as dsn:
        if dsn is None:
            print(f"postgres arm skipped: {postgres.skipped()}")
            return {"skipped": postgres.skipped()}
        trips = postgres.round_trips_per_batch(dsn)
        data = pump_bench.envelopes(2000 if quick else 10000)
        n = 10_000 if quick else 50_000
        arms: dict[str, dict[str, list[float]]] = {
            b: {"pairs": [], "p50": [], "entries": []} for b in ("sqlite", "postgres")}
        for r in range(3 if quick else 5):
            for backend in ("sqlite", "postgres") if r % 2 == 0 else ("postgres", "sqlite"):
                with tempfile.TemporaryDirectory(prefix="agentd-bench-") as tmp:
                    on = dsn if backend == "postgres" else None
                    rate, lat = asyncio.run(pump_bench.real_pump(data, Path(tmp), dsn=on))
                    if on:  # each run its own tables
                        _drop_tables(on)
                    entries, _ = asyncio.run(_kernel_run_on(n, Path(tmp) / "k", on))
                    if on:
                        _drop_tables(on)
                arms[backend]["pairs"].append(rate)
                arms[backend]["p50"].append(statistics.median(lat) * 1e3)
                arms[backend]["entries"].append(entries)
            print(f"round {r}: " + ", ".join(
                f"{b} {a['pairs'][-1]:,.0f} pairs/s p50 {a['p50'][-1]:.1f} ms, "
                f"{a['entries'][-1]:,.0f} entries/s" for b, a in arms.items()))
    ratio = statistics.median(p / s for p, s in zip(arms["postgres"]["pairs"],
                                                      arms["sqlite"]["pairs"], strict=True))
    med = {b: {k: statistics.median(v) for k, v in a.items()} for b, a in arms.items()}
    print(f"pump over the kernel: postgres {med['postgres']['pairs']:,.0f} pairs/s "
          f"(p50 {med['postgres']['p50']:.1f} ms), sqlite {med['sqlite']['pairs']:,.0f} "
          f"pairs/s (p50 {med['sqlite']['p50']:.1f} ms); ratio {ratio:.2f} (target >= 0.5); "
          f"{trips:g} round trips per committed batch")
    return {
        "pairs_per_s": round(med["postgres"]["pairs"]),
        "sqlite_pairs_per_s": round(med["sqlite"]["pairs"]),
        "pairs_ratio": round(ratio, 3),
        "p50_ms": round(med["postgres"]["p50"], 2),
        "sqlite_p50_ms": round(med["sqlite"]["p50"], 2),
        "journal_per_s": round(med["postgres"]["entries"]),
        "sqlite_journal_per_s": round(med["sqlite"]["entries"]),
        "round_trips_per_batch": trips,
    }


async def _kernel_run_on(n: int, directory: Path, dsn: str | None) -> tuple[float, list[float]]:
    return await kernel_run(n, directory, dsn=dsn)


def _drop_tables(dsn: str) -> None:
    """A fresh schema for the next run (its journal starts at the genesis again)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if values else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes (a few seconds)")
    args = parser.parse_args()
    tune_gc()  # the daemon's process tuning (agentd/_runtime.py), for both arms
    n = 30_000 if args.quick else 200_000
    rounds = 3 if args.quick else 5
    baselines, kernels, pendings, ratios, latencies = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="agentd-journal-bench-") as tmp:
        for r in range(rounds):
            directory = Path(tmp) / f"round{r}"
            directory.mkdir()
            baseline = baseline_rows_per_s(n, directory)
            rate, lat = asyncio.run(kernel_run(n, directory / "plain"))
            pending_rate, _ = asyncio.run(kernel_run(n, directory / "pending", pending=True))
            baselines.append(baseline)
            kernels.append(rate)
            pendings.append(pending_rate)
            ratios.append(rate / baseline)
            latencies.extend(lat)
            print(f"round {r}: baseline {baseline:,.0f} rows/s, kernel {rate:,.0f} entries/s "
                  f"({rate / baseline:.2f}), kernel pending {pending_rate:,.0f} entries/s")
    baseline = statistics.median(baselines)
    journal = statistics.median(kernels)
    pending = statistics.median(pendings)
    ratio = statistics.median(ratios)
    p50 = percentile(latencies, 50) * 1e3
    p99 = percentile(latencies, 99) * 1e3
    print(f"baseline  sqlite3 executemany (WAL/NORMAL, {BATCH}/txn): {baseline:,.0f} rows/s")
    print(f"kernel    {PRODUCERS} producers x {WINDOW} in flight, 1-entry txs: "
          f"{journal:,.0f} entries/s")
    print(f"kernel    same, entries pending (ingress):             {pending:,.0f} entries/s")
    print(f"ratio     {ratio:.2f} (median of rounds; target >= 0.50, and >= 30,000 entries/s)")
    print(f"commit latency p50 {p50:.2f} ms, p99 {p99:.2f} ms ({len(latencies)} samples)")
    print(json.dumps({
        "baseline_rows_per_s": round(baseline),
        "journal_per_s": round(journal),
        "ratio": round(ratio, 3),
        "commit_p50_ms": round(p50, 3),
        "commit_p99_ms": round(p99, 3),
        "pump_journal_ratio": pump_journal_ratio(args.quick),
        "journal_pending_per_s": round(pending),
        "postgres": postgres_arm(args.quick),
    }))


if __name__ == "__main__":
    main()
