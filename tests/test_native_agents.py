"""Native tool calling end to end: an agent whose model calls its peers through the
provider's `tools` (OpenAI chat completions, Anthropic Messages), against fake
providers on loopback, through the pump (`agentd.testing.Harness`). Each call goes to
the listener its tool name maps to and no other, comes back under its call id, fails
as that call's error result without dispatch, survives a crash between the reply and
its dispatch under the same id, and stays with its result through the librarian."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest

from agentd._handler import HandlerMetadata, ResponseKind
from agentd.kernel import Kernel
from agentd.platform import PromptRegistry, make_agent_handlers
from agentd.platform.demo import MathQuestion
from agentd.tools.calculator import Sum
from tests.llm_servers import (
    FakeLLM,
    Reply,
    Seen,
    load,
    openai_backend,
    organism_yaml,
    values,
)
from tests.test_agents import answered, kinds, organism

PROTOCOLS = ["openai", "anthropic"]
FILES_NS = "https://xml-pipeline.org/ns/tools/file-read/v1"


def call(i: str, name: str, **arguments: Any) -> tuple[str, str, str]:
    return (i, name, json.dumps(arguments))


def results(seen: Seen) -> dict[str, tuple[str, bool]]:
    """Call id -> (result text, is an error) of every tool result in the request."""
    out: dict[str, tuple[str, bool]] = {}
    for m in seen.json["messages"]:
        if seen.protocol == "openai" and m["role"] == "tool":
            text = m["content"]
            out[m["tool_call_id"]] = (text, text.startswith("error:"))
        elif seen.protocol == "anthropic" and isinstance(m["content"], list):
            for b in m["content"]:
                if b["type"] == "tool_result":
                    out[b["tool_use_id"]] = (b["content"], b["is_error"])
    return out


def data(text: str) -> str:
    """The content of a result's data block."""
    m = re.search(r"\u27e7\n(.*)\n\u27e6", text, re.DOTALL)
    assert m is not None, text
    return m.group(1)


def native(protocol: str, script: Any) -> FakeLLM:
    return FakeLLM(protocol, script)


# ---- one call, several calls ------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_goes_to_its_listener_and_its_result_comes_back_under_its_id(
        protocol: str) -> None:
    script = [Reply("Adding.", calls=[call("c1", "calculator__add", a=2, b=40)]),
              Reply("It is 42.")]
    async with FakeLLM(protocol, script) as server, \
            organism(organism_yaml(openai_backend(server))) as (h, _):
        frames = await h.send("alice", MathQuestion(text="2 + 40?"))
    assert answered(frames) == "It is 42."
    first, second = server.requests
    names = [t["function"]["name"] if protocol == "openai" else t["name"]
             for t in first.json["tools"]]
    assert names == ["calculator__add", "calculator__multiply", "echo"]
    text, error = results(second)["c1"]
    assert not error
    # the answer's payload as C14N XML, in its data block
    assert data(text) == ('<sum xmlns="https://xml-pipeline.org/ns/calculator/sum/v1">'
                          "<value>42</value></sum>")
    assert second.orphans() == [] and second.calls() == [("c1", "calculator__add")]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_parallel_calls_each_get_their_own_result_even_to_one_listener(
        protocol: str) -> None:
    """Three calls in one reply, two of them to calculator.add: each result comes back
    under its own call's id (a listener's second call waits for its first)."""
    script = [Reply(calls=[call("a1", "calculator__add", a=2, b=3),
                           call("m1", "calculator__multiply", a=6, b=7),
                           call("a2", "calculator__add", a=40, b=60)]),
              Reply("done")]
    async with FakeLLM(protocol, script) as server, \
            organism(organism_yaml(openai_backend(server))) as (h, _):
        frames = await h.send("alice", MathQuestion(text="several"))
    assert answered(frames) == "done"
    got = {i: values([type("B", (), {"content": data(t)})()])  # type: ignore[list-item]
           for i, (t, _) in results(server.requests[1]).items()}
    assert got == {"a1": [5], "m1": [42], "a2": [100]}
    assert server.requests[1].orphans() == []


