"""Isolation's pure parts: the byte protocol under hostile input, the worker state
machine, the exit reasons, which listeners run isolated, the configuration rules."""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentd import ConfigError, HandlerMetadata, HandlerResponse, HuhCode
from agentd._handler import ResponseKind
from agentd._states import IllegalTransition, step
from agentd.config import load_config_text
from agentd.isolation import _protocol as p
from agentd.isolation import effective_isolation
from agentd.isolation._pool import spins
from agentd.isolation._worker import TRANSITIONS, WorkerEvent, WorkerState, exit_reason
from agentd.isolation.worker import run_handler


def body(kind: bytes, header: object, rest: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return kind + struct.pack(">I", len(head)) + head + rest


# ---- the protocol ------------------------------------------------------------------


@pytest.mark.parametrize("result", [
    None,
    HandlerResponse.respond(b"<x/>"),
    HandlerResponse(b"<x/>", to="calculator.add"),
    HandlerResponse.broadcast(b"<x/>", ["a", "b"]),
    HandlerResponse.error(HuhCode.INVALID_PAYLOAD, "no", retry_allowed=False),
])
def test_answer_round_trips(result: HandlerResponse | None) -> None:
    frame = p.encode_answer(result, result.payload if result and result.payload else b"")
    assert p.frame_length(frame[:4]) == len(frame) - 4
    kind, header, rest = p.decode(frame[4:])
    assert kind == p.ANSWER and p.decode_answer(header, rest) == result


def test_call_round_trips() -> None:
    meta = HandlerMetadata("t", "alice", "prober", True)
    kind, header, rest = p.decode(p.encode_call(meta, "{ns}probe", b"<probe/>")[4:])
    assert (kind, p.decode_call(header), header["key"], rest) == (
        p.CALL, meta, "{ns}probe", b"<probe/>")


@pytest.mark.parametrize("prefix", [struct.pack(">I", 0), struct.pack(">I", p.MAX_FRAME + 1),
                                    b"\xff\xff\xff\xff"])
def test_forged_frame_length_is_refused(prefix: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.frame_length(prefix)


@pytest.mark.parametrize("frame", [
    b"A",  # short
    b"Z" + struct.pack(">I", 2) + b"{}",  # unknown kind
    b"A" + struct.pack(">I", 10**6) + b"{}",  # header longer than the frame
    b"A" + struct.pack(">I", 3) + b"{x}",  # not JSON
    b"A" + struct.pack(">I", 2) + b"[]",  # not an object
    b"A" + struct.pack(">I", 2000) + b"[" * 2000,  # deep nesting
    b"A" + struct.pack(">I", 9) + b'{"a":NaN}',  # not JSON, though Python's json reads it
    b"A" + struct.pack(">I", 8) + b'{"a":"\xff"}',  # not UTF-8
    b"A" + struct.pack(">I", 14) + b'{"a":"\\ud800"}',  # a lone surrogate
])
def test_malformed_frames_are_refused(frame: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


@pytest.mark.parametrize("header,rest", [
    ({"kind": "exfiltrate"}, b""),
    ({"kind": None}, b"<smuggled/>"),
    ({"kind": "send", "to": 7}, b"<x/>"),
    ({"kind": "send", "to": "x" * 300}, b"<x/>"),
    ({"kind": "broadcast", "targets": "a,b"}, b"<x/>"),
    ({"kind": "broadcast", "targets": [1]}, b"<x/>"),
    ({"kind": "broadcast", "targets": ["a"] * 1000}, b"<x/>"),
    ({"kind": "error", "code": "root-shell"}, b""),
    ({"kind": "error", "code": "internal", "message": ["x"]}, b""),
    ({"kind": "respond", "retry": "yes"}, b"<x/>"),
])
def test_forged_answers_from_a_worker_are_refused(header: dict[str, object], rest: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode_answer(header, rest)


@pytest.mark.parametrize("result", [
    HandlerResponse(b"<x/>", to="\ud800"),  # a lone surrogate: not UTF-8
    HandlerResponse.broadcast(b"<x/>", ["a", "\udfff"]),
])
def test_an_answer_json_cannot_carry_fails_in_the_worker(result: HandlerResponse) -> None:
    """The worker turns this TypeError into FAILED (the handler raised): nothing that
    is not plain JSON is written to the daemon."""
    with pytest.raises(TypeError):
        p.encode_answer(result, b"<x/>")


def test_an_error_message_from_a_worker_is_capped() -> None:
    _kind, header, rest = p.decode(body(p.ANSWER, {"kind": "error", "code": "internal",
                                                  "message": "m" * 10_000}))
    result = p.decode_answer(header, rest)
    assert result is not None and result.kind is ResponseKind.ERROR
    assert len(result.error_message) == p.MAX_MESSAGE


# ---- the worker's state machine and exit reasons -----------------------------------


def test_worker_state_machine_walk() -> None:
    s = WorkerState.STARTING
    for event, expected in [(WorkerEvent.READY, WorkerState.IDLE),
                            (WorkerEvent.CALL, WorkerState.BUSY),
                            (WorkerEvent.DONE, WorkerState.IDLE),
                            (WorkerEvent.CALL, WorkerState.BUSY),
                            (WorkerEvent.DIE, WorkerState.DEAD),
                            (WorkerEvent.DIE, WorkerState.DEAD)]:
        s = step("worker", TRANSITIONS, s, event)
        assert s is expected
    for state, allowed in TRANSITIONS.items():
        for event in WorkerEvent:
            if event not in allowed:
                with pytest.raises(IllegalTransition):
                    step("worker", TRANSITIONS, state, event)


@pytest.mark.parametrize("rc,killed_for,reason", [
    (-signal.SIGKILL, "timeout", "timeout"),
    (-signal.SIGXCPU, None, "cpu"),
    (-signal.SIGSEGV, None, "crash"),
    (3, None, "exit"),
    (0, "recycle", "recycle"),
])
def test_exit_reason(rc: int, killed_for: str | None, reason: str) -> None:
    assert exit_reason(rc, killed_for) == reason


def test_a_handler_that_never_suspends_runs_without_the_loop() -> None:
    async def quick() -> str:
        return "done"

    loop = asyncio.new_event_loop()
    try:
        assert run_handler(loop, quick()) == "done"

        async def suspends() -> str:
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
            return "later"

        assert run_handler(loop, suspends()) == "later"

        async def fails_later() -> None:
            await asyncio.sleep(0)
            raise KeyError("x")

        with pytest.raises(KeyError):
            run_handler(loop, fails_later())
    finally:
        loop.close()


# ---- which listeners run isolated ------------------------------------------------------

HANDLER = """
  - name: {name}
    payload_class: agentd.tools.calculator:{cls}
    response_class: agentd.tools.calculator:Sum
    handler: agentd.tools.calculator:add
    description: Adds.{extra}
"""


def organism(listeners: str, profiles: str) -> str:
    return "organism: {name: t}\nlisteners:" + listeners + "profiles:\n" + profiles


def test_a_listeners_own_isolation_wins_over_its_profile(tmp_path: Path) -> None:
    text = organism(
        HANDLER.format(name="own", cls="Add", extra="\n    isolation: {memory_mb: 64}")
        + HANDLER.format(name="inherits", cls="Add", extra="")
        + HANDLER.format(name="opts-out", cls="Multiply",
                         extra="\n    isolation: {process: false}"),
        "  p: {listeners: all, isolation: {memory_mb: 128}}\n")
    chosen = effective_isolation(load_config_text(text, base_dir=tmp_path))
    assert chosen["own"].memory_mb == 64 and chosen["inherits"].memory_mb == 128
    assert "opts-out" not in chosen


def test_profiles_that_disagree_about_a_listener_are_a_configuration_error(
        tmp_path: Path) -> None:
    text = organism(HANDLER.format(name="adder", cls="Add", extra=""),
                    "  a: {listeners: [adder], isolation: {memory_mb: 64}}\n"
                    "  b: {listeners: [adder], isolation: {memory_mb: 128}}\n")
    with pytest.raises(ConfigError, match="different isolation"):
        load_config_text(text, base_dir=tmp_path)


def test_isolation_applies_to_agents_and_never_to_tools(tmp_path: Path) -> None:
    text = textwrap.dedent("""
        organism: {name: t}
        prompts: {p: "hi"}
        llm: {backends: [{name: m, provider: openai, base_url: "http://127.0.0.1:1/v1", model: x}]}
        profiles: {public: {listeners: all, isolation: {memory_mb: 128}}}
        listeners:
          - name: greeter
            payload_class: agentd.tools.calculator:Add
            agent: {prompt: p, model: m}
            isolation: {memory_mb: 64}
          - name: helper
            payload_class: agentd.tools.calculator:Multiply
            agent: {prompt: p, model: m}
          - name: clock
            tool: {kind: timer}
    """)
    chosen = effective_isolation(load_config_text(text, base_dir=tmp_path))
    assert {name: iso.memory_mb for name, iso in chosen.items()} == {"greeter": 64, "helper": 128}
    bad = text.replace("tool: {kind: timer}", "tool: {kind: timer}\n    isolation: {}")
    with pytest.raises(ConfigError, match="a tool confines itself"):
        load_config_text(bad, base_dir=tmp_path)


def test_an_agent_worker_imports_the_loop_without_the_platform() -> None:
    """What an isolated agent's worker imports before its first call: the agent loop
    and the protocol, never the configuration model, the kernel, the LLM router,
    vectors or an HTTP client (together about 45 MiB and 0.4 s a start)."""
    probe = textwrap.dedent("""
        import json, sys
        import agentd.isolation.worker, agentd.isolation._agent
        from agentd.isolation._agent import WorkerAgent
        print(json.dumps(sorted(sys.modules)))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, check=True,
                         text=True, timeout=60).stdout
    loaded = set(json.loads(out))
    heavy = {"agentd.config", "agentd.kernel", "agentd.llm._router", "agentd.platform._platform",
             "agentd.context", "numpy", "httpx", "aiohttp", "pydantic"}
    assert not heavy & loaded, heavy & loaded
    assert "agentd.platform._agent" in loaded  # the probe did import the loop


@pytest.mark.parametrize(("waiting", "workers", "others", "cores", "spin"), [
    (False, 1, 2, 2, True), (False, 4, 2, 2, True),  # nobody waits: a call may be lone
    (True, 1, 1, 2, True),  # a worker and a daemon without a kernel on two cores
    (True, 1, 2, 2, False),  # ... with its kernel writer too: a core short, sleep
    (True, 2, 1, 2, False), (True, 1, 1, 1, False),
    (True, 2, 2, 4, True), (True, 3, 2, 4, False),
])
def test_a_worker_spins_only_where_it_takes_no_core_from_the_daemon_under_load(
        waiting: bool, workers: int, others: int, cores: int, spin: bool) -> None:
    assert spins(waiting, workers, others, cores) is spin


def test_a_secret_beneath_any_path_a_worker_reads_is_refused(tmp_path: Path) -> None:
    """A clients file under /usr (a system folder every worker reads) was accepted
    and readable by the worker; so was one reached through a symbolic link."""
    from agentd._errors import ConfigError
    from agentd.config import load_config_text
    from agentd.isolation._plan import worker_policy

    config = load_config_text(textwrap.dedent("""
        organism: {name: units}
        listeners:
          - name: calc
            payload_class: agentd.tools.calculator:Add
            response_class: agentd.tools.calculator:Sum
            handler: agentd.tools.calculator:add
            description: Adds.
            isolation: {workers: 1}
    """), base_dir=tmp_path)
    lst = config.listener("calc")
    iso = lst.isolation
    assert iso is not None
    worker_policy(lst, iso, [tmp_path / "clients.yaml"], [])  # nothing to read there
    with pytest.raises(ConfigError, match="would be able to read /usr/local/share/x/clients"):
        worker_policy(lst, iso, [Path("/usr/local/share/x/clients.yaml")], [])
    link = tmp_path / "secrets"
    link.symlink_to("/usr/share")
    with pytest.raises(ConfigError, match="would be able to read"):
        worker_policy(lst, iso, [link / "clients.yaml"], [])
