"""Pump throughput against a bare validated pipeline, in one process run.

(a) baseline: the minimum a zero-trust validated pipeline must do per hop —
    hardened parse, XSD validation of envelope and payload, dict route, asyncio
    queue hand-off, serialise the reply, and re-parse + re-validate that reply
    (handler output is untrusted, so a zero-trust pipeline cannot skip this). The
    figure without the reply re-parse is printed too;
(b) the real pump on the same workload: a request to a tool that replies, each on
    its own thread (handler invocations counted);
(c) memory under sustained load, in a fresh interpreter: the pump over a real
    kernel, RSS after a warm-up (which fills the registry's rest set) and after N
    more completed conversations (1,000,000; 50,000 with --quick).

Usage: python benchmarks/pump.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentd._envelope import build_envelope  # noqa: E402
from agentd._routing import Routing  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._schemas import NS_ENV, schema  # noqa: E402
from agentd._threads import MAX_RESTING, Frame, ThreadRegistry, new_uuid  # noqa: E402
from agentd._xml import parse_untrusted  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.config import load_config  # noqa: E402
from agentd.kernel import Kernel  # noqa: E402
from agentd.pump import Pump, PumpOptions  # noqa: E402
from agentd.tools.calculator import Add, Sum  # noqa: E402

CLIENTS = 256  # concurrent submitters
COMMIT_INTERVAL_S = 0.0  # the configuration default (journal.commit_interval_ms: 0)


def envelopes(n: int) -> list[bytes]:
    spec = spec_of(Add)
    return [
        build_envelope("alice", str(uuid.uuid4()), spec.to_bytes(Add(a=i, b=2))) for i in range(n)
    ]


class ValidatedHop:
    """The minimum a zero-trust validated pipeline does per hop (see the module's
    docstring), without the hand-off: `answer(raw)` checks a client's Add envelope
    and returns the calculator's validated Sum envelope for `client`. Also the
    per-envelope work of benchmarks/bus.py's design floor."""

    def __init__(self, reparse: bool = True) -> None:
        self.env_schema = schema(NS_ENV)
        add_spec = spec_of(Add)
        self.sum_spec = spec_of(Sum)
        self.routes = {add_spec.clark: add_spec}
        self.reparse = reparse

    def check(self, raw: bytes) -> tuple[str, int, int]:
        """Hardened parse, envelope and payload XSD: (thread, a, b)."""
        root = parse_untrusted(raw)
        assert self.env_schema.validate(root)
        payload = root[1]
        spec = self.routes[payload.tag]
        assert spec.schema.validate(payload)
        return root[0][-1].text or "", int(payload[0].text), int(payload[1].text)

    def reply(self, thread: str, a: int, b: int, client: str = "alice") -> bytes:
        """The answer's envelope, re-parsed and re-validated (handler output is
        untrusted)."""
        sum_spec = self.sum_spec
        out = build_envelope("calculator.add", thread,
                             sum_spec.to_bytes(Sum(value=a + b)), to=client)
        if self.reparse:
            back = parse_untrusted(out)
            assert self.env_schema.validate(back) and sum_spec.schema.validate(back[1])
        return out


async def baseline(data: list[bytes], reparse: bool = True) -> float:
    hop = ValidatedHop(reparse)
    queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1024)
    done = 0

    async def consumer() -> None:
        nonlocal done
        while True:
            hop.reply(*hop.check(await queue.get()))
            done += 1
            queue.task_done()

    task = asyncio.create_task(consumer())
    start = time.perf_counter()
    for raw in data:
        await queue.put(raw)
    await queue.join()
    elapsed = time.perf_counter() - start
    task.cancel()
    assert done == len(data)
    return len(data) / elapsed


