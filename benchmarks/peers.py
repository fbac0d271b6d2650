"""agentd against the runtimes a user would pick instead, side by side in one run.

    python benchmarks/peers.py [--quick]

Runtimes (all in this process, all on uvloop, the same GC tuning for all):

  agentd            the real Pump over a real kernel (SQLite WAL, durable `accepted`),
                    driven the way the bus drives it: `submit_nowait` (else `submit`),
                    frames handed to `deliver`, outbox rows marked delivered through
                    the daemon's `KernelOutbox`;
  agentd_postgres   the same over the kernel on PostgreSQL (the lease held, as a daemon
                    holds it), when a server is there (see _postgres.py; else the
                    JSON's "postgres" says it was skipped);
  agentd_full       the same with `journal.synchronous: FULL` (every commit waits for an
                    fdatasync, as LangGraph's saver's do);
  agentd_nojournal  the same pump without a kernel;
  autogen           AutoGen core: `SingleThreadedAgentRuntime`, `RoutedAgent`s,
                    `send_message` (persists nothing);
  langgraph         LangGraph: a `StateGraph` compiled once, `ainvoke`, no checkpointer;
  langgraph_sqlite  the same graph with `AsyncSqliteSaver` (a checkpoint per step), as
                    the library sets it up: WAL, SQLite's default synchronous=FULL, so
                    every commit (five a w1 pair) waits for an fdatasync;
  langgraph_sqlite_normal  the same with synchronous=NORMAL on the saver's connection:
                    agentd's default durability (`journal.synchronous`: a commit
                    survives the process, not the machine), so the two compare at the
                    same durability; the saver is otherwise untouched.

Workloads, the same payload values for every runtime, every answer checked:

  w1  request/answer: `CONVERSATIONS` concurrent conversations, each sending Add(a, b)
      to the calculator and waiting for Sum(a + b) before its next;
  w2  delegation chain: client -> relay -> calculator -> relay -> client, likewise;
  p50 one w1 conversation at a time: the median round trip.

Each runtime is set up once and warmed up; then `ROUNDS` rounds run the runtimes in
turn (order rotated each round). Figures are medians over rounds; ratios are medians
of the per-round ratios, so a machine whose speed drifts skews them less. Beside each
rate, the CPU per pair over the same requests: this process's threads (the event loop,
aiosqlite's thread) and its children (agentd's writer), steadier than wall clock on a
shared machine; and each round, the disk's fdatasync median, which the savers' FULL
commits wait for. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _process import run, tree_cpu_ns  # noqa: E402
from autogen_core import (  # noqa: E402
    AgentId,
    MessageContext,
    RoutedAgent,
    SingleThreadedAgentRuntime,
    message_handler,
)

from agentd._envelope import build_envelope  # noqa: E402
from agentd._runtime import tune_gc  # noqa: E402
from agentd._xmlify import spec_of  # noqa: E402
from agentd.tools.calculator import Add  # noqa: E402
from agentd.tools.relay import Relay  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _postgres as postgres  # noqa: E402

CONVERSATIONS = 64
ROUNDS = 5
RUNTIMES = ("agentd", "agentd_full", "agentd_nojournal", "autogen", "langgraph", "langgraph_sqlite",
            "langgraph_sqlite_normal")
# A tenth of the requests: they are ~20x slower than the rest.
SLOW = {"langgraph_sqlite", "langgraph_sqlite_normal"}
_VALUE = re.compile(rb"<value>(-?\d+)</value>")


def operands(n: int) -> list[tuple[int, int]]:
    """The payload values every runtime gets: request i adds i and 2."""
    return [(i, 2) for i in range(n)]


class Runtime:
    """One runtime under test: `ask(w, a, b)` sends one request of workload `w` and
    returns the answer's value."""

    name = ""

    async def start(self, directory: Path) -> None:
        pass

    async def stop(self) -> None:
        pass

    def prepare(self, workload: str, values: list[tuple[int, int]]) -> list[Any]:
        """The requests, built before the clock starts (the client's own work)."""
        return [(workload, a, b) for a, b in values]

    async def ask(self, request: Any) -> int:
        raise NotImplementedError


# ------------------------------------------------------------------------------ agentd


