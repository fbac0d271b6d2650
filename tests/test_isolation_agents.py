"""LLM agents in worker processes: the agent loop runs confined, every model call
goes through the daemon's platform (a fake provider on loopback), and the worker's
requests are attacked: outside a call, out of scope, over the caps."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agentd._handler import HandlerMetadata, ResponseKind
from agentd.isolation import IsolationPools
from agentd.isolation._agent import AgentBridge, CallContext, checked_state
from agentd.isolation._protocol import ProtocolError
from agentd.kernel import Kernel
from agentd.platform import AgentHandlers, Platform, make_agent_handlers
from agentd.platform.demo import MathQuestion
from agentd.testing import Harness
from agentd.tools.calculator import Sum
from tests.isolated.handlers import Probe
from tests.llm_servers import (
    MUL_NS,
    FakeLLM,
    Reply,
    Seen,
    add_call,
    load,
    numbers,
    openai_backend,
    organism_yaml,
)
from tests.test_agents import add_three, answered, child, kinds, scripted
from tests.test_agents import organism as agents_organism

ISOLATED = "\n    isolation: {workers: 2, memory_mb: 2048}"


@asynccontextmanager
async def organism(config_text: str, **platform_kw: Any
                   ) -> AsyncIterator[tuple[Harness, AgentHandlers]]:
    # The state folder apart from the code the workers read (the demo's is inside it).
    with tempfile.TemporaryDirectory(prefix="agentd-iso-agents-") as state:
        async with agents_organism(f"state_dir: {state}\n{config_text}",
                                   **platform_kw) as both:
            yield both


async def until(condition: Callable[[], bool]) -> None:
    """Until `condition` holds (background work after a kill), at most 30 s."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def bridge_of(h: Harness) -> AgentBridge:
    bridge = h.isolation.pools["tutor"].bridge
    assert isinstance(bridge, AgentBridge)
    return bridge


def clean(h: Harness, handlers: AgentHandlers) -> bool:
    """Nothing of the task is left: not in the platform, not in the bridge, and the
    in-process loop (which the isolated listener does not use) never saw it."""
    return (handlers.platform.open_tasks == 0 and bridge_of(h).open_tasks() == 0
            and handlers["tutor"].tasks == {})  # type: ignore[attr-defined]


async def test_an_isolated_agent_calls_tools_and_answers_through_the_daemon() -> None:
    async with FakeLLM("openai", scripted(add_three)) as server, \
            organism(organism_yaml(openai_backend(server), tutor_extra=ISOLATED)) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="Add 2, 3 and 10."))
        assert kinds(frames) == [("core", "accepted"), ("tutor", "answer")]
        assert answered(frames) == "2 + 3 + 10 = 15."
        assert len(server.requests) == 3  # every model call made by the daemon
        third = server.requests[2].conversation()
        assert [r.source for r in third.results] == ["result:calculator.add"] * 2
        pool = h.isolation.pools["tutor"]
        assert pool.spec.policy.network is False and pool.status()["workers"] == 2
        assert clean(h, hs)


async def test_parallel_calls_and_notices_cross_workers() -> None:
    # Two results come back as two calls, spread over two workers: the task's state
    # travels with each call. The invalid call in the same reply becomes a notice.
    def script(seen: Seen, got: list[int]) -> str:
        conv = seen.conversation()
        if not conv.results:
            return (f"{add_call(1, 2)}\n{add_call(10, 20)}\n"
                    f'<multiply xmlns="{MUL_NS}"><a>3</a><b>x</b></multiply>')
        if len(got) == 2:
            assert any("huh invalid-payload" in r.content for r in conv.results)
            return f'<multiply xmlns="{MUL_NS}"><a>3</a><b>4</b></multiply>'
        return f"Results: {sorted(got)}"

    async with FakeLLM("openai", scripted(script)) as server, \
            organism(organism_yaml(openai_backend(server), tutor_extra=ISOLATED)) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="Sums."))
        assert answered(frames) == "Results: [3, 12, 30]"
        assert len(server.requests) == 3
        assert clean(h, hs)


