"""Native tool calls of an isolated agent: the agent's loop runs in a worker process,
the model's calls come back through the daemon, which decides them (payload or the
call's error result), sends its own payloads for the ids the worker names, and
matches each result to its call. Against fake providers on loopback speaking the
OpenAI and Anthropic protocols; and the worker attacked (a real hostile worker
process, and the daemon's side driven directly)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentd import to_xml
from agentd._core import Huh
from agentd._errors import HuhCode
from agentd._handler import HandlerMetadata, ResponseKind
from agentd.isolation import IsolationPools
from agentd.isolation._agent import AgentBridge, CallContext
from agentd.isolation._protocol import ProtocolError
from agentd.kernel import Kernel
from agentd.platform import Platform, make_agent_handlers
from agentd.platform.demo import MathQuestion
from agentd.tools.calculator import Sum
from tests.isolated import hostile_agent
from tests.isolated.hostile_agent import HostileTask
from tests.llm_servers import FakeLLM, Reply, Seen, load, openai_backend, organism_yaml
from tests.test_agents import answered, child, kinds
from tests.test_isolation_agents import ISOLATED, clean, organism, until
from tests.test_native_agents import PROTOCOLS, call, data, results

NATIVE = ", tool_calling: native"
ADD_NS = "https://xml-pipeline.org/ns/calculator/add/v1"


def meet_organism(backend: str, agent: str = NATIVE) -> str:
    from tests.organisms import meet

    extra = meet.listeners("left", "right")
    return organism_yaml(backend, agent=agent, tutor_extra=ISOLATED,
                         peers="[left, right, calculator.add]", extra_listeners=extra
                         ).replace("listeners: [tutor, calculator.add, calculator.multiply, echo]",
                                   "listeners: [tutor, left, right, calculator.add]")


@pytest.mark.both_loops
@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_isolated_agent_round_trips_parallel_native_calls(protocol: str) -> None:
    """Two calls of one reply run at the same time (each `meet` answers `met` only if
    the other arrived meanwhile) and come back under their ids; the next reply has
    two calls to one listener (the second waits for the first's result) and one that
    fails its schema, which is answered to the model and never sent."""
    from tests.organisms import meet

    meet.ARRIVED.clear()
    meet.BOTH = asyncio.Event()
    script = [Reply(calls=[call("l1", "left", side="l"), call("r1", "right", side="r")]),
              Reply("Adding.", calls=[call("a1", "calculator__add", a=2, b=3),
                                      call("a2", "calculator__add", a=40, b=2),
                                      call("bad", "calculator__add", a="two", b=1)]),
              Reply("met, 5 and 42")]
    async with FakeLLM(protocol, script) as server, \
            organism(meet_organism(openai_backend(server))) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="meet, then add"))
        assert answered(frames) == "met, 5 and 42"
        assert clean(h, hs)
        assert h.isolation.pools["tutor"].restarts == 0
    first, second, third = server.requests
    assert "tools" in first.json and "tools" in third.json
    got = results(second)
    assert set(got) == {"l1", "r1"} and not any(e for _, e in got.values())
    assert "<met>true</met>" in got["l1"][0] and "<side>l</side>" in got["l1"][0]
    assert "<met>true</met>" in got["r1"][0] and "<side>r</side>" in got["r1"][0]
    got = results(third)
    assert data(got["a1"][0]).endswith("<value>5</value></sum>") and not got["a1"][1]
    assert data(got["a2"][0]).endswith("<value>42</value></sum>") and not got["a2"][1]
    assert got["bad"][1] and "do not match the tool's schema" in got["bad"][0]
    for seen in server.requests:
        assert seen.orphans() == []


@pytest.mark.both_loops
async def test_an_isolated_auto_agent_falls_back_to_xml_on_a_backend_without_tools() -> None:
    add = f'<add xmlns="{ADD_NS}"><a>2</a><b>3</b></add>'

    def script(seen: Seen) -> Reply | str:
        if "tools" in seen.json:
            return Reply(status=400, body=b'{"error": {"message": "tools unsupported"}}')
        return add if not seen.conversation().results else "It is 5."

    async with FakeLLM("openai", script) as server, \
            organism(organism_yaml(openai_backend(server), tutor_extra=ISOLATED)) as (h, hs):
        frames = await h.send("alice", MathQuestion(text="2 + 3?"))
        assert answered(frames) == "It is 5."
        assert clean(h, hs)
    assert ["tools" in s.json for s in server.requests] == [True, False, False]


# ---- a crash between the model's reply and the dispatch --------------------------------


async def test_an_isolated_agents_call_id_is_sent_once_across_a_crash(tmp_path: Path) -> None:
    """As in process: the reply with call m1 is in the durable history, the daemon
    dies before the pump commits what the worker sent, so the result that led to the
    reply comes again to a new daemon's worker: m1 goes again under its id, from the
    history, the model is not asked again, and sees m1 once with its result."""
    thread = "0c4b1f4e-8a51-4c47-9f0e-2a6d8e1b5c93"
    script = [Reply(calls=[call("a1", "calculator__add", a=2, b=3)]),
              Reply(calls=[call("m1", "calculator__multiply", a=5, b=7)]),
              Reply("It is 35.")]

    async def daemon(kernel: Kernel, *calls: tuple[Any, HandlerMetadata]) -> list[Any]:
        agents = make_agent_handlers(config, kernel=kernel)
        pools = IsolationPools()
        try:
            handler = (await pools.apply(config, agents=agents))["tutor"]
            return [await handler(payload, meta) for payload, meta in calls]
        finally:
            await pools.stop()
            await agents.platform.aclose()
            await kernel.flush()

    async with FakeLLM("openai", script) as server:
        config = load(f"state_dir: {tmp_path}\n" + organism_yaml(
            openai_backend(server), agent=NATIVE, tutor_extra=ISOLATED))
        async with await Kernel.open(tmp_path) as kernel:
            first, second = await daemon(
                kernel, (MathQuestion(text="(2 + 3) * 7?"),
                         HandlerMetadata(thread, "alice", "tutor", _seq=41)),
                (Sum(value=5), HandlerMetadata(thread, "calculator.add", "tutor", _seq=42,
                                               _ref="1.0")))
            assert first.targets == ("calculator.add",)
            assert second.targets == ("calculator.multiply",)
            # kill -9: message 42 comes back to a new daemon, its workers new too
            again, done = await daemon(
                kernel, (Sum(value=5), HandlerMetadata(thread, "calculator.add", "tutor",
                                                       redelivered=True, _seq=42, _ref="1.0")),
                (Sum(value=35), HandlerMetadata(thread, "calculator.multiply", "tutor",
                                                _seq=43, _ref="2.0")))
    assert again.kind is ResponseKind.SEND and again.targets == ("calculator.multiply",)
    assert again.payload == second.payload
    assert done.kind is ResponseKind.RESPOND and b"It is 35." in done.payload
    assert len(server.requests) == 3  # asked once per reply, not again after the crash
    last = server.requests[-1]
    assert last.calls() == [("a1", "calculator__add"), ("m1", "calculator__multiply")]
    assert last.orphans() == [] and "<value>35</value>" in results(last)["m1"][0]


async def test_an_isolated_agents_output_refused_whole_answers_each_call(
        tmp_path: Path) -> None:
    """The pump refuses the worker's output whole (a core huh with no ref: none of its
    calls went out): the daemon records it as the error result of each of the two
    open calls, and the worker, told so, counts both, so the model's turn comes
    (the task does not wait for results that never come)."""
    thread = "5e2d7c1a-9b3f-4d6e-8a2c-1f0e9d8c7b6a"
    script = [Reply(calls=[call("a1", "calculator__add", a=1, b=2),
                           call("a2", "calculator__add", a=3, b=4)]),
              Reply("gave up")]
    async with FakeLLM("openai", script) as server:
        config = load(f"state_dir: {tmp_path}\n" + organism_yaml(
            openai_backend(server), agent=NATIVE, tutor_extra=ISOLATED))
        agents = make_agent_handlers(config)
        pools = IsolationPools()
        try:
            tutor = (await pools.apply(config, agents=agents))["tutor"]
            out = await tutor(MathQuestion(text="1 + 2, 3 + 4?"),
                              HandlerMetadata(thread, "alice", "tutor"))
            assert out is not None and out.refs == ("1.0", "1.1")
            done = await tutor(Huh.of(HuhCode.TOO_LARGE),
                               HandlerMetadata(thread, "core", "tutor"))
            assert pools.pools["tutor"].restarts == 0
        finally:
            await pools.stop()
            await agents.platform.aclose()
    assert done is not None and done.kind is ResponseKind.RESPOND
    assert b"gave up" in done.payload
    got = results(server.requests[1])
    assert set(got) == {"a1", "a2"}
    assert all(error and "huh too-large" in text for text, error in got.values())


# ---- a hostile worker (a real process) -------------------------------------------------


def hostile_organism(backend: str) -> str:
    extra = """\
  - name: tally
    payload_class: tests.isolated.hostile_agent:Tally
    response_class: tests.isolated.hostile_agent:Tallied
    handler: tests.isolated.hostile_agent:tally
    description: Counts a call.