class AgentdRuntime(Runtime):
    def __init__(self, journal: bool, dsn: str | None = None,
                 synchronous: str | None = None) -> None:
        self.journal = journal
        self.dsn = dsn  # the kernel on PostgreSQL (the lease held, as a daemon holds it)
        self.synchronous = synchronous  # None: the demo organism's (NORMAL)
        self.name = ("agentd_postgres" if dsn else "agentd_full" if synchronous == "FULL"
                     else "agentd" if journal else "agentd_nojournal")
        self._answers: dict[str, asyncio.Future[bytes]] = {}

    async def start(self, directory: Path) -> None:
        from agentd._daemon import KernelOutbox
        from agentd._routing import Routing
        from agentd._wiring import kernel_options
        from agentd.config import load_config
        from agentd.kernel import Kernel
        from agentd.pump import Pump, PumpOptions

        config = load_config(ROOT / "agentd" / "demo" / "organism.yaml",
                             state_dir_override=directory / self.name)
        self.kernel = None
        outbox = None
        if self.journal:
            options = kernel_options(config)
            if self.dsn:
                options = replace(options, dsn=self.dsn, lease="peers-bench")
            if self.synchronous:
                options = replace(options, synchronous=self.synchronous)
            self.kernel = await Kernel.open(config.state_dir, options)
            outbox = KernelOutbox(self.kernel)
        answers = self._answers

        def deliver(client: str, thread: str, frame: bytes, oid: int | None) -> None:
            if oid is not None and outbox is not None:
                outbox.delivered(client, oid)  # as the bus does once the frame is sent
            if b"<from>core</from>" in frame:
                if b"<accepted " not in frame:
                    raise AssertionError(f"refused: {frame!r}")
                return
            answers.pop(thread).set_result(frame)

        self.pump = Pump(Routing.build(config), {"alice": "public"}, deliver,
                         PumpOptions(config.pump), self.kernel)
        await self.pump.start()

    async def stop(self) -> None:
        await self.pump.join()
        await self.pump.stop()
        if self.kernel is not None:
            await self.kernel.close()

    def prepare(self, workload: str, values: list[tuple[int, int]]) -> list[Any]:
        add, relay = spec_of(Add), spec_of(Relay)
        out = []
        for a, b in values:
            thread = str(uuid.uuid4())
            payload = add.to_bytes(Add(a=a, b=b)) if workload == "w1" else relay.to_bytes(
                Relay(a=a, b=b))
            out.append((thread, build_envelope("alice", thread, payload)))
        return out

    async def ask(self, request: Any) -> int:
        thread, data = request
        pump = self.pump
        answer = self._answers[thread] = asyncio.get_running_loop().create_future()
        result = pump.submit_nowait("alice", data)
        if result is None:
            result = await pump.submit("alice", data)
        if not result.accepted:
            raise AssertionError(f"refused: {result}")
        match = _VALUE.search(await answer)
        assert match is not None
        return int(match.group(1))


# ----------------------------------------------------------------------------- AutoGen


@dataclass
class AddMessage:
    a: int
    b: int


@dataclass
class RelayMessage:
    a: int
    b: int


@dataclass
class SumMessage:
    value: int


class AutogenCalculator(RoutedAgent):
    @message_handler
    async def on_add(self, message: AddMessage, ctx: MessageContext) -> SumMessage:
        return SumMessage(message.a + message.b)


class AutogenRelay(RoutedAgent):
    @message_handler
    async def on_relay(self, message: RelayMessage, ctx: MessageContext) -> SumMessage:
        answer = await self.send_message(AddMessage(message.a, message.b),
                                         AgentId("calculator", self.id.key))
        assert isinstance(answer, SumMessage)
        return answer


class AutogenRuntime(Runtime):
    name = "autogen"

    async def start(self, directory: Path) -> None:
        self.runtime = SingleThreadedAgentRuntime()
        await AutogenCalculator.register(self.runtime, "calculator",
                                         lambda: AutogenCalculator("adds two integers"))
        await AutogenRelay.register(self.runtime, "relay",
                                    lambda: AutogenRelay("asks the calculator"))
        self.runtime.start()

    async def stop(self) -> None:
        await self.runtime.stop_when_idle()

    def prepare(self, workload: str, values: list[tuple[int, int]]) -> list[Any]:
        if workload == "w1":
            return [(AddMessage(a, b), AgentId("calculator", "default"))
                    for a, b in values]
        return [(RelayMessage(a, b), AgentId("relay", "default")) for a, b in values]

    async def ask(self, request: Any) -> int:
        message, agent = request
        answer = await self.runtime.send_message(message, agent)
        return int(answer.value)