async def test_concurrent_tasks_queue_for_one_worker_without_mixing() -> None:
    # More tasks than workers: calls wait for the worker; none is written behind a
    # running one (its pipe carries the replies to the running call's requests).
    def script(seen: Seen, got: list[int]) -> str:
        (k,) = numbers(seen.conversation().task)[:1]
        return add_call(k, k) if not got else f"{k} doubled is {got[0]}."

    async with FakeLLM("openai", scripted(script)) as server, \
            organism(organism_yaml(openai_backend(server),
                                   tutor_extra="\n    isolation: {workers: 1, memory_mb: 2048}")
                     ) as (h, hs):
        results = await asyncio.gather(*(
            h.send("alice", MathQuestion(text=f"What is {k} doubled?")) for k in range(12)))
        assert [answered(f) for f in results] == [f"{k} doubled is {2 * k}." for k in range(12)]
        assert h.isolation.pools["tutor"].restarts == 0
        assert clean(h, hs)


async def test_the_iteration_cap_holds_in_a_worker() -> None:
    async with FakeLLM("openai", [add_call(1, 1)]) as server, \
            organism(organism_yaml(openai_backend(server), agent=", max_iterations: 3",
                                   tutor_extra=ISOLATED)) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="Loop forever."))
        assert "all 3 model turns" in answered(frames)
        assert len(server.requests) == 3
        assert clean(h, hs)


async def test_a_budget_refusal_reaches_the_worker_as_budget_exceeded() -> None:
    script = [Reply(add_call(1, 2), input_tokens=2900, output_tokens=50)]
    async with FakeLLM("openai", script) as server, \
            organism(organism_yaml(openai_backend(server),
                                   agent=", token_budget: 3000, max_tokens: 200",
                                   tutor_extra=ISOLATED)) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="Spend."))
        assert kinds(frames) == [("core", "accepted"), ("core", "huh")]
        assert child(frames[-1], "code") == "budget-exceeded"
        assert len(server.requests) == 1
        assert clean(h, hs)


async def test_a_model_slower_than_the_timeout_kills_the_worker_and_ends_the_task() -> None:
    async with FakeLLM("openai", [Reply("too late", delay_s=1.0)]) as server, \
            organism(organism_yaml(openai_backend(server), agent=", token_budget: 100000",
                                   tutor_extra=ISOLATED + "\n    timeout_s: 0.3")) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="Think slowly."))
        assert child(frames[-1], "code") == "timeout"
        assert clean(h, hs)
        # The model call is abandoned, and the worker replaced, just after the kill.
        pool = h.isolation.pools["tutor"]
        await until(lambda: hs.platform.budgets.reserved == 0 and pool.restarts == 1)
    assert server.requests  # the call was made, by the daemon, and abandoned


async def test_a_handler_that_forges_a_platform_request_is_replaced() -> None:
    # A handler's worker has no bridge: an ASK frame written on its protocol pipe
    # breaks the protocol, the worker is killed, the call gets huh internal.
    text = organism_yaml('{name: primary, provider: openai, model: m, '
                         'base_url: "http://127.0.0.1:9/v1"}',
                         extra_listeners="""
  - name: prober
    payload_class: tests.isolated.handlers:Probe
    response_class: tests.isolated.handlers:Outcome
    handler: tests.isolated.handlers:probe
    description: Runs probes.
    isolation: {workers: 1}""")
    text = text.replace("listeners: [tutor,", "listeners: [prober, tutor,")
    async with organism(text) as (h, _):
        frames = await h.send("alice", Probe("ask-platform", ""))
        assert child(frames[-1], "code") == "internal"
        pool = h.isolation.pools["prober"]
        await until(lambda: pool.restarts == 1 and not pool.status()["starting"])
        assert pool.restarts == 1
        from agentd import _metrics
        assert (_metrics.REGISTRY.get_sample_value(
            "agentd_worker_restarts_total", {"listener": "prober", "reason": "protocol"}) or 0) >= 1
        frames = await h.send("alice", Probe("echo", "still here"))
        assert frames[-1].count(b"still here") == 1


