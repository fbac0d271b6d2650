"""Streamed previews end to end: how soon a client sees a model's first words.

A real `agentd run` process whose agent's model is a loopback server streaming the
OpenAI wire protocol: the first piece of text 200 ms after the request, then one
every 20 ms (12 pieces). A client (`agentd.client`, on the same machine) asks each
question with `Client.stream` and notes when its first `partial` arrives. Reported:
the time from the backend writing its first piece to the client reading its first
partial (median, p90, max, in ms: TLS, the daemon's SSE parsing, the preview's
frame and the bus), the client's gaps between partials (p50, p99, in ms; the
backend's gap is 20 ms), and partials per answer (fewer than 12 when coalesced).
Then C conversations at once on one connection (1,000; 100 with --quick): the
daemon's peak RSS, each conversation's p99 gap between partials (its median and
worst over the conversations), and how long the last answer took. Last, a client
that reads nothing: it asks 20 questions whose answers stream for about 10 s each
(100 KB of text; 3 s with --quick) and reads nothing for 10 s (3 s); reported: the
daemon's RSS growth at its peak meanwhile, and the bound it must stay under (the
connection's send queue, 4 MiB, plus per stream its 256 KiB resume buffer and the
text waiting to be joined), then whether every answer still arrived once it reads.

Usage: python benchmarks/stream.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _process import rss_kb as rss_kib  # noqa: E402

from agentd.client import Answer, BusClient, Client, Partial, frame_kind  # noqa: E402
from agentd.platform.demo import MathQuestion  # noqa: E402
from tests.daemon_process import DaemonProcess, edit_config, make_home  # noqa: E402
from tests.llm_servers import FakeLLM, Reply  # noqa: E402

FIRST_S, GAP_S, PIECES = 0.2, 0.02, 12
IDLE = {"on": False, "pieces": 1000, "gap_s": 0.01}  # the non-reading client's answers
IDLE_PIECE = "x" * 99 + " "
SEND_QUEUE_BYTES = 4 * 1024 * 1024  # the bus's per-connection send queue
RESUME_BUFFER_BYTES = 256 * 1024


def reply(_seen: Any) -> Reply:
    if IDLE["on"]:
        return Reply(pieces=[IDLE_PIECE] * int(IDLE["pieces"]), gap_s=float(IDLE["gap_s"]))
    return Reply(pieces=[f"word{i} " for i in range(PIECES)], first_s=FIRST_S, gap_s=GAP_S)


async def not_reading(d: DaemonProcess, session: str, seconds: float, n: int = 20
                      ) -> dict[str, Any]:
    """A client that asks `n` streamed questions and reads nothing for `seconds`
    (its library buffers a few frames, then its socket fills and stays full)."""
    pid = d.proc.pid if d.proc is not None else 0
    IDLE.update(on=True, pieces=int(seconds / 0.01))
    text_bytes = int(IDLE["pieces"]) * len(IDLE_PIECE)
    bus = BusClient(d.url, "alice", session=session, cafile=d.cafile, stream=True)
    await bus.connect()
    before = rss_kib(pid)
    peak = before
    threads = [await bus.send(MathQuestion(text=f"Idle {i}?")) for i in range(n)]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.05)
    answered: set[str] = set()
    closed = None
    try:
        async with asyncio.timeout(120):
            while len(answered) < n:
                sender, kind, thread = frame_kind(await bus.recv())
                if sender == "tutor" or kind == "answer":
                    answered.add(thread)
    except Exception as exc:  # the daemon closed it (send queue overflow): reported
        closed = f"{type(exc).__name__}: {exc}"
    await bus.close()
    IDLE["on"] = False
    bound = SEND_QUEUE_BYTES + n * (RESUME_BUFFER_BYTES + text_bytes)
    return {
        "idle_client_s": seconds,
        "idle_client_streams": n,
        "idle_client_text_per_stream_kb": round(text_bytes / 1000, 1),
        "idle_client_rss_growth_mb": round((peak - before) / 1024, 1),
        "idle_client_bound_mb": round(bound / 2**20, 1),
        "idle_client_answers_after": len(answered & set(threads)),
        "idle_client_closed": closed,
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def at_once(c: Client, d: DaemonProcess, n: int) -> dict[str, Any]:
    """`n` streamed conversations at once on one connection."""
    pid = d.proc.pid if d.proc is not None else 0
    peak = 0

    async def one(i: int) -> list[float]:
        seen: list[float] = []
        async for event in c.stream(MathQuestion(text=f"Many {i}?"), timeout=600):
            if isinstance(event, Partial):
                seen.append(time.monotonic())
        return [(b - a) * 1000 for a, b in pairwise(seen)]

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_kib(pid))
            await asyncio.sleep(0.1)

    before = rss_kib(pid)
    watcher = asyncio.create_task(watch())
    start = time.monotonic()
    gaps = await asyncio.gather(*(one(i) for i in range(n)))
    took = time.monotonic() - start
    watcher.cancel()
    p99s = [pct(g, 0.99) for g in gaps if g]
    return {
        "concurrent": n,
        "concurrent_done_s": round(took, 2),
        "daemon_rss_mb_before": round(before / 1024, 1),
        "daemon_rss_mb_peak": round(max(peak, before) / 1024, 1),
        "concurrent_p99_gap_ms_median": round(statistics.median(p99s), 1),
        "concurrent_p99_gap_ms_worst": round(max(p99s), 1),
    }


async def run(n: int, many: int, idle_s: float) -> dict[str, Any]:
    firsts: list[float] = []
    gaps: list[float] = []
    counts: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        make_home(home)
        async with FakeLLM("openai", reply) as server:
            def edit(doc: dict[str, Any]) -> None:
                doc["pump"]["max_concurrency"] = 2 * many  # every conversation at once
                doc["bus"].update(rate_per_s=100_000.0, rate_burst=100_000)
                doc["llm"]["retries"] = 0
                doc["llm"]["backends"] = [{"name": "tutor-model", "provider": "openai",
                                           "base_url": server.base_url, "model": "fake-1"}]

            edit_config(home, edit)
            d = await DaemonProcess(home).start()
            try:
                async with Client.connect(d.url, "alice", secret=d.secret,
                                          cafile=d.cafile) as c:
                    for i in range(n):
                        seen: list[float] = []
                        answered = False
                        async for event in c.stream(MathQuestion(text=f"Question {i}?")):
                            if isinstance(event, Partial):
                                seen.append(time.monotonic())
                            answered = answered or isinstance(event, Answer)
                        assert answered and seen, "no partial or no answer"
                        firsts.append((seen[0] - server.first_piece_at[i]) * 1000)
                        gaps += [(b - a) * 1000 for a, b in pairwise(seen)]
                        counts.append(len(seen))
                    concurrent = await at_once(c, d, many)
                    assert c.session is not None
                    idle = await not_reading(d, c.session, idle_s)
            finally:
                await d.stop()
    return {
        "conversations": n,
        **concurrent,
        "first_partial_after_backend_ms_median": round(statistics.median(firsts), 3),
        "first_partial_after_backend_ms_p90": round(pct(firsts, 0.9), 3),
        "first_partial_after_backend_ms_max": round(max(firsts), 3),
        "gap_between_partials_ms_p50": round(pct(gaps, 0.5), 3),
        "gap_between_partials_ms_p99": round(pct(gaps, 0.99), 3),
        "backend_gap_ms": GAP_S * 1000,
        "partials_per_answer_median": statistics.median(counts),
        "pieces_per_answer": PIECES,
        **idle,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    result = asyncio.run(run(15 if args.quick else 100, 100 if args.quick else 1000,
                             3.0 if args.quick else 10.0))
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps({"benchmark": "stream", **result}))


if __name__ == "__main__":
    main()