# --------------------------------------------------------------------------- LangGraph


class CalcState(TypedDict, total=False):
    a: int
    b: int
    request: tuple[int, int]
    answer: int
    value: int


async def _add(state: CalcState) -> dict[str, int]:
    return {"value": state["a"] + state["b"]}


async def _relay_ask(state: CalcState) -> dict[str, Any]:
    return {"request": (state["a"], state["b"])}


async def _calculator(state: CalcState) -> dict[str, int]:
    a, b = state["request"]
    return {"answer": a + b}


async def _relay_answer(state: CalcState) -> dict[str, int]:
    return {"value": state["answer"]}


class LanggraphRuntime(Runtime):
    def __init__(self, sqlite: bool, synchronous: str | None = None) -> None:
        self.sqlite = sqlite
        self.synchronous = synchronous  # None: the saver's own (SQLite's default, FULL)
        self.name = ("langgraph_sqlite_normal" if synchronous == "NORMAL"
                     else "langgraph_sqlite" if sqlite else "langgraph")
        self._saver_cm: Any = None

    async def start(self, directory: Path) -> None:
        from langgraph.graph import END, START, StateGraph

        saver = None
        if self.sqlite:
            from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

            directory.mkdir(parents=True, exist_ok=True)
            self._saver_cm = AsyncSqliteSaver.from_conn_string(
                str(directory / "langgraph.db"))
            saver = await self._saver_cm.__aenter__()
            await saver.setup()
            if self.synchronous:
                await saver.conn.execute(f"PRAGMA synchronous={self.synchronous}")
        one = StateGraph(CalcState)
        one.add_node("calculator", _add)
        one.add_edge(START, "calculator")
        one.add_edge("calculator", END)
        chain = StateGraph(CalcState)
        chain.add_node("relay_ask", _relay_ask)
        chain.add_node("calculator", _calculator)
        chain.add_node("relay_answer", _relay_answer)
        chain.add_edge(START, "relay_ask")
        chain.add_edge("relay_ask", "calculator")
        chain.add_edge("calculator", "relay_answer")
        chain.add_edge("relay_answer", END)
        self.graphs = {"w1": one.compile(checkpointer=saver),
                       "w2": chain.compile(checkpointer=saver)}

    async def stop(self) -> None:
        if self._saver_cm is not None:
            await self._saver_cm.__aexit__(None, None, None)

    def prepare(self, workload: str, values: list[tuple[int, int]]) -> list[Any]:
        graph = self.graphs[workload]
        # A conversation per request, as agentd's thread UUIDs: the saver keys by it.
        return [(graph, {"a": a, "b": b}, {"configurable": {"thread_id": str(uuid.uuid4())}})
                for a, b in values]

    async def ask(self, request: Any) -> int:
        graph, state, config = request
        out = await graph.ainvoke(state, config)
        return int(out["value"])


# ------------------------------------------------------------------------------ driver


async def concurrent(rt: Runtime, workload: str, n: int,
                     cpu: list[tuple[float, float]] | None = None) -> float:
    """`n` requests over CONVERSATIONS concurrent conversations; requests per second.
    With `cpu`, the CPU per request in microseconds is appended to it: this process
    (every thread: the event loop, aiosqlite's) and its children (agentd's writer)."""
    values = operands(n)
    requests = rt.prepare(workload, values)
    work = iter(zip(requests, values, strict=True))
    ask = rt.ask

    async def conversation() -> None:
        for request, (a, b) in work:
            got = await ask(request)
            if got != a + b:
                raise AssertionError(f"{rt.name} {workload}: {a}+{b} answered {got}")

    before = tree_cpu_ns(os.getpid())
    t0 = time.perf_counter()
    await asyncio.gather(*(conversation() for _ in range(CONVERSATIONS)))
    rate = n / (time.perf_counter() - t0)
    if cpu is not None:
        after = tree_cpu_ns(os.getpid())
        cpu.append(((after[0] - before[0]) / 1e3 / n, (after[1] - before[1]) / 1e3 / n))
    return rate


async def sequential(rt: Runtime, n: int) -> list[float]:
    """One w1 conversation at a time: each round trip, in seconds."""
    values = operands(n)
    requests = rt.prepare("w1", values)
    out = []
    for request, (a, b) in zip(requests, values, strict=True):
        t0 = time.perf_counter()
        got = await rt.ask(request)
        out.append(time.perf_counter() - t0)
        if got != a + b:
            raise AssertionError(f"{rt.name}: {a}+{b} answered {got}")
    return out