async def test_arguments_that_are_not_json_or_fail_the_schema_are_errors_and_not_sent(
        caplog: pytest.LogCaptureFixture) -> None:
    script = [Reply(calls=[("bad1", "calculator__add", "{a: 2"),
                           call("bad2", "calculator__add", a="two", b=1),
                           call("bad3", "shell", cmd="id")]),
              Reply("I could not.")]
    for protocol in PROTOCOLS:
        caplog.clear()
        async with FakeLLM(protocol, script) as server, \
                organism(organism_yaml(openai_backend(server))) as (h, _):
            with caplog.at_level(logging.DEBUG, logger="agentd"):
                frames = await h.send("alice", MathQuestion(text="2 + 2?"))
        assert answered(frames) == "I could not."
        got = results(server.requests[1])
        assert all(error for _, error in got.values())
        assert ("the arguments are not JSON" if protocol == "openai"
                else "the arguments must be a JSON object") in got["bad1"][0]
        assert "do not match the tool's schema" in got["bad2"][0] and "'two'" in got["bad2"][0]
        assert "no tool named 'shell'" in got["bad3"][0]
        if protocol == "openai":
            assert all(t.startswith("error: ") for t, _ in got.values())
        # nothing reached the calculator
        assert not [r for r in caplog.records if "calculator.add" in r.getMessage()
                    and "handler" in r.getMessage()]
        assert server.requests[1].orphans() == []


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_call_the_pump_refuses_is_that_calls_error_result(protocol: str) -> None:
    """A peer outside the conversation's profile: the pump refuses the call (`huh
    unroutable`), and the model gets it as the error result of that call."""
    extra = """\
  - name: secret
    payload_class: agentd.tools.echo:Echo
    response_class: agentd.tools.echo:EchoReply
    handler: agentd.tools.echo:echo
    description: Not in the public profile.
"""
    text = organism_yaml("{name: m, provider: replay, cassette: /dev/null}",
                         peers="[calculator.add, secret]", extra_listeners=extra)
    # a1 goes first: the refusal of s1 is matched by the listener it is about, not
    # taken for the answer of the oldest call in flight
    script = [Reply(calls=[call("a1", "calculator__add", a=1, b=1),
                           call("s1", "secret", text="hi")]), Reply("ok")]
    async with FakeLLM(protocol, script) as server:
        text = text.replace("{name: m, provider: replay, cassette: /dev/null}",
                            openai_backend(server)).replace("model: m", "model: primary")
        async with organism(text) as (h, _):
            frames = await h.send("alice", MathQuestion(text="x"))
    assert answered(frames) == "ok"
    got = results(server.requests[1])
    assert got["s1"][1] and "huh unroutable" in got["s1"][0]
    assert not got["a1"][1] and "<value>2</value>" in got["a1"][0]


# ---- two tools of one payload class (file-read twice) -----------------------------------