async def test_a_task_is_restored_in_a_worker_after_a_restart(tmp_path: Path) -> None:
    # The daemon restarts between the tool call and its result: the new bridge knows
    # nothing of the task, so the worker asks for the durable history and goes on.
    thread = "5b7c1d52-3b9e-4c1e-9a57-2b1f0c3d4e5f"
    async with FakeLLM("openai", [add_call(2, 3), "It is 5."]) as server:
        config = load(f"state_dir: {tmp_path}\n" + organism_yaml(
            openai_backend(server), tutor_extra=ISOLATED))
        async with await Kernel.open(tmp_path) as kernel:
            outs = []
            for payload, meta in (
                    (MathQuestion(text="2 + 3?"), HandlerMetadata(thread, "alice", "tutor")),
                    (Sum(value=5), HandlerMetadata(thread, "calculator.add", "tutor",
                                                   redelivered=True))):
                agents = make_agent_handlers(config, kernel=kernel)
                pools = IsolationPools()
                try:
                    outs.append(await (await pools.apply(config, agents=agents))["tutor"](
                        payload, meta))
                    bridge = pools.pools["tutor"].bridge
                finally:
                    await pools.stop()
                    await agents.platform.aclose()
                await kernel.flush()
    first, second = outs
    assert first is not None and first.kind is ResponseKind.SEND
    assert second is not None and second.kind is ResponseKind.RESPOND
    assert isinstance(second.payload, bytes) and b"<text>It is 5.</text>" in second.payload
    assert server.requests[1].conversation().replies == [add_call(2, 3)]
    assert bridge.open_tasks() == 0


# ---- the bridge, attacked directly (a real platform, no worker) ----------------------


@pytest.fixture
async def bridge() -> AsyncIterator[tuple[AgentBridge, Platform]]:
    async with FakeLLM("openai", ["one", "two", "three", "four"]) as server:
        config = load(organism_yaml(openai_backend(server), agent=", max_iterations: 2"))
        # (no worker here: the state folder's place does not matter)
        platform = Platform.from_config(config)
        lst = config.listener("tutor")
        from agentd._xmlify import spec_of

        yield AgentBridge(platform.session("tutor"), platform, 2,
                          {spec_of(c).clark for c in lst.payload_classes}), platform
        await platform.aclose()


def task_call(thread: str = "t-1") -> CallContext:
    task = MathQuestion(text="2 + 2?")
    from agentd import to_xml

    return CallContext(HandlerMetadata(thread, "alice", "tutor"),
                       "{https://xml-pipeline.org/ns/agents/math-tutor/v1}mathquestion",
                       to_xml(task), task)


def result_call(thread: str = "t-1") -> CallContext:
    from agentd import to_xml

    result = Sum(value=4)
    return CallContext(HandlerMetadata(thread, "calculator.add", "tutor"),
                       "{https://xml-pipeline.org/ns/calculator/add/v1}sum", to_xml(result), result)


async def test_begin_only_once_and_only_for_a_task(bridge: tuple[AgentBridge, Platform]) -> None:
    b, platform = bridge
    with pytest.raises(ProtocolError):
        await b.ask(result_call(), {"op": "begin"}, b"")
    ctx = task_call()
    assert await b.ask(ctx, {"op": "begin"}, b"<forged>task</forged>") == ({}, b"")
    # the task recorded is the payload the daemon sent, not the worker's text
    (turn,) = await platform.read_history("tutor", "t-1")
    assert "2 + 2?" in turn.content and "forged" not in turn.content
    with pytest.raises(ProtocolError):
        await b.ask(ctx, {"op": "begin"}, b"")


