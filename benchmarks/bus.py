"""The main bus against the floor of its design, in one run.

Three servers, each in its own process, driven by the same client program (this
process) over real TLS WebSockets on 127.0.0.1, all on uvloop:

  floor   the design floor: a websockets TLS server doing per envelope only what
          this design cannot skip: the client's TOTP checked on its first frame,
          hardened parse, envelope and payload XSD, the reply built and re-parsed
          and validated (benchmarks/pump.py's `ValidatedHop`), then two journal
          rows (request and reply) committed by a writer process of its own in an
          SQLite WAL group commit (every envelope of one loop turn in one batch, one
          COMMIT, batches pipelined) before answering. No `accepted` frame, no
          sessions, no routing, no thread registry, no outbox, no hash chain;
  echo    a bare websockets TLS server that sends every frame back (the limit of
          TLS + WebSocket framing + the event loop here; for reference);
  agentd  BusServer + ClientAuth + the real Pump serving `calculator.add`, with the
          kernel journaling every envelope (durable `accepted`) unless --no-kernel.

Measured: 8 pipelined clients (request/response pairs per second: a pair is a
request and its answer; agentd's `accepted` frames are read but not counted), one
sequential client's round trip (p50/p99), both in 7 alternating rounds with the
servers up side by side (medians; ratios are medians of per-round ratios); each
server's CPU per pipelined pair (its main process and its children, the writer,
from the scheduler's per-thread counts; connecting not counted) beside the floor's;
and the server's RSS growth per idle
authenticated connection (5,000 connections; --quick: 500). The in-process pump on
the same workload is printed too (the cost of the network layer).

Usage: python benchmarks/bus.py [--quick]. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import resource
import shutil
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _process import rss_kb, run, tree_cpu_ns  # noqa: E402

from agentd._envelope import build_envelope  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402

CLIENTS = 8
ROUNDS = 7  # alternating echo/agentd rounds for pairs/s and round trips
WINDOW = 64  # requests outstanding per pipelined client


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def requests(client: str, n: int) -> list[bytes]:
    spec = spec_of(Add)
    return [build_envelope(client, str(uuid.uuid4()), spec.to_bytes(Add(a=i, b=2)))
            for i in range(n)]


# ---------------------------------------------------------------------------- servers


async def serve_echo(home: Path) -> None:
    from websockets.asyncio.server import serve

    from agentd.bus import server_context
    from agentd.config import TlsConfig

    ctx = server_context(TlsConfig(home / "tls" / "cert.pem", home / "tls" / "key.pem"))

    async def echo(ws: Any) -> None:
        async for frame in ws:
            await ws.send(frame)

    server = await serve(echo, "127.0.0.1", 0, ssl=ctx, compression=None,
                         max_size=256 * 1024, max_queue=(4, 1))
    tune_gc()  # the same process tuning as agentd's
    await _serve_control(server.sockets[0].getsockname()[1], server)


def floor_writer(sock: Any, path: Path) -> None:
    """The floor's writer process: each batch of rows (a length-prefixed pickle) is
    inserted and committed in one SQLite WAL transaction, then acknowledged with
    one byte, in order."""
    import pickle
    import sqlite3
    import struct

    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS journal "
               "(seq INTEGER PRIMARY KEY, thread TEXT NOT NULL, payload BLOB NOT NULL)")
    f = sock.makefile("rb")
    while (head := f.read(4)) and len(head) == 4:
        rows = pickle.loads(f.read(struct.unpack("!I", head)[0]))
        db.execute("BEGIN")
        db.executemany("INSERT INTO journal (thread, payload) VALUES (?, ?)", rows)
        db.execute("COMMIT")
        sock.sendall(b"k")
    db.close()


async def serve_floor(home: Path) -> None:
    import pickle
    import socket
    import struct

    import yaml
    from websockets.asyncio.server import serve

    from agentd._xml import parse_untrusted
    from agentd.bus import server_context
    from agentd.bus._auth import current_totp
    from agentd.config import TlsConfig

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from pump import ValidatedHop

    ctx = server_context(TlsConfig(home / "tls" / "cert.pem", home / "tls" / "key.pem"))
    home.mkdir(parents=True, exist_ok=True)
    secrets = {name: entry["totp_secret"] for name, entry in
               yaml.safe_load((home / "clients.yaml").read_text())["clients"].items()}
    # One process for the journal, as agentd's kernel has: forked from the running
    # loop, the child never returns to it (it serves the socket, then _exits).
    ours, theirs = socket.socketpair()
    if os.fork() == 0:
        ours.close()
        floor_writer(theirs, home / "floor.db")
        os._exit(0)
    theirs.close()
    hop = ValidatedHop()
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(sock=ours)
    pending: list[tuple[tuple[str, bytes], ...]] = []
    waiting: list[asyncio.Future[None]] = []
    sent: collections.deque[list[asyncio.Future[None]]] = collections.deque()

    def group_commit() -> None:
        """Every envelope's two rows of this loop turn in one batch (pipelined: the
        next batch goes while this one commits)."""
        rows = [row for pair in pending for row in pair]
        body = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
        writer.write(struct.pack("!I", len(body)) + body)
        sent.append(waiting[:])
        pending.clear()
        waiting.clear()

    async def acknowledgements() -> None:
        while await reader.read(1):
            for fut in sent.popleft():
                fut.set_result(None)

    acks = loop.create_task(acknowledgements())

    def authenticated(first: bytes | str) -> bool:
        """The first frame: TOTP checked against the client's secret (this step's
        code or the last one's)."""
        root = parse_untrusted(first.encode() if isinstance(first, str) else first)
        client, code = root[0].text or "", root[1].text or ""
        secret = secrets.get(client)
        now = time.time()
        return secret is not None and code in (current_totp(secret, lambda: now),
                                               current_totp(secret, lambda: now - 30))

    async def handle(ws: Any) -> None:
        first = await ws.recv()
        if not authenticated(first):
            await ws.close(4001)
            return
        await ws.send(first)  # echoed: the client keeps no session for the floor
        # Envelopes are read, checked and answered as they come (pipelined, as agentd
        # reads); a sender sends each answer, in order, once both rows are committed.
        committed: asyncio.Queue[tuple[bytes, asyncio.Future[None]] | None] = (
            asyncio.Queue())

        async def sender() -> None:
            while (item := await committed.get()) is not None:
                out, fut = item
                await fut
                await ws.send(out, text=True)

        task = loop.create_task(sender())
        async for frame in ws:
            raw = frame.encode() if isinstance(frame, str) else frame
            thread, a, b = hop.check(raw)
            out = hop.reply(thread, a, b, "c")
            fut = loop.create_future()
            if not pending:
                loop.call_soon(group_commit)
            pending.append(((thread, raw), (thread, out)))
            waiting.append(fut)
            committed.put_nowait((out, fut))
        committed.put_nowait(None)
        await task

    server = await serve(handle, "127.0.0.1", 0, ssl=ctx, compression=None,
                         max_size=256 * 1024, max_queue=(4, 1))
    tune_gc()
    await _serve_control(server.sockets[0].getsockname()[1], server)
    writer.close()
    acks.cancel()