def files_organism(backend: str, tmp_path: Path, agent: str = "", tutor_extra: str = "") -> str:
    for folder, content in (("n", "from notes"), ("p", "from pages")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "a.txt").write_text(content)
    extra = "".join(f"""\
  - name: {name}
    tool: {{kind: file-read, root: {json.dumps(str(tmp_path / name[0]))}}}
""" for name in ("notes", "pages"))
    text = organism_yaml(backend, peers="[notes, pages]", extra_listeners=extra, agent=agent,
                         tutor_extra=tutor_extra)
    return text.replace("listeners: [tutor, calculator.add, calculator.multiply, echo]",
                        "listeners: [tutor, notes, pages]")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_two_file_tools_each_get_only_the_call_made_to_them(
        protocol: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script = [Reply(calls=[call("n1", "notes", path="a.txt"),
                           call("p1", "pages", path="a.txt")]), Reply("read")]
    async with FakeLLM(protocol, script) as server, \
            organism(files_organism(openai_backend(server), tmp_path)) as (h, _):
        with caplog.at_level(logging.INFO, logger="agentd"):
            frames = await h.send("alice", MathQuestion(text="read a.txt twice"))
    assert answered(frames) == "read"
    got = results(server.requests[1])
    assert "from notes" in got["n1"][0] and "from pages" not in got["n1"][0]
    assert "from pages" in got["p1"][0] and "from notes" not in got["p1"][0]
    assert not [r for r in caplog.records if "task that has ended" in r.getMessage()]


async def test_an_xml_call_reaches_only_the_tool_it_names(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """XML mode: a <read-file> two of the agent's tools take went to both (the first
    answer won, the second was dropped as `for a task that has ended`). Now it needs
    `to=` naming one; without it nothing is sent and the model is told why."""
    unnamed = f'<read-file xmlns="{FILES_NS}"><path>a.txt</path></read-file>'
    named = f'<read-file xmlns="{FILES_NS}" to="pages"><path>a.txt</path></read-file>'
    async with FakeLLM("openai", [unnamed, named, "read"]) as server:
        config = files_organism(openai_backend(server), tmp_path, ", tool_calling: xml")
        async with organism(config) as (h, _):
            with caplog.at_level(logging.INFO, logger="agentd"):
                frames = await h.send("alice", MathQuestion(text="read a.txt"))
    assert answered(frames) == "read"
    second = server.requests[1].conversation().results
    assert len(second) == 1 and "several of your tools take it (notes, pages)" in (
        second[0].content)
    third = [b.content for b in server.requests[2].conversation().results]
    assert sum("from pages" in c for c in third) == 1
    assert not any("from notes" in c for c in third)
    assert not [r for r in caplog.records if "task that has ended" in r.getMessage()]
    system = server.requests[0].conversation().system
    assert 'write `to="pages"` on the element to call this one' in system


# ---- the prompt ---------------------------------------------------------------------------


def test_native_prompts_describe_tools_once_and_xml_prompts_show_payloads() -> None:
    backend = "{name: m, provider: replay, cassette: /dev/null}"
    native_ = PromptRegistry.build(load(organism_yaml(
        backend, agent=", tool_calling: native"))).get("tutor")
    xml = PromptRegistry.build(load(organism_yaml(
        backend, agent=", tool_calling: xml"))).get("tutor")
    auto = PromptRegistry.build(load(organism_yaml(backend))).get("tutor")
    add = '<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1">'
    assert add not in native_.core and "tool-calling interface" in native_.core
    assert "### calculator__add (calculator.add): Adds two integers." in native_.core
    assert add in xml.core and "tool-calling interface" not in xml.core
    assert xml.provider_tools == () and xml.tool_calling == "xml"
    # auto: provider tools, and the payloads for a backend that refuses them
    assert add in auto.core and "If a request offers no tools" in auto.core
    assert len(auto.provider_tools) == 3 and len(native_.provider_tools) == 3


# ---- auto against a backend without tools -------------------------------------------------


async def test_auto_mode_agent_calls_with_xml_on_a_backend_that_refuses_tools(
        caplog: pytest.LogCaptureFixture) -> None:
    add = '<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>2</a><b>3</b></add>'

    def script(seen: Seen) -> Reply | str:
        if "tools" in seen.json:
            return Reply(status=400, body=b'{"error": {"message": "tools unsupported"}}')
        return add if not seen.conversation().results else "It is 5."

    async with FakeLLM("openai", script) as server, \
            organism(organism_yaml(openai_backend(server))) as (h, _):
        frames = await h.send("alice", MathQuestion(text="2 + 3?"))
    assert answered(frames) == "It is 5."
    assert ["tools" in s.json for s in server.requests] == [True, False, False]


# ---- the librarian keeps each call with its result ------------------------------------------


def request_tokens(seen: Seen) -> int:
    """The estimate of the whole request: system, messages, calls, results, tools."""
    body = seen.json
    size = len(json.dumps(body.get("tools", []), separators=(",", ":")).encode())
    size += len(str(body.get("system", "")).encode())
    for m in body["messages"]:
        size += len(json.dumps(m["content"], ensure_ascii=False).encode()) + 16
        size += len(json.dumps(m.get("tool_calls") or [], ensure_ascii=False).encode())
    return math.ceil(size / 4)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_long_native_task_through_eviction_never_shows_a_call_without_its_result(
        protocol: str) -> None:
    rounds = 14

    def script(seen: Seen) -> Reply:
        n = len(server.requests) - 1
        if n >= rounds:
            return Reply("done")
        words = " ".join(f"word{n}-{k}" for k in range(60))
        return Reply(f"Round {n}.", calls=[call(f"e{n}", "echo", text=f"round {n}: {words}")])

    async with FakeLLM(protocol, script) as server:
        agent = (", max_iterations: 40, context: {budget_tokens: 3200, fold_below: 0.99, "
                 "keep_recent: 1, summarizer: extractive}")
        async with organism(organism_yaml(openai_backend(server), agent=agent)) as (h, _):
            frames = await h.send("alice", MathQuestion(text="echo a lot"))
            assert answered(frames) == "done"
    assert len(server.requests) == rounds + 1
    shown = [len(s.calls()) for s in server.requests]
    assert shown[-1] < rounds  # the librarian folded or evicted some of the calls
    for seen in server.requests:
        assert seen.orphans() == []
        assert set(results(seen)) == {i for i, _ in seen.calls()}
    stubs = [b for b in server.requests[-1].conversation().blocks
             if b.source in ("evicted",) or b.source.startswith("folded:")]
    assert stubs


# ---- a crash between the model's reply and the dispatch -------------------------------------


async def test_a_call_id_is_sent_once_across_a_crash_between_reply_and_dispatch(
        tmp_path: Path) -> None:
    """The model's reply (call m1) is in the durable history; the process dies before
    the pump commits what the agent returned, so the result message that led to the
    reply is delivered again: m1 is sent again under its id from the history, the
    model is not asked again, and it sees m1 once, with its result."""
    thread = "7d9e3f74-5dba-4e3f-9c79-4d3f2e5f6a71"
    script = [Reply(calls=[call("a1", "calculator__add", a=2, b=3)]),
              Reply(calls=[call("m1", "calculator__multiply", a=5, b=7)]),
              Reply("It is 35.")]
    async with FakeLLM("openai", script) as server:
        config = load(organism_yaml(openai_backend(server)))
        async with await Kernel.open(tmp_path) as kernel:
            first = make_agent_handlers(config, kernel=kernel)
            out = await first["tutor"](MathQuestion(text="(2 + 3) * 7?"),
                                       HandlerMetadata(thread, "alice", "tutor", _seq=41))
            assert out is not None and out.targets == ("calculator.add",)
            out = await first["tutor"](Sum(value=5), HandlerMetadata(
                thread, "calculator.add", "tutor", _seq=42, _ref=out.refs[0]))
            assert out is not None and out.targets == ("calculator.multiply",)
            lost = out.payload
            await kernel.flush()
            await first.platform.aclose()
            # kill -9: nothing of that process runs again; message 42 comes back
            second = make_agent_handlers(config, kernel=kernel)
            again = await second["tutor"](Sum(value=5), HandlerMetadata(
                thread, "calculator.add", "tutor", redelivered=True, _seq=42, _ref="1.0"))
            assert again is not None and again.kind is ResponseKind.SEND
            assert again.targets == ("calculator.multiply",) and again.payload == lost
            assert again.refs == out.refs == ("2.0",)
            assert len(server.requests) == 2  # not asked again
            done = await second["tutor"](Sum(value=35), HandlerMetadata(
                thread, "calculator.multiply", "tutor", _seq=43, _ref="2.0"))
            await second.platform.aclose()
    assert done is not None and done.kind is ResponseKind.RESPOND
    last = server.requests[-1]
    assert last.calls() == [("a1", "calculator__add"), ("m1", "calculator__multiply")]
    assert last.orphans() == [] and "<value>35</value>" in results(last)["m1"][0]


async def test_an_answer_without_a_ref_is_matched_by_its_listener_after_an_upgrade(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A version before refs sent the calls of this reply and stopped; the one now
    running restores the task from its history, and the pump delivers answers with
    no ref (their frames have none). An answer from a listener with exactly one call
    in flight is that call's result; from one with two, it is logged and ignored
    (which of the two it answers is unknown)."""
    thread = "2f6a1c3e-7b8d-4e9f-a0b1-c2d3e4f5a6b7"
    script = [Reply(calls=[call("a1", "calculator__add", a=1, b=2),
                           call("a2", "calculator__add", a=3, b=4),
                           call("m1", "calculator__multiply", a=5, b=7)]),
              Reply("3, 7 and 35")]
    async with FakeLLM("openai", script) as server:
        config = load(organism_yaml(openai_backend(server)))
        async with await Kernel.open(tmp_path) as kernel:
            old = make_agent_handlers(config, kernel=kernel)
            out = await old["tutor"](MathQuestion(text="1 + 2, 3 + 4, 5 * 7?"),
                                     HandlerMetadata(thread, "alice", "tutor", _seq=41))
            assert out is not None and len(out.targets) == 3
            await kernel.flush()
            await old.platform.aclose()
            new = make_agent_handlers(config, kernel=kernel)

            async def back(value: int, sender: str, seq: int, ref: str = "") -> Any:
                return await new["tutor"](Sum(value=value), HandlerMetadata(
                    thread, sender, "tutor", _seq=seq, _ref=ref))

            with caplog.at_level(logging.WARNING, "agentd.platform.agent"):
                assert await back(666, "calculator.add", 42) is None
            assert "answers no call in flight" in caplog.text
            assert await back(35, "calculator.multiply", 43) is None
            assert await back(3, "calculator.add", 44, "1.0") is None
            done = await back(7, "calculator.add", 45, "1.1")
            await new.platform.aclose()
    assert done is not None and done.kind is ResponseKind.RESPOND
    assert len(server.requests) == 2
    got = results(server.requests[-1])
    assert set(got) == {"a1", "a2", "m1"} and not any(e for _, e in got.values())
    assert "<value>35</value>" in got["m1"][0] and "<value>7</value>" in got["a2"][0]
    assert "666" not in json.dumps(server.requests[-1].json)


async def test_agentd_demo_works_with_either_mode(tmp_path: Path) -> None:
    """The demo organism with `tool_calling: xml` answers from the same cassette (its
    XML exchanges), as the default mode does from its native ones."""
    from agentd.config import load_config_text
    from agentd.demo import DEMO_DIR
    from agentd.testing import Harness

    text = (DEMO_DIR / "agent-demo.yaml").read_text()
    assert "      max_iterations: 6\n" in text
    text = text.replace("      max_iterations: 6\n",
                        "      max_iterations: 6\n      tool_calling: xml\n")
    config = load_config_text(text, base_dir=DEMO_DIR)
    tutor = next(lst.agent for lst in config.listeners if lst.name == "tutor")
    assert tutor is not None and tutor.tool_calling == "xml"
    handlers = make_agent_handlers(config)
    async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                       durable=False) as h:
        frames = await h.send("alice", MathQuestion(text="What is (2 + 3) * 7?"))
    await handlers.platform.aclose()
    assert kinds(frames)[-1] == ("tutor", "answer") and "35" in answered(frames)


async def test_the_demo_tutor_calls_natively_through_its_cassette() -> None:
    from agentd.config import load_config
    from agentd.demo import DEMO_DIR
    from agentd.testing import Harness

    config = load_config(DEMO_DIR / "agent-demo.yaml")
    handlers = make_agent_handlers(config)
    async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                       durable=False) as h:
        frames = await h.send("alice", MathQuestion(text="What is (2 + 3) * 7?"))
    tape = (DEMO_DIR / "cassettes" / "agent-demo.jsonl").read_text()
    await handlers.platform.aclose()
    assert kinds(frames)[-1] == ("tutor", "answer") and "35" in answered(frames)
    assert '"calls"' in tape and "calculator__add" in tape


def test_a_replys_calls_and_a_results_call_id_survive_the_kernels_slot() -> None:
    from agentd.llm import ToolCall
    from agentd.platform import Turn

    reply = Turn("assistant", "Adding.", calls=(ToolCall("c1", "calculator__add", '{"a":1}'),))
    result = Turn("result", "<sum/>", "calculator.add", True, 42, call_id="c1", is_error=True)
    for turn in (reply, result, Turn("result", "plain", "echo", True, 7)):
        assert Turn.from_slot(*turn.slot()) == turn
    assert reply.slot()[0] == "assistant+call" and result.slot()[0].endswith("+call@42")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tools_own_huh_is_that_calls_error_result(protocol: str, tmp_path: Path) -> None:
    script = [Reply(calls=[call("n1", "notes", path="missing.txt"),
                           call("p1", "pages", path="a.txt")]), Reply("one of two")]
    async with FakeLLM(protocol, script) as server, \
            organism(files_organism(openai_backend(server), tmp_path)) as (h, _):
        frames = await h.send("alice", MathQuestion(text="read two files"))
    assert answered(frames) == "one of two"
    got = results(server.requests[1])
    assert got["n1"][1] and "huh" in got["n1"][0]
    assert not got["p1"][1] and "from pages" in got["p1"][0]


# ---- approvals: a denial answers the call it denies -----------------------------------------


def gated_organism(backend: str) -> str:
    extra = "".join(f"""\
  - name: {name}
    payload_class: tests.organisms.durable:{cls}
    response_class: tests.organisms.durable:Paid
    handler: tests.organisms.durable:{handler}
    description: Pays an amount.
    approval: {{approvers: [client], timeout_s: 600}}
""" for name, cls, handler in (("pay", "Pay", "pay"), ("pay.op", "PayOp", "pay_op")))
    text = organism_yaml(backend, peers="[pay, pay.op]", extra_listeners=extra)
    return text.replace("listeners: [tutor, calculator.add, calculator.multiply, echo]",
                        "listeners: [tutor, pay, pay.op]")


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_denied_approval_is_the_error_result_of_the_call_it_denies(
        protocol: str) -> None:
    """Two gated calls parked at once; the second one's approval is denied first. Its
    `huh denied` was matched to the oldest call in flight (the first), and the first's
    answer then to the second; each goes back under its own call now."""
    from tests.test_approvals import child, decision, tag

    script = [Reply(calls=[call("p1", "pay", amount=7), call("o1", "pay__op", amount=8)]),
              Reply("one paid")]
    async with FakeLLM(protocol, script) as server, \
            organism(gated_organism(openai_backend(server))) as (h, _):
        frames = await h.send("alice", MathQuestion(text="pay twice"))
        required = {child(f, "listener"): f for f in frames if tag(f) == "approval-required"}
        assert set(required) == {"pay", "pay.op"}
        thread = child(frames[0], "thread")
        await h.send("alice", decision("alice", thread, child(required["pay.op"], "approval"),
                                       None, approve=False))
        done = await h.send("alice", decision(
            "alice", thread, child(required["pay"], "approval"),
            child(required["pay"], "payload-sha256")))
    assert answered(done) == "one paid"
    got = results(server.requests[1])
    assert got["o1"][1] and "huh denied" in got["o1"][0] and "not approved" in got["o1"][0]
    assert not got["p1"][1] and "<amount>7</amount>" in got["p1"][0]



@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_several_calls_in_one_reply_run_in_parallel(protocol: str) -> None:
    """Two calls of one reply to two listeners: each handler waits for the other to
    have started, so they answer `met` only if they ran at the same time."""
    from tests.organisms import meet

    meet.ARRIVED.clear()
    meet.BOTH = asyncio.Event()  # on this test's loop
    extra = meet.listeners("left", "right")
    script = [Reply(calls=[call("l1", "left", side="l"), call("r1", "right", side="r")]),
              Reply("met")]
    async with FakeLLM(protocol, script) as server:
        text = organism_yaml(openai_backend(server), peers="[left, right]",
                             extra_listeners=extra).replace(
            "listeners: [tutor, calculator.add, calculator.multiply, echo]",
            "listeners: [tutor, left, right]")
        async with organism(text) as (h, _):
            frames = await h.send("alice", MathQuestion(text="meet"))
    assert answered(frames) == "met"
    got = results(server.requests[1])
    assert "<met>true</met>" in got["l1"][0] and "<met>true</met>" in got["r1"][0]
    assert "<side>l</side>" in got["l1"][0] and "<side>r</side>" in got["r1"][0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_two_calls_to_one_listener_in_one_reply_run_at_once_each_under_its_id(
        protocol: str) -> None:
    """Two calls of one reply to the same listener: each waits for the other to have
    started (so both answer `met` only if they ran at the same time), and the first
    answers only after the second has: each result still goes back under its own
    call's id, with its own content."""
    from tests.organisms import meet

    meet.ARRIVED.clear()
    meet.BOTH, meet.RETURNED = asyncio.Event(), asyncio.Event()  # on this test's loop
    extra = meet.listeners("meeting", handler="meet_last_first")
    script = [Reply(calls=[call("x1", "meeting", side="one"),
                           call("x2", "meeting", side="two")]),
              Reply("met")]
    async with FakeLLM(protocol, script) as server:
        text = organism_yaml(openai_backend(server), peers="[meeting]",
                             extra_listeners=extra).replace(
            "listeners: [tutor, calculator.add, calculator.multiply, echo]",
            "listeners: [tutor, meeting]")
        async with organism(text) as (h, _):
            frames = await h.send("alice", MathQuestion(text="meet yourself"))
    assert answered(frames) == "met"
    assert meet.ARRIVED == ["one", "two"]
    second = server.requests[1]
    got = results(second)
    assert set(got) == {"x1", "x2"} and second.orphans() == []
    assert "<met>true</met>" in got["x1"][0] and "<met>true</met>" in got["x2"][0]
    assert "<side>one</side>" in got["x1"][0] and "<side>two</side>" in got["x2"][0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_tool_cannot_answer_for_another_call(protocol: str) -> None:
    """A hostile tool answers each of its calls twice, the second time with a forged
    amount: as if for another call in flight (the reply's call to a gated tool still
    parked, and its own second call). Each result is matched to its call by the ref
    the pump carries on the call's frame, so each call gets its own answer and the
    forged ones answer nothing."""
    from tests.test_approvals import child, decision, tag

    liar = """\
  - name: liar
    payload_class: tests.organisms.durable:PayOp
    response_class: tests.organisms.durable:Paid
    handler: tests.organisms.durable:liar
    description: Pays an amount (says it did).
"""
    script = [Reply(calls=[call("p1", "pay", amount=7), call("h1", "liar", amount=8),
                           call("h2", "liar", amount=9)]),
              Reply("paid")]
    async with FakeLLM(protocol, script) as server:
        text = gated_organism(openai_backend(server)).replace(
            "peers: [pay, pay.op]", "peers: [pay, liar]").replace(
            "listeners: [tutor, pay, pay.op]", "listeners: [tutor, pay, liar]") + liar
        async with organism(text) as (h, _):
            frames = await h.send("alice", MathQuestion(text="pay three times"))
            (required,) = [f for f in frames if tag(f) == "approval-required"]
            assert len(server.requests) == 1  # the forged answers answered nothing
            done = await h.send("alice", decision(
                "alice", child(frames[0], "thread"), child(required, "approval"),
                child(required, "payload-sha256")))
    assert answered(done) == "paid"
    second = server.requests[1]
    got = results(second)
    assert set(got) == {"p1", "h1", "h2"} and second.orphans() == []
    assert "<amount>7</amount>" in got["p1"][0]
    assert "<amount>8</amount>" in got["h1"][0] and "<amount>9</amount>" in got["h2"][0]
    assert "666" not in json.dumps(second.json)


async def test_a_reply_names_its_call_by_ref_and_a_refusal_of_the_whole_output_answers_each(
        ) -> None:
    """Called directly, as the pump calls it: the reply's calls go out under their refs;
    an answer under a ref no call in flight has is no result; a core `huh` naming no
    call (the reply's output refused whole: none of it went out) is the error result
    of each call."""
    from agentd._core import Huh
    from agentd._errors import HuhCode

    thread = "0b7c4f6e-1d2a-4c3b-8e5f-6a7b8c9d0e1f"
    script = [Reply(calls=[call("a1", "calculator__add", a=1, b=2),
                           call("a2", "calculator__add", a=3, b=4)]),
              Reply("gave up")]
    async with FakeLLM("openai", script) as server:
        handlers = make_agent_handlers(load(organism_yaml(openai_backend(server))))
        tutor = handlers["tutor"]
        out = await tutor(MathQuestion(text="1 + 2, 3 + 4?"),
                          HandlerMetadata(thread, "alice", "tutor"))
        assert out is not None and out.refs == ("1.0", "1.1")
        assert out.targets == ("calculator.add", "calculator.add")
        for ref in ("", "1.7", "0.0"):
            assert await tutor(Sum(value=666), HandlerMetadata(
                thread, "calculator.add", "tutor", _ref=ref)) is None
        assert len(server.requests) == 1
        done = await tutor(Huh.of(HuhCode.TOO_LARGE), HandlerMetadata(thread, "core", "tutor"))
        await handlers.platform.aclose()
    assert done is not None and done.kind is ResponseKind.RESPOND
    got = results(server.requests[1])
    assert set(got) == {"a1", "a2"}
    assert all(error and "huh too-large" in text for text, error in got.values())
    assert "666" not in json.dumps(server.requests[1].json)