def fdatasync_us(directory: Path, n: int = 50) -> float:
    """The median fdatasync of one 4 KiB write in `directory`, in microseconds: what each
    commit of a synchronous=FULL database waits for, on the disk the savers use."""
    path = directory / "fdatasync.probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        times = []
        for i in range(n):
            os.pwrite(fd, b"x" * 4096, (i % 16) * 4096)
            t0 = time.perf_counter()
            os.fdatasync(fd)
            times.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
        path.unlink()
    return statistics.median(times) * 1e6


def _make(name: str) -> Runtime:
    factories: dict[str, Callable[[], Runtime]] = {
        "agentd": lambda: AgentdRuntime(True),
        "agentd_full": lambda: AgentdRuntime(True, synchronous="FULL"),
        "agentd_nojournal": lambda: AgentdRuntime(False),
        "autogen": AutogenRuntime,
        "langgraph": lambda: LanggraphRuntime(False),
        "langgraph_sqlite": lambda: LanggraphRuntime(True),
        "langgraph_sqlite_normal": lambda: LanggraphRuntime(True, "NORMAL"),
    }
    return factories[name]()


async def bench(quick: bool, dsn: str | None = None) -> dict[str, Any]:
    n = 1500 if quick else 8000
    n_seq = 200 if quick else 1000
    names = RUNTIMES + (("agentd_postgres",) if dsn else ())
    rates: dict[tuple[str, str], list[float]] = {
        (r, w): [] for r in names for w in ("w1", "w2")}
    p50s: dict[str, list[float]] = {r: [] for r in names}
    cpus: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in rates}
    syncs: list[float] = []  # the disk's fdatasync median, each round
    with tempfile.TemporaryDirectory(prefix="agentd-peers-") as tmp:
        runtimes = [_make(name) for name in RUNTIMES]
        if dsn:
            runtimes.append(AgentdRuntime(True, dsn))
        started: list[Runtime] = []
        try:
            for rt in runtimes:
                await rt.start(Path(tmp) / rt.name)
                started.append(rt)
            tune_gc()  # as the daemon does once started; the same for every runtime
            for rt in runtimes:  # warm-up: imports, schema caches, SQLite pages
                size = n // 10 if rt.name in SLOW else n // 3
                await concurrent(rt, "w1", size)
                await concurrent(rt, "w2", size)
                await sequential(rt, 50)
            for r in range(ROUNDS):
                order = runtimes[r % len(runtimes):] + runtimes[:r % len(runtimes)]
                for rt in order:
                    size = n // 10 if rt.name in SLOW else n
                    for w in ("w1", "w2"):
                        rates[(rt.name, w)].append(
                            await concurrent(rt, w, size, cpus[(rt.name, w)]))
                    lat = await sequential(rt, n_seq // 4 if rt.name in SLOW else n_seq)
                    p50s[rt.name].append(statistics.median(lat))
                syncs.append(fdatasync_us(Path(tmp)))
                print(f"round {r}: fdatasync {syncs[-1]:.0f}us  " + "  ".join(
                    f"{rt.name} {rates[(rt.name, 'w1')][-1]:,.0f}/{rates[(rt.name, 'w2')][-1]:,.0f}"
                    f"/{p50s[rt.name][-1] * 1e6:.0f}us" for rt in runtimes), flush=True)
        finally:
            for rt in started:
                await rt.stop()
    return report(rates, p50s, cpus, syncs)


def _per_round(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True)]


