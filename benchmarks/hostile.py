"""What hostile input costs: rejection time by shape, and one client's flood as
another client sees it.

(a) Rejection time per shape (many attributes on one element, attributes spread
    over elements, many elements, elements under the limit, deep nesting, long text,
    many namespace declarations, many meta extensions, comments, the privileged
    namespace deep in a payload), each at three sizes, through the real pump's
    ingress (`Pump.submit_nowait`: parse, shape, admission, the refusal). The figure
    per 100 KiB should stay flat across the sizes of a shape: linear in the bytes.
(b) One server process (BusServer + Pump, the default rate limit) on 127.0.0.1: a
    client's sequential round trips while idle, then while another client floods it
    with the costliest of those frames as fast as it can; the p50 of both.

Usage: python benchmarks/hostile.py [--quick]. Loopback only; stops by itself. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bus  # noqa: E402  (benchmarks/bus.py: the server process and the client rig)
from _process import run  # noqa: E402  (benchmarks/_process.py: the uvloop runner)

from agentd._envelope import build_envelope  # noqa: E402
from agentd._schemas import NS_PRIV  # noqa: E402

ADD_NS = "https://xml-pipeline.org/ns/calculator/add/v1"
KIB = 1024
SIZES_KIB = (16, 64, 200)  # the largest under bus.max_envelope_bytes (256 KiB)


def wrap(payload: str, extensions: str = "") -> bytes:
    env = build_envelope("seq", str(uuid.uuid4()), payload.encode())
    if extensions:
        env = env.replace(b"</thread></meta>", b"</thread>" + extensions.encode() + b"</meta>")
    return env


def repeat(unit: str, size: int, head: str = "", tail: str = "") -> str:
    """`head`, `unit` as often as fits in `size` bytes, `tail`."""
    return head + unit * max(1, (size - len(head) - len(tail)) // len(unit)) + tail


def attrs(n: int, start: int = 0) -> str:
    return " ".join(f'a{i}="1"' for i in range(start, start + n))


# Each shape: size in bytes -> one envelope of about that size.
SHAPES: dict[str, Callable[[int], bytes]] = {
    "attributes on one element": lambda n: wrap(
        f'<add xmlns="{ADD_NS}" {attrs(n // 12)}/>'),
    "attributes spread (60 per element)": lambda n: wrap(repeat(
        f"<a {attrs(60)}>1</a>", n, f'<add xmlns="{ADD_NS}">', "<b>2</b></add>")),
    "elements over the limit": lambda n: wrap(repeat(
        "<e/>", n, f'<add xmlns="{ADD_NS}">', "</add>")),
    "elements under the limit": lambda n: wrap(repeat(
        "<e>" + "x" * max(1, n // 9000 - 7) + "</e>", n, f'<add xmlns="{ADD_NS}"><a>1</a>',
        "<b>2</b></add>")),
    "deep nesting": lambda n: wrap(
        f'<add xmlns="{ADD_NS}">' + "<e>" * (n // 7) + "</e>" * (n // 7) + "</add>"),
    "long text": lambda n: wrap(f'<add xmlns="{ADD_NS}"><a>{"1" * n}</a><b>2</b></add>'),
    "namespace declarations on one element": lambda n: wrap(
        f'<add xmlns="{ADD_NS}" '
        + " ".join(f'xmlns:n{i}="urn:{i}"' for i in range(n // 24)) + "/>"),
    "namespace declarations spread": lambda n: wrap(repeat(
        "<e " + " ".join(f'xmlns:n{i}="urn:{i}"' for i in range(60)) + "/>", n,
        f'<add xmlns="{ADD_NS}">', "</add>")),
    "meta extensions": lambda n: wrap(ADD_PAYLOAD, repeat(
        '<x:e xmlns:x="urn:x">1</x:e>', n)),
    "comments": lambda n: wrap(repeat(
        "<!-- c -->", n, f'<add xmlns="{ADD_NS}"><a>1</a>', "</add>")),  # no <b>
    "privileged namespace, deep": lambda n: wrap(
        f'<add xmlns="{ADD_NS}"><a>{"1" * n}<i><i><p:x xmlns:p="{NS_PRIV}"/></i></i></a></add>'),
}
ADD_PAYLOAD = f'<add xmlns="{ADD_NS}"><a>1</a><b>2</b></add>'


async def rejection_costs(quick: bool) -> dict[str, dict[str, Any]]:
    """µs to refuse each shape at each size, through the pump (no network, no kernel)."""
    from agentd._routing import Routing
    from agentd.config import load_config
    from agentd.pump import Pump, PumpOptions

    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    pump = Pump(Routing.build(config), {"seq": "public"}, lambda *a: None, PumpOptions(config.pump))
    await pump.start()
    rounds = 5 if quick else 20
    out: dict[str, dict[str, Any]] = {}
    print(f"{'shape':40} {'refused as':18} " + " ".join(f"{s:>5} KiB" for s in SIZES_KIB)
          + "   ms per 100 KiB at each size")
    for name, make in SHAPES.items():
        per_100k: list[float] = []
        codes = set()
        for size in SIZES_KIB:
            data = make(size * KIB)
            assert len(data) <= 256 * KIB, (name, len(data))
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                result = pump.submit_nowait("seq", data)
                best = min(best, time.perf_counter() - start)
            assert result is not None
            codes.add(result.code.value if result.code else "accepted")
            per_100k.append(best * 1e3 / (len(data) / (100 * KIB)))
        out[name] = {"codes": sorted(codes),
                     "ms_per_100kib": [round(x, 3) for x in per_100k]}
        print(f"{name:40} {','.join(sorted(codes)):18} "
              + " ".join(f"{x:9.3f}" for x in per_100k))
    await pump.stop()
    return out


async def round_trips(rig: bus.Rig, port: int, seconds: float) -> list[float]:
    ws = await rig.connect(port, "seq")
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    for r in bus.requests("seq", 100_000):
        if time.perf_counter() > deadline:
            break
        t0 = time.perf_counter()
        await ws.send(r, text=True)
        while True:
            frame = await ws.recv(decode=False)
            if not bus._is_accepted(frame):
                break
        out.append(time.perf_counter() - t0)
    await ws.close()
    return out


async def flood(rig: bus.Rig, port: int, frames: list[bytes], stop: asyncio.Event) -> int:
    """Send `frames` round-robin until `stop`, reading (and dropping) every answer."""
    ws = await rig.connect(port, "c0")
    sent = 0

    async def drain() -> None:
        with contextlib.suppress(Exception):
            while True:
                await ws.recv(decode=False)

    reader = asyncio.create_task(drain())
    try:
        while not stop.is_set():
            await ws.send(frames[sent % len(frames)], text=True)
            sent += 1
            await asyncio.sleep(0)  # let the victim's client run too
    finally:
        reader.cancel()
        with contextlib.suppress(Exception):
            await ws.close()
    return sent


async def flood_delay(quick: bool) -> dict[str, Any]:
    seconds = 3.0 if quick else 10.0
    home, secrets = bus.make_home()
    rig = bus.Rig(home, secrets)
    server = bus.ServerProcess("hostile", home / "agentd", kernel=False, script=__file__)
    try:
        await round_trips(rig, server.port, 0.5)  # warm-up
        idle = await round_trips(rig, server.port, seconds)
        hostile = [SHAPES[name](200 * KIB).replace(b"<from>seq<", b"<from>c0<") for name in (
            "attributes spread (60 per element)", "elements under the limit",
            "namespace declarations spread", "attributes on one element")]
        stop = asyncio.Event()
        flooding = asyncio.create_task(flood(rig, server.port, hostile, stop))
        await asyncio.sleep(0.2)  # the flood is under way
        under = await round_trips(rig, server.port, seconds)
        stop.set()
        sent = await flooding
    finally:
        server.stop()
    idle_p50 = statistics.median(idle) * 1e3
    flood_p50 = statistics.median(under) * 1e3
    print(f"another client's round trip p50: idle {idle_p50:.2f} ms, under a flood of "
          f"{sent} hostile frames of 200 KiB {flood_p50:.2f} ms "
          f"(+{flood_p50 - idle_p50:.2f} ms; target within 50 ms)")
    return {"idle_p50_ms": round(idle_p50, 3), "flood_p50_ms": round(flood_p50, 3),
            "flood_frames": sent, "flood_delay_ms": round(flood_p50 - idle_p50, 3)}


async def bench(quick: bool) -> dict[str, Any]:
    costs = await rejection_costs(quick)
    worst = max(max(c["ms_per_100kib"]) for c in costs.values())
    print(f"worst rejection: {worst:.3f} ms per 100 KiB")
    return {"shapes": costs, "worst_ms_per_100kib": worst, **await flood_delay(quick)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter flood")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-kernel", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.getLogger("agentd").setLevel(logging.ERROR)  # one warning per hostile frame
    if args.serve:
        # The daemon's defaults: rate limit, caps (the clients come from 127.0.0.1).
        run(bus.serve_agentd(bus.agentd_home(args.home), kernel=False, limits={}))
        return
    print(json.dumps(run(bench(args.quick))))


if __name__ == "__main__":
    main()