# What the throughput rounds run with: no rate limit, no connection caps (every
# client connects from 127.0.0.1, 100 at a time).
UNLIMITED: dict[str, Any] = {
    "max_connections": 20000, "max_unauthenticated": 20000,
    "max_unauthenticated_per_ip": 20000, "rate_per_s": 1e9, "rate_burst": 1_000_000,
}


async def serve_agentd(home: Path, kernel: bool, limits: dict[str, Any] | None = None) -> None:
    """BusServer + Pump (+ kernel) on `home`; `limits` overrides BusConfig's defaults
    (None: UNLIMITED)."""
    from dataclasses import replace

    from agentd._routing import Routing
    from agentd.bus import BusServer, ClientAuth
    from agentd.config import AuthConfig, BusConfig, TlsConfig, load_config
    from agentd.pump import Pump, PumpOptions

    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml",
                         state_dir_override=home / "state")
    auth = ClientAuth.load(home / "clients.yaml", config.state_dir,
                           AuthConfig(clients_file=home / "clients.yaml"))
    holder: dict[str, Any] = {}

    def deliver(client: str, thread: str, data: bytes, outbox_id: int | None = None) -> None:
        holder["bus"].deliver(client, thread, data, outbox_id)

    outbox = None
    kern = None
    if kernel:
        from agentd._daemon import KernelOutbox
        from agentd._wiring import kernel_options
        from agentd.kernel import Kernel

        kern = await Kernel.open(config.state_dir, kernel_options(config))
        outbox = KernelOutbox(kern)
    pump = Pump(Routing.build(config), auth.profiles(), deliver, PumpOptions(config.pump), kern)
    await pump.start()
    cfg = replace(BusConfig(), host="127.0.0.1", port=0,
                  tls=TlsConfig(home / "tls" / "cert.pem", home / "tls" / "key.pem"),
                  **(UNLIMITED if limits is None else limits))
    bus = holder["bus"] = BusServer(cfg, auth, pump.submit, outbox,
                                         submit_nowait=pump.submit_nowait)
    await bus.start()
    tune_gc()  # as the daemon does once started
    await _serve_control(bus.port, None)
    await bus.close()
    await pump.stop()
    if kern is not None:
        await kern.close()