async def real_pump(
    data: list[bytes], journal_dir: Path | None = None, dsn: str | None = None
) -> tuple[float, list[float]]:
    """The pump on the workload; with `journal_dir`, over a real kernel (SQLite WAL,
    or with `dsn` PostgreSQL, the lease held as a daemon holds it)."""
    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    sent: dict[str, float] = {}
    latencies: list[float] = []

    def deliver(client: str, thread: str, frame: bytes, oid: int | None) -> None:
        if b"<from>core</from>" not in frame:
            latencies.append(time.perf_counter() - sent[thread])

    kernel = (
        await Kernel.open(journal_dir, commit_interval_s=COMMIT_INTERVAL_S, dsn=dsn,
                          lease="pump-bench" if dsn else None)
        if journal_dir is not None
        else None
    )
    pump = Pump(Routing.build(config), {"alice": "public"}, deliver, PumpOptions(config.pump),
                kernel)
    await pump.start()
    threads = [parse_untrusted(d)[0][-1].text or "" for d in data]
    work = iter(zip(data, threads, strict=True))

    async def client() -> None:
        # Many clients at once, as on the bus: with the journal on, each submit waits
        # for its group commit, so one sequential client would measure commit latency.
        for raw, thread in work:
            sent[thread] = time.perf_counter()
            result = await pump.submit("alice", raw)
            assert result.accepted, result

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    await pump.join()
    if kernel is not None:
        await kernel.flush()
    elapsed = time.perf_counter() - start
    await pump.stop()
    if kernel is not None:
        await kernel.close()
    assert pump.handled == len(data) and len(latencies) == len(data), (pump.handled, len(latencies))
    return pump.handled / elapsed, latencies


async def latency(data: list[bytes]) -> list[float]:
    """Client envelope in -> reply delivered, one conversation at a time."""
    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    out: list[float] = []
    got = 0

    def deliver(client: str, thread: str, frame: bytes, oid: int | None) -> None:
        nonlocal got
        got += 1

    pump = Pump(Routing.build(config), {"alice": "public"}, deliver, PumpOptions(config.pump))
    await pump.start()
    for raw in data:
        t0 = time.perf_counter()
        await pump.submit("alice", raw)
        await pump.join()
        out.append(time.perf_counter() - t0)
    await pump.stop()
    assert got == 2 * len(data)
    return out


def hostile_rejection_us() -> dict[str, float]:
    """Median time to refuse each hostile input (the target: well under a millisecond)."""
    from agentd._errors import Rejection

    big = 20 * 1024 * 1024
    cases = {
        "billion_laughs": b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "a">'
        + b"".join(f'<!ENTITY a{i} "&a{i - 1};&a{i - 1};">'.encode() for i in range(1, 30))
        + b"]><l>&a29;</l>",
        "external_entity": b'<!DOCTYPE r [<!ENTITY x SYSTEM "file:///etc/passwd">]><r>&x;</r>',
        "depth_10000": b"<a>" * 10_000 + b"</a>" * 10_000,
        "text_20mib": b"<a>" + b"x" * big + b"</a>",
        "attribute_20mib": b'<a b="' + b"x" * big + b'"/>',
    }
    out = {}
    for name, data in cases.items():
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            try:
                parse_untrusted(data)
            except Rejection:
                pass
            else:
                raise AssertionError(f"{name} was accepted")
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 1)
    return out


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def registry_rss(n: int) -> float:
    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    profile = Routing.build(config).profiles["public"]
    gc.collect()
    before = rss_mb()
    registry = ThreadRegistry()
    for _ in range(n):
        registry.add(Frame(new_uuid(), ("alice",), None, "alice", profile))
    gc.collect()
    used = rss_mb() - before
    assert len(registry) == n
    return used * 100_000 / n


def fresh_interpreter(flag: str, n: int) -> list[str]:
    """The last line this script prints when run with `flag n` in a fresh
    interpreter (so memory freed by the earlier phases cannot hide growth), split."""
    out = subprocess.run(
        [sys.executable, __file__, flag, str(n)], check=True, capture_output=True, text=True
    ).stdout
    return out.strip().splitlines()[-1].split()


def registry_rss_fresh(n: int) -> float:
    """RSS growth per 100k frames, measured in a fresh interpreter."""
    return float(fresh_interpreter("--registry-only", n)[0])


async def sustained_rss(warm: int, n: int) -> tuple[float, float]:
    """RSS (MB) after `warm` completed conversations and after `n` more, through the
    pump over a kernel in a temporary directory. Envelopes are built as they are
    sent, so the workload itself holds no memory."""
    import tempfile

    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    spec = spec_of(Add)
    answered = 0
    last_outbox_id = 0

    def deliver(client: str, thread: str, frame: bytes, oid: int | None) -> None:
        nonlocal answered, last_outbox_id
        if b"<from>core</from>" not in frame:
            answered += 1
        if oid is not None:
            last_outbox_id = max(last_outbox_id, oid)

    async def conversations(count: int) -> None:
        left = count

        async def client() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                data = build_envelope("alice", new_uuid(), spec.to_bytes(Add(a=left, b=2)))
                result = await pump.submit("alice", data)
                assert result.accepted, result
                if left % 1000 == 0:
                    # The client acknowledges what it received, as the bus does for a
                    # connected client: the outbox stays short.
                    tx = kernel.transaction()
                    tx.outbox_delivered("alice", last_outbox_id)
                    kernel.commit(tx)

        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        await pump.join()
        await kernel.flush()
        await pump.join()

    with tempfile.TemporaryDirectory(prefix="agentd-bench-") as tmp:
        kernel = await Kernel.open(Path(tmp), commit_interval_s=COMMIT_INTERVAL_S)
        pump = Pump(Routing.build(config), {"alice": "public"}, deliver,
                    PumpOptions(config.pump), kernel)
        await pump.start()
        await conversations(warm)
        gc.collect()
        warm_mb = rss_mb()
        await conversations(n)
        gc.collect()
        after_mb = rss_mb()
        await pump.stop()
        await kernel.close()
    assert answered == warm + n, (answered, warm + n)
    return warm_mb, after_mb