async def test_results_are_the_daemons_rendering_once_per_call(
        bridge: tuple[AgentBridge, Platform]) -> None:
    b, platform = bridge
    await b.ask(task_call(), {"op": "begin"}, b"")
    with pytest.raises(ProtocolError):  # the task's own call carries no result
        await b.ask(task_call(), {"op": "record"}, b"")
    ctx = result_call()
    await b.ask(ctx, {"op": "record"}, b"<sum><value>999</value></sum>")
    with pytest.raises(ProtocolError):
        await b.ask(ctx, {"op": "record"}, b"")
    turns = await platform.read_history("tutor", "t-1")
    assert "<value>4</value>" in turns[-1].content and "999" not in turns[-1].content
    await b.ask(ctx, {"op": "record", "notice": True}, b"huh invalid-payload: fix it")
    assert (await platform.read_history("tutor", "t-1"))[-1].source == "platform"
    with pytest.raises(ProtocolError):
        await b.ask(ctx, {"op": "record", "notice": True}, b"x" * 70_000)


async def test_model_calls_are_counted_here(bridge: tuple[AgentBridge, Platform]) -> None:
    b, _ = bridge
    ctx = task_call()
    assert (await b.ask(ctx, {"op": "complete"}, b""))[0] == {"error": "isolation"}  # no task
    await b.ask(ctx, {"op": "begin"}, b"")
    assert await b.ask(ctx, {"op": "complete"}, b"") == ({}, b"one")
    assert await b.ask(ctx, {"op": "complete"}, b"") == ({}, b"two")
    # max_iterations is 2, whatever the worker says its state is
    b.answered(ctx, {"state": {"phase": "thinking", "iterations": 0, "pending": 0}})
    assert await b.ask(ctx, {"op": "complete"}, b"") == ({"error": "budget"}, b"")
    await b.ask(ctx, {"op": "end"}, b"")
    assert b.open_tasks() == 0


async def test_a_request_for_another_thread_cannot_be_made(
        bridge: tuple[AgentBridge, Platform]) -> None:
    b, _ = bridge
    await b.ask(task_call("t-1"), {"op": "begin"}, b"")
    # A thread field is ignored: the scope is the call's own thread, which has no task.
    reply = await b.ask(result_call("t-2"), {"op": "complete", "thread": "t-1"}, b"")
    assert reply == ({"error": "isolation"}, b"")
    reply = await b.ask(result_call("t-2"), {"op": "end", "thread": "t-1"}, b"")
    assert reply == ({"error": "isolation"}, b"")
    assert b.iterations == {"t-1": 0}


@pytest.mark.parametrize("header", [
    {"op": "exec"}, {"op": None}, {"op": "record", "notice": "yes"},
    {"op": "unfold", "segments": "1"}, {"op": "unfold", "segments": [-1]},
    {"op": "unfold", "segments": list(range(65))},
])
async def test_malformed_requests_break_the_protocol(
        bridge: tuple[AgentBridge, Platform], header: dict[str, Any]) -> None:
    b, _ = bridge
    ctx = task_call()
    await b.ask(ctx, {"op": "begin"}, b"")
    with pytest.raises(ProtocolError):
        await b.ask(ctx, header, b"")


@pytest.mark.parametrize("state", [
    "thinking", {"phase": "dreaming", "iterations": 0, "pending": 0},
    {"phase": "waiting", "iterations": 3, "pending": 0},
    {"phase": "waiting", "iterations": 0, "pending": -1},
    {"phase": "waiting", "iterations": True, "pending": 0},
    {"phase": "waiting", "iterations": 0, "pending": 0, "extra": 1},
])
def test_a_state_out_of_bounds_breaks_the_protocol(state: Any) -> None:
    with pytest.raises(ProtocolError):
        checked_state(state, max_iterations=2)


async def test_a_state_for_no_live_task_is_not_kept(bridge: tuple[AgentBridge, Platform]) -> None:
    b, _ = bridge
    ctx = result_call("nobody")
    b.answered(ctx, {"state": {"phase": "waiting", "iterations": 1, "pending": 1}})
    assert b.states == {} and b.call_fields(ctx) == {"state": None}