async def _serve_control(port: int, server: Any) -> None:
    """Print the port, then answer `rss` / `quit` lines on stdin."""
    print(f"PORT {port}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().strip()
        if line == "rss":
            gc.collect()
            await asyncio.sleep(0.2)
            print(f"RSS {rss_kb()}", flush=True)
        elif line in ("quit", ""):
            break
    if server is not None:
        server.close()


class ServerProcess:
    def __init__(self, mode: str, home: Path, kernel: bool = True, script: str = __file__) -> None:
        args = [sys.executable, script, "--serve", mode, "--home", str(home)]
        if not kernel:
            args.append("--no-kernel")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(line.split()[1])

    def cpu_ns(self) -> tuple[int, int]:
        """(main process, its children) CPU nanoseconds so far."""
        return tree_cpu_ns(self.proc.pid)

    def rss(self) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("rss\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[1])

    def stop(self) -> None:
        assert self.proc.stdin
        with _suppress():
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


# ---------------------------------------------------------------------------- the client


class Rig:
    def __init__(self, home: Path, secrets: dict[str, str]) -> None:
        self.home = home
        self.secrets = secrets
        self.ctx = ssl.create_default_context(cafile=str(home / "tls" / "cert.pem"))
        self.sessions: dict[tuple[int, str], str] = {}

    async def connect(self, port: int, client: str) -> Any:
        """Connect and send the first frame (a session if we have one, else TOTP);
        the echo server echoes it, agentd answers auth-ok."""
        import pyotp
        from websockets.asyncio.client import connect

        from agentd.bus import auth_frame, parse_auth_ok

        ws = await connect(f"wss://127.0.0.1:{port}/bus", ssl=self.ctx, compression=None,
                           max_size=1 << 20, open_timeout=60, ping_interval=None)
        session = self.sessions.get((port, client))
        frame = (auth_frame(client, session=session) if session else
                 auth_frame(client, totp=pyotp.TOTP(self.secrets[client]).now()))
        await ws.send(frame, text=True)
        reply = await ws.recv(decode=False)
        ok = parse_auth_ok(reply)
        if ok is not None:
            self.sessions[(port, client)] = ok[1]
        return ws


def _is_accepted(frame: bytes) -> bool:
    return b"<from>core</from>" in frame and b"<accepted " in frame


async def pipelined(rig: Rig, port: int, n_per_client: int,
                    cpu: list[tuple[int, int]] | None = None,
                    server: ServerProcess | None = None) -> float:
    """Pairs per second of CLIENTS pipelined clients; with `server`, the server's CPU
    (main, children) over the pairs alone (connecting not counted) is added to `cpu`."""
    names = [f"c{i}" for i in range(CLIENTS)]
    conns = [await rig.connect(port, name) for name in names]
    work = {name: requests(name, n_per_client) for name in names}

    async def run(ws: Any, reqs: list[bytes]) -> None:
        sem = asyncio.Semaphore(WINDOW)
        done = 0

        async def reader() -> None:
            nonlocal done
            while done < len(reqs):
                frame = await ws.recv(decode=False)
                if _is_accepted(frame):
                    continue
                done += 1
                sem.release()

        task = asyncio.create_task(reader())
        for r in reqs:
            await sem.acquire()
            await ws.send(r, text=True)
        await task

    before = server.cpu_ns() if server is not None else (0, 0)
    start = time.perf_counter()
    await asyncio.gather(*(run(ws, work[name]) for ws, name in zip(conns, names, strict=True)))
    elapsed = time.perf_counter() - start
    if server is not None and cpu is not None:
        after = server.cpu_ns()
        cpu.append((after[0] - before[0], after[1] - before[1]))
    for ws in conns:
        await ws.close()
    return CLIENTS * n_per_client / elapsed


async def sequential(rig: Rig, port: int, n: int) -> list[float]:
    ws = await rig.connect(port, "seq")
    out: list[float] = []
    for r in requests("seq", n):
        t0 = time.perf_counter()
        await ws.send(r, text=True)
        while True:
            frame = await ws.recv(decode=False)
            if not _is_accepted(frame):
                break
        out.append(time.perf_counter() - t0)
    await ws.close()
    return out


async def idle(rig: Rig, port: int, n: int) -> list[Any]:
    await (await rig.connect(port, "idle")).close()  # TOTP once, sessions after
    conns: list[Any] = []
    for i in range(0, n, 100):
        conns += await asyncio.gather(*(rig.connect(port, "idle") for _ in range(min(100, n - i))))
    return conns


async def inprocess(n: int) -> float:
    """The same workload through the pump in this process (no network, no journal)."""
    from agentd._routing import Routing
    from agentd.config import load_config
    from agentd.pump import Pump, PumpOptions

    config = load_config(ROOT / "agentd" / "demo" / "organism.yaml")
    got = 0

    def deliver(c: str, t: str, d: bytes, o: int | None = None) -> None:
        nonlocal got
        if not _is_accepted(d):
            got += 1

    pump = Pump(Routing.build(config), {"alice": "public"}, deliver, PumpOptions(config.pump))
    await pump.start()
    data = requests("alice", n)
    start = time.perf_counter()
    for d in data:
        await pump.submit("alice", d)
    await pump.join()
    elapsed = time.perf_counter() - start
    await pump.stop()
    assert got == n
    return n / elapsed


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def make_home() -> tuple[Path, dict[str, str]]:
    import pyotp
    import yaml

    from agentd.bus import make_self_signed

    home = Path(tempfile.mkdtemp(prefix="agentd-bench-"))
    make_self_signed(home / "tls" / "cert.pem", home / "tls" / "key.pem")
    names = [f"c{i}" for i in range(CLIENTS)] + ["seq", "idle"]
    secrets = {n: pyotp.random_base32() for n in names}
    path = home / "clients.yaml"
    path.write_text(yaml.safe_dump({"clients": {
        n: {"totp_secret": s, "profile": "public"} for n, s in secrets.items()}}))
    path.chmod(0o600)
    return home, secrets


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    n_pipe = 500 if quick else 4000
    n_seq = 300 if quick else 2000
    n_idle = 500 if quick else 5000
    _raise_nofile()
    home, secrets = make_home()
    rig = Rig(home, secrets)
    result: dict[str, Any] = {"clients": CLIENTS, "window": WINDOW, "kernel": not args.no_kernel}

    # Both servers run side by side and are measured in alternating rounds, each
    # figure a median over rounds and each ratio the median of per-round ratios:
    # this machine's speed drifts by tens of percent within seconds, so two
    # back-to-back single runs could compare a fast minute with a slow one.
    modes = ("echo", "floor", "agentd")
    servers = {m: ServerProcess(m, home / m if m != "echo" else home,
                                kernel=not args.no_kernel) for m in modes}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    lats: dict[str, list[list[float]]] = {m: [] for m in modes}
    cpus: dict[str, list[tuple[int, int]]] = {m: [] for m in modes}
    try:
        for mode in modes:
            await pipelined(rig, servers[mode].port, max(50, n_pipe // 10))  # warm-up
            await sequential(rig, servers[mode].port, 50)
        for _ in range(ROUNDS):
            for mode in modes:
                rates[mode].append(await pipelined(rig, servers[mode].port, n_pipe // ROUNDS,
                                                   cpus[mode], servers[mode]))
                lats[mode].append(await sequential(rig, servers[mode].port, n_seq // ROUNDS))
    finally:
        for server in servers.values():
            server.stop()
    for mode in modes:
        rate = statistics.median(rates[mode])
        p50 = statistics.median(pct(lat, 0.5) for lat in lats[mode]) * 1e6
        p99 = pct([x for lat in lats[mode] for x in lat], 0.99) * 1e6
        print(f"{mode:>6}: {rate:9.0f} pairs/s ({CLIENTS} pipelined clients), "
              f"round trip p50 {p50:7.0f} us p99 {p99:7.0f} us (medians of {ROUNDS} rounds)")
        result[f"{mode}_pairs_per_s"] = round(rate)
        result[f"{mode}_p50_us"] = round(p50)
        result[f"{mode}_p99_us"] = round(p99)
    ratios = [a / e for a, e in zip(rates["agentd"], rates["echo"], strict=True)]
    p50_ratios = [pct(a, 0.5) / pct(e, 0.5)
                  for a, e in zip(lats["agentd"], lats["echo"], strict=True)]
    print("per-round ratios to echo: pairs/s " + " ".join(f"{r:.2f}" for r in ratios)
          + "; p50 " + " ".join(f"{r:.1f}" for r in p50_ratios))
    floor_ratios = [a / f for a, f in zip(rates["agentd"], rates["floor"], strict=True)]
    floor_p50_ratios = [pct(a, 0.5) / pct(f, 0.5)
                        for a, f in zip(lats["agentd"], lats["floor"], strict=True)]
    print("per-round ratios to the floor: pairs/s "
          + " ".join(f"{r:.2f}" for r in floor_ratios)
          + "; p50 " + " ".join(f"{r:.2f}" for r in floor_p50_ratios))
    # CPU per pair: each server's main process and its children (the writer), over
    # the pipelined pairs of every round; the ratio is the median of per-round ones.
    pairs_per_round = CLIENTS * (n_pipe // ROUNDS)
    per_pair: dict[str, list[float]] = {}
    for mode in modes:
        per_pair[mode] = [(m + c) / 1000 / pairs_per_round for m, c in cpus[mode]]
        main = sum(m for m, _ in cpus[mode]) / 1000 / (pairs_per_round * ROUNDS)
        child = sum(c for _, c in cpus[mode]) / 1000 / (pairs_per_round * ROUNDS)
        print(f"{mode:>6}: CPU per pair {main + child:6.1f} us ({main:.1f} main process, "
              f"{child:.1f} writer); per round " + " ".join(f"{x:.0f}" for x in per_pair[mode]))
        result[f"{mode}_cpu_us_per_pair"] = round(main + child, 1)
        result[f"{mode}_main_cpu_us_per_pair"] = round(main, 1)
        result[f"{mode}_writer_cpu_us_per_pair"] = round(child, 1)
    cpu_ratios = [a / f for a, f in zip(per_pair["agentd"], per_pair["floor"], strict=True)]
    print("per-round CPU per pair, agentd over the floor: "
          + " ".join(f"{r:.2f}" for r in cpu_ratios))
    result["cpu_ratio_to_floor"] = round(statistics.median(cpu_ratios), 2)
    for mode in modes:
        print(f"{mode:>6} per round: pairs/s " + " ".join(f"{r:.0f}" for r in rates[mode])
              + "; p50 us " + " ".join(f"{pct(lat, 0.5) * 1e6:.0f}" for lat in lats[mode]))

    for mode in ("echo", "agentd"):
        server = ServerProcess(mode, home / f"{mode}-idle" if mode == "agentd" else home,
                               kernel=not args.no_kernel)
        try:
            warm = await idle(rig, server.port, 20)
            before = server.rss()
            conns = await idle(rig, server.port, n_idle)
            await asyncio.sleep(1.0)
            after = server.rss()
            for ws in conns + warm:
                ws.transport.abort()
        finally:
            server.stop()
        per = (after - before) / n_idle
        print(f"{mode:>6}: RSS {before} KiB -> {after} KiB with {n_idle} idle authenticated "
              f"connections: {per:.1f} KiB each")
        result[f"{'echo_' if mode == 'echo' else ''}kib_per_idle_connection"] = round(per, 1)

    ip = await inprocess(n_pipe)
    print(f"in-process pump (no network, no journal): {ip:.0f} pairs/s")
    result["inprocess_pairs_per_s"] = round(ip)
    result["ratio"] = round(statistics.median(ratios), 3)
    result["p50_ratio"] = round(statistics.median(p50_ratios), 2)
    result["ratio_to_floor"] = round(statistics.median(floor_ratios), 3)
    result["p50_ratio_to_floor"] = round(statistics.median(floor_p50_ratios), 2)
    result["network_vs_inprocess"] = round(result["agentd_pairs_per_s"] / ip, 3)
    result["idle_connections"] = n_idle
    print(f"agentd reaches {result['ratio']:.0%} of the echo server's pairs/s "
          "(target >= 40%)")
    print(f"agentd p50 round trip is {result['p50_ratio']}x the echo server's (target <= 3x)")
    print(f"agentd reaches {result['ratio_to_floor']:.0%} of the design floor's pairs/s "
          "(target >= 60%)")
    print(f"agentd p50 round trip is {result['p50_ratio_to_floor']}x the floor's "
          "(target <= 1.5x)")
    print(f"agentd uses {result['cpu_ratio_to_floor']}x the floor's CPU per pair "
          "(target <= 2.5x)")
    print(f"idle connection: {result['kib_per_idle_connection']} KiB (target < 40 KiB)")
    return result


def agentd_home(home: Path) -> Path:
    """A server's own folder under the benchmark's home, sharing its TLS pair (a
    linked folder) and holding a copy of its clients file (a secret file is never
    read through a symbolic link)."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "tls").exists():
        os.symlink(home.parent / "tls", home / "tls")
    if not (home / "clients.yaml").exists():
        shutil.copy2(home.parent / "clients.yaml", home / "clients.yaml")  # keeps 0600
    return home


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for CI")
    parser.add_argument("--no-kernel", action="store_true", help="agentd without the journal")
    parser.add_argument("--serve", choices=("echo", "floor", "agentd"), help=argparse.SUPPRESS)
    parser.add_argument("--home", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _raise_nofile()
        home = args.home
        if args.serve == "echo":
            run(serve_echo(home))
        elif args.serve == "floor":
            run(serve_floor(agentd_home(home)))
        else:
            run(serve_agentd(agentd_home(home), kernel=not args.no_kernel))
        return
    result = run(bench(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