def sustained_rss_fresh(n: int) -> tuple[float, float, float]:
    """(RSS after warm-up, RSS after `n` more conversations, growth in MB per million)
    measured in a fresh interpreter. The warm-up is long enough to fill the rest
    set, whose bounded size is not growth."""
    warm_mb, after_mb = (float(x) for x in fresh_interpreter("--sustained-only", n))
    return warm_mb, after_mb, (after_mb - warm_mb) * 1_000_000 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--registry-only", type=int, default=0)
    ap.add_argument("--sustained-only", type=int, default=0)
    args = ap.parse_args()
    tune_gc()  # the daemon's process tuning (agentd/_runtime.py), for both arms
    if args.registry_only:
        print(registry_rss(args.registry_only))
        return
    if args.sustained_only:
        warm_mb, after_mb = asyncio.run(sustained_rss(8 * MAX_RESTING, args.sustained_only))
        print(warm_mb, after_mb)
        return
    n = 5_000 if args.quick else 50_000
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:  # pragma: no cover
        loop_name = "asyncio"
    data = envelopes(n)
    asyncio.run(baseline(data[:1000]))  # warm-up
    base = asyncio.run(baseline(data))
    pump_rate, _ = asyncio.run(real_pump(data))
    base2 = asyncio.run(baseline(data))  # again, to bracket noise
    base = max(base, base2)
    bare = asyncio.run(baseline(data, reparse=False))
    single = asyncio.run(latency(data[: min(2000, n)]))
    ratio = pump_rate / base
    lat_us = sorted(x * 1e6 for x in single)
    p50 = statistics.median(lat_us)
    p99 = lat_us[int(len(lat_us) * 0.99) - 1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_100k = registry_rss_fresh(20_000 if args.quick else 100_000)
    print(f"loop: {loop_name}, messages: {n}")
    print(
        f"baseline, zero-trust (parse+2 XSD+route+queue+serialise+re-parse reply): "
        f"{base:,.0f} handler invocations/s"
    )
    print(
        f"baseline without the reply re-parse: {bare:,.0f}/s (pump/that = {pump_rate / bare:.2f})"
    )
    print(f"pump (full ingress, per-thread queues, re-entry): {pump_rate:,.0f} invocations/s")
    print(f"ratio pump/baseline: {ratio:.2f} (target >= 0.40); pump target >= 10,000/s")
    print(
        f"hop latency client->reply, one conversation at a time: p50 {p50:.0f} us, p99 {p99:.0f} us"
    )
    print(f"peak RSS {peak:.0f} MB; registry RSS per 100k live threads {per_100k:.1f} MB")
    hostile = hostile_rejection_us()
    print(
        "hostile input refused in (median us): " + ", ".join(f"{k} {v}" for k, v in hostile.items())
    )
    sustained = 50_000 if args.quick else 1_000_000
    warm_mb, after_mb, growth = sustained_rss_fresh(sustained)
    print(
        f"sustained load: RSS {warm_mb:.1f} MB after warm-up, {after_mb:.1f} MB after "
        f"{sustained:,} more conversations: {growth:.1f} MB per million (target < 20)"
    )
    print(
        json.dumps(
            {
                "baseline_per_s": round(base),
                "pump_per_s": round(pump_rate),
                "ratio": round(ratio, 3),
                "p50_us": round(p50),
                "p99_us": round(p99),
                "peak_rss_mb": round(peak, 1),
                "rss_mb_per_100k_threads": round(per_100k, 1),
                "hostile_reject_us_max": max(hostile.values()),
                "rss_mb_warm": round(warm_mb, 1),
                "rss_mb_after": round(after_mb, 1),
                "rss_growth_mb_per_1m": round(growth, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