"""
    return organism_yaml(
        backend, agent=NATIVE, peers="[tally]", extra_listeners=extra,
        tutor_extra="\n    isolation: {workers: 1, memory_mb: 2048}",
    ).replace("agentd.platform.demo:MathQuestion", "tests.isolated.hostile_agent:HostileTask"
              ).replace("listeners: [tutor, calculator.add, calculator.multiply, echo]",
                        "listeners: [tutor, tally]")


TWO_TALLIES = [Reply(calls=[call("t1", "tally", tag="one"), call("t2", "tally", tag="two")]),
               Reply("counted")]
# Two replies of one call each: the second reply's call is given to another call of
# the worker, which names the first one's id again (replay).
TALLY_TWICE = [Reply(calls=[call("t1", "tally", tag="one")]),
               Reply(calls=[call("t2", "tally", tag="two")]), Reply("counted")]


@pytest.mark.both_loops
@pytest.mark.parametrize(("attack", "ran"), [
    ("duplicate", []), ("forge", []), ("own-output", []), ("replay", ["one"])])
async def test_a_hostile_worker_cannot_send_a_call_id_twice_or_one_it_was_not_given(
        attack: str, ran: list[str]) -> None:
    """Two calls to `tally` (in one reply; for `replay`, one reply each). Whatever the
    worker names, a call id goes out at most once, and only to the call the daemon
    gave it to; the worker that tries otherwise is replaced, its call gets `huh`."""
    script = TALLY_TWICE if attack == "replay" else TWO_TALLIES
    hostile_agent.TALLIED.clear()
    async with FakeLLM("openai", script) as server, \
            organism(hostile_organism(openai_backend(server))) as (h, hs):
        pool = h.isolation.pools["tutor"]
        frames = await h.send("alice", HostileTask(attack=attack))
        assert kinds(frames)[-1] == ("core", "huh") and child(frames[-1], "code") == "internal"
        await until(lambda: pool.restarts == 1)
        assert ran == hostile_agent.TALLIED
        # the model never saw a result of the calls the attack was on
        assert len(server.requests) == (2 if attack == "replay" else 1)
        await until(lambda: clean(h, hs))


@pytest.mark.both_loops
async def test_a_hostile_worker_cannot_record_a_result_under_another_calls_id() -> None:
    """The worker names call t2 (as an error) when t1's result is recorded: the daemon
    records each result under the id it matched, so the model sees the truth."""
    hostile_agent.TALLIED.clear()
    async with FakeLLM("anthropic", TWO_TALLIES) as server, \
            organism(hostile_organism(openai_backend(server))) as (h, hs):
        frames = await h.send("alice", HostileTask(attack="claim"))
        assert answered(frames) == "counted"
        assert h.isolation.pools["tutor"].restarts == 0
        assert clean(h, hs)
    assert hostile_agent.TALLIED == ["one", "two"]
    got = results(server.requests[1])
    assert "<tag>one</tag>" in got["t1"][0] and not got["t1"][1]
    assert "<tag>two</tag>" in got["t2"][0] and not got["t2"][1]
    assert server.requests[1].orphans() == []


# ---- the daemon's side, driven directly (a real platform, no worker) -------------------


@pytest.fixture
async def native_bridge() -> AsyncIterator[tuple[AgentBridge, Platform, FakeLLM]]:
    script = [Reply(calls=[call("a1", "calculator__add", a=1, b=2),
                           ("j1", "calculator__add", "[1, 2]"),
                           call("u1", "shell", cmd="id"),
                           call("a2", "calculator__add", a=3, b=4)])]
    async with FakeLLM("openai", script) as server:
        config = load(organism_yaml(openai_backend(server), agent=NATIVE))
        platform = Platform.from_config(config)
        from agentd._xmlify import spec_of

        lst = config.listener("tutor")
        yield AgentBridge(platform.session("tutor"), platform, 5,
                          {spec_of(c).clark for c in lst.payload_classes}), platform, server
        await platform.aclose()


def task_call() -> CallContext:
    task = MathQuestion(text="1 + 2, 3 + 4")
    return CallContext(HandlerMetadata("t-1", "alice", "tutor"),
                       "{https://xml-pipeline.org/ns/agents/math-tutor/v1}mathquestion",
                       to_xml(task), task)


def result_call(payload: Any, sender: str = "calculator.add", ref: str = "") -> CallContext:
    key = None if isinstance(payload, Huh) else "{https://xml-pipeline.org/ns/calculator/sum/v1}sum"
    return CallContext(HandlerMetadata("t-1", sender, "tutor", _ref=ref), key,
                       payload.to_bytes() if isinstance(payload, Huh) else to_xml(payload),
                       payload)


def send(ids: list[Any]) -> dict[str, Any]:
    return {"kind": "send", "to": None, "targets": [], "state": None, "calls": ids}


async def test_the_daemon_decides_the_calls_and_sends_only_the_ids_it_gave(
        native_bridge: tuple[AgentBridge, Platform, FakeLLM]) -> None:
    b, platform, _ = native_bridge
    first = task_call()
    await b.ask(first, {"op": "begin"}, b"")
    header, _ = await b.ask(first, {"op": "complete"}, b"")
    # arguments that are not an object, an unknown tool: error results, not sent; both
    # calls to calculator.add go at once, each under its ref
    assert header["native"] == {"calls": 2, "errors": 2, "send": ["a1", "a2"]}
    turns = await platform.read_history("tutor", "t-1")
    errors = {t.call_id: t.content for t in turns if t.is_error}
    assert "must be a JSON object" in errors["j1"] and "no tool named 'shell'" in errors["u1"]
    for forged in (["nope"], ["a1", "a1"], [7], [["a1"]], [], "a1"):
        with pytest.raises(ProtocolError):
            b.answer(first, send(forged), b"")
    with pytest.raises(ProtocolError):  # a payload of its own with the ids
        b.answer(first, send(["a1"]), b"<add/>")
    out = b.answer(first, send(["a1", "a2"]), b"")
    assert out is not None and out.kind is ResponseKind.SEND
    assert out.targets == ("calculator.add", "calculator.add") and out.refs == ("1.0", "1.3")
    assert b"<a>1</a><b>2</b>" in out.payload and b"<a>3</a><b>4</b>" in out.payload
    with pytest.raises(ProtocolError):  # once only
        b.answer(first, send(["a1"]), b"")
    # a1's result (ref 1.0): recorded under a1 whatever the worker claims; nothing
    # else may go now
    second = result_call(Sum(value=3), ref="1.0")
    header, _ = await b.ask(second, {"op": "record", "call_id": "a2", "is_error": True}, b"")
    assert header == {}
    with pytest.raises(ProtocolError):  # its own payload while a2 is open
        b.answer(second, {"kind": "send", "to": "calculator.add", "targets": []},
                 b'<add xmlns="' + ADD_NS.encode() + b'"><a>9</a><b>9</b></add>')
    # a second answer under a1's ref answers nothing
    again = result_call(Sum(value=666), ref="1.0")
    assert await b.ask(again, {"op": "record"}, b"") == ({"duplicate": True}, b"")
    # a2's refusal (a core huh under a2's ref) is a2's error result
    third = result_call(Huh(code=HuhCode.UNROUTABLE, message="no", retry_allowed=False),
                        sender="core", ref="1.3")
    assert await b.ask(third, {"op": "record"}, b"") == ({}, b"")
    turns = await platform.read_history("tutor", "t-1")
    by_id = {t.call_id: t for t in turns if t.call_id}
    assert not by_id["a1"].is_error and "<value>3</value>" in by_id["a1"].content
    assert by_id["a2"].is_error and "huh unroutable" in by_id["a2"].content
    assert b.calls == {}  # every call answered