def report(rates: dict[tuple[str, str], list[float]], p50s: dict[str, list[float]],
           cpus: dict[tuple[str, str], list[tuple[float, float]]], syncs: list[float]
           ) -> dict[str, Any]:
    result: dict[str, Any] = {"conversations": CONVERSATIONS, "rounds": ROUNDS}
    print(f"\n{'runtime':<24} {'w1 pairs/s':>12} {'w2 chains/s':>12} {'p50 us':>8}"
          "   (medians; per-round spread min..max)")
    for name in p50s:
        w1, w2, p50 = rates[(name, "w1")], rates[(name, "w2")], p50s[name]
        print(f"{name:<24} {statistics.median(w1):>12,.0f} {statistics.median(w2):>12,.0f} "
              f"{statistics.median(p50) * 1e6:>8.0f}   w1 {min(w1):,.0f}..{max(w1):,.0f}, "
              f"w2 {min(w2):,.0f}..{max(w2):,.0f}, p50 {min(p50) * 1e6:.0f}..{max(p50) * 1e6:.0f}")
        for w in ("w1", "w2"):
            result[f"{name}_{w}_pairs_per_s"] = round(statistics.median(rates[(name, w)]))
        result[f"{name}_p50_us"] = round(statistics.median(p50) * 1e6, 1)
    # CPU per pair: this process's threads and its children (agentd's writer process;
    # a PostgreSQL server's own CPU is not counted), medians over rounds.
    print(f"\n{'runtime':<24} {'w1 CPU us/pair':>15} {'of it children':>15} "
          f"{'w2 CPU us/chain':>16}")
    for name in p50s:
        w1 = [own + child for own, child in cpus[(name, "w1")]]
        w2 = [own + child for own, child in cpus[(name, "w2")]]
        children = statistics.median(child for _, child in cpus[(name, "w1")])
        print(f"{name:<24} {statistics.median(w1):>15,.1f} {children:>15,.1f} "
              f"{statistics.median(w2):>16,.1f}")
        result[f"{name}_w1_cpu_us_per_pair"] = round(statistics.median(w1), 1)
        result[f"{name}_w2_cpu_us_per_pair"] = round(statistics.median(w2), 1)
        if name.startswith("agentd") and name != "agentd_nojournal":  # a writer process
            result[f"{name}_w1_writer_cpu_us_per_pair"] = round(children, 1)
    ratios = {
        "agentd_over_autogen_w1": _per_round(rates[("agentd", "w1")], rates[("autogen", "w1")]),
        "agentd_over_autogen_w2": _per_round(rates[("agentd", "w2")], rates[("autogen", "w2")]),
        "agentd_p50_over_autogen_w1": _per_round(p50s["agentd"], p50s["autogen"]),
        "agentd_over_langgraph_sqlite_w1": _per_round(rates[("agentd", "w1")],
                                                      rates[("langgraph_sqlite", "w1")]),
        "agentd_over_langgraph_sqlite_normal_w1": _per_round(
            rates[("agentd", "w1")], rates[("langgraph_sqlite_normal", "w1")]),
        "agentd_full_over_langgraph_sqlite_w1": _per_round(
            rates[("agentd_full", "w1")], rates[("langgraph_sqlite", "w1")]),
    }
    if "agentd_postgres" in p50s:  # the kernel on PostgreSQL over the kernel on SQLite
        ratios["postgres_over_sqlite_w1"] = _per_round(rates[("agentd_postgres", "w1")],
                                                       rates[("agentd", "w1")])
        ratios["postgres_over_sqlite_w2"] = _per_round(rates[("agentd_postgres", "w2")],
                                                       rates[("agentd", "w2")])
    # CPU per w1 pair, agentd's (its writer's included) over AutoGen's: steadier than
    # a ratio of wall-clock rates on a shared machine.
    ratios["agentd_cpu_over_autogen_w1"] = _per_round(
        [own + child for own, child in cpus[("agentd", "w1")]],
        [own + child for own, child in cpus[("autogen", "w1")]])
    targets = {"postgres_over_sqlite_w1": ">= 0.5", "postgres_over_sqlite_w2": ">= 0.5",
               "agentd_over_autogen_w1": ">= 1.0",
               "agentd_over_langgraph_sqlite_w1": ">= 30"}
    for key, per_round in ratios.items():
        result[key] = round(statistics.median(per_round), 3)
        target = f"target {targets[key]}" if key in targets else "no target"
        print(f"{key}: {result[key]} ({target}); per round "
              + " ".join(f"{x:.2f}" for x in per_round))
    result["fdatasync_p50_us"] = round(statistics.median(syncs), 1)
    print(f"fdatasync_p50_us: {result['fdatasync_p50_us']} (this disk, one 4 KiB write "
          "each; per round " + " ".join(f"{x:.0f}" for x in syncs) + ")")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI sizes (under a minute)")
    args = parser.parse_args()
    with postgres.database() as dsn:
        result = run(bench(args.quick, dsn))
        if dsn is None:
            result["postgres"] = {"skipped": postgres.skipped()}
        else:
            result["postgres_round_trips_per_batch"] = postgres.round_trips_per_batch(dsn)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
