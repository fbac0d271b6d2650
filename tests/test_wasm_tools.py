"""WASM tools attacked for real: modules written in WAT and run on wasmtime through
the whole pump, each bound hit on purpose (fuel, memory, wall time), reads outside
the preopens, a failing exit, and the host clock's resolution."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agentd._envelope import build_envelope, parse_envelope
from agentd._errors import ConfigError
from agentd._xmlify import to_xml
from agentd.client import frame_kind
from agentd.config import load_config, load_config_text
from agentd.testing import Harness
from agentd.tools.calculator import Add
from tests import wasm_modules as W
from tests.organisms.wasm_payloads import WasmIn

TESTS_DIR = Path(__file__).resolve().parent
PAYLOADS = "tests.organisms.wasm_payloads"


def wasm_listener(name: str, module: Path, **keys: object) -> str:
    response = keys.pop("response", "WasmOut")
    block = {"kind": "wasm", "module": str(module), "payload_class": f"{PAYLOADS}:WasmIn",
             "response_class": f"{PAYLOADS}:{response}", **keys}
    return f"  - name: {name}\n    tool: {json.dumps(block)}\n"


@pytest.fixture
def organism(tmp_path: Path) -> Path:
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "note.txt").write_text("hello from inside")
    (tmp_path / "secret.txt").write_text("top secret")
    (inside / "escape").symlink_to(tmp_path / "secret.txt")
    mods = {name: W.compile_to(tmp_path / f"{name}.wasm", wat) for name, wat in {
        "echo": W.ECHO, "spin": W.SPIN, "grow": W.GROW, "exit3": W.exit_with(3),
        "clock": W.CLOCK, "cpu": W.PROCESS_CLOCK_MS, "cpu.thread": W.THREAD_CLOCK_MS,
        "flood": W.FLOOD, "noisy": W.NOISY, "leftover": W.LEFTOVER,
        "read_inside": W.file_reader("note.txt"),
        "read_up": W.file_reader("../secret.txt"), "read_abs": W.file_reader("/etc/passwd"),
        "read_link": W.file_reader("escape"),
    }.items()}
    preopen = {"preopens": {"/data": str(inside)}}
    listeners = "".join([
        wasm_listener("echo", mods["echo"], response="WasmIn"),
        wasm_listener("spin", mods["spin"], timeout_ms=100),
        wasm_listener("spin.slow", mods["spin"], timeout_ms=3000, fuel=10**15),
        wasm_listener("fuel", mods["spin"], fuel=100_000, timeout_ms=10_000),
        wasm_listener("grow", mods["grow"], memory_mb=2),
        wasm_listener("exit3", mods["exit3"]),
        wasm_listener("clock", mods["clock"]),
        wasm_listener("cpu", mods["cpu"]),
        wasm_listener("cpu.thread", mods["cpu.thread"]),
        wasm_listener("flood", mods["flood"]),
        wasm_listener("noisy", mods["noisy"], response="WasmIn"),
        wasm_listener("leftover", mods["leftover"]),
        *(wasm_listener(n, mods[n], **preopen)
          for n in ("read_inside", "read_up", "read_abs", "read_link")),
    ])
    text = textwrap.dedent(f"""\
        organism: {{name: wasm-tests}}
        python_path: [{json.dumps(str(TESTS_DIR.parent))}]
        pump: {{handler_timeout_s: 20}}
        profiles:
          public: {{listeners: all}}
        listeners:
          - name: calculator.add
            payload_class: agentd.tools.calculator:Add
            response_class: agentd.tools.calculator:Sum
            handler: agentd.tools.calculator:add
            description: Adds two integers.
        """) + listeners
    path = tmp_path / "organism.yaml"
    path.write_text(text)
    return path


@pytest.fixture
async def h(organism: Path):
    async with Harness(load_config(organism), {"alice": "public"}) as harness:
        yield harness


async def call(h: Harness, listener: str, text: str = "ping") -> list[bytes]:
    data = build_envelope("alice", str(uuid.uuid4()), to_xml(WasmIn(text=text)), to=listener)
    return await h.send("alice", data)


def outcome(frames: list[bytes]) -> tuple[str, str]:
    """(payload local name, its code or text) of the last frame."""
    env = parse_envelope(frames[-1])
    name = env.payload.tag.split("}")[1]
    first = env.payload[0]
    return name, first.text or ""


@pytest.mark.both_loops
async def test_echo_module_answers_with_the_request_payload(h: Harness) -> None:
    frames = await call(h, "echo", "hello wasm")
    assert [frame_kind(f)[:2] for f in frames] == [("core", "accepted"), ("echo", "wasmin")]
    assert outcome(frames) == ("wasmin", "hello wasm")


@pytest.mark.both_loops
async def test_infinite_loop_is_stopped_at_its_wall_time_as_timeout(h: Harness) -> None:
    assert outcome(await call(h, "spin")) == ("huh", "timeout")


async def test_fuel_exhaustion_is_budget_exceeded(h: Harness) -> None:
    assert outcome(await call(h, "fuel")) == ("huh", "budget-exceeded")


async def test_memory_grower_stops_at_its_cap_as_budget_exceeded(h: Harness) -> None:
    assert outcome(await call(h, "grow")) == ("huh", "budget-exceeded")


async def test_non_zero_exit_is_internal(h: Harness) -> None:
    assert outcome(await call(h, "exit3")) == ("huh", "internal")


async def test_flooding_stdout_is_cut_and_the_answer_refused(h: Harness) -> None:
    frames = await call(h, "flood")
    assert outcome(frames)[0] == "huh"
    assert max(len(f) for f in frames) < 4096  # nothing of the flood reached the client


async def test_stderr_is_logged_capped_and_a_flood_of_it_does_not_stop_the_answer(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "agentd.tools.wasm")
    assert outcome(await call(h, "noisy", "still answered")) == ("wasmin", "still answered")
    logged = [r.getMessage() for r in caplog.records if "wasm stderr" in r.getMessage()]
    assert logged == [f"wasm stderr module=noisy.wasm: {b'e' * 4096!r}"]


async def test_module_reads_a_file_inside_its_preopen(h: Harness) -> None:
    assert outcome(await call(h, "read_inside")) == ("wasmout", "hello from inside")


@pytest.mark.parametrize("listener", ["read_up", "read_abs", "read_link"])
async def test_module_cannot_read_outside_its_preopen(h: Harness, listener: str) -> None:
    name, text = outcome(await call(h, listener))
    assert name == "wasmout" and text.startswith("errno ")  # the open failed in the guest
    assert "secret" not in text and "root:" not in text


async def test_module_sees_clocks_rounded_to_the_millisecond(h: Harness) -> None:
    for _ in range(5):
        assert outcome(await call(h, "clock")) == ("wasmout", "000000")


@pytest.mark.parametrize("listener", ["cpu", "cpu.thread"])
async def test_a_modules_cpu_clocks_count_its_own_call_only(h: Harness, listener: str) -> None:
    """The process and thread CPU clocks start at the call: they told the daemon's
    CPU time (how busy every other conversation kept it) and the pool thread's (the
    calls of other conversations before this one)."""
    daemon_ms = time.process_time_ns() // 1_000_000
    assert daemon_ms > 100  # what the old clocks showed, at the least
    for _ in range(3):
        name, text = outcome(await call(h, listener))
        assert name == "wasmout" and int(text) < 50


@pytest.mark.both_loops
async def test_a_running_module_does_not_block_the_event_loop(h: Harness) -> None:
    slow = asyncio.create_task(call(h, "spin.slow"))
    frames = await h.send("alice", Add(a=2, b=3))
    assert frame_kind(frames[-1])[:2] == ("calculator.add", "sum")
    assert not slow.done()  # the module still runs on its thread
    assert outcome(await slow) == ("huh", "timeout")


@pytest.mark.both_loops
async def test_calls_beyond_the_listeners_threads_wait_and_each_is_answered(h: Harness) -> None:
    """A listener runs its calls on two threads: the others wait their turn."""
    texts = [f"call {i}" for i in range(8)]
    answers = await asyncio.gather(*(call(h, "echo", text) for text in texts))
    assert [outcome(frames) for frames in answers] == [("wasmin", t) for t in texts]


@pytest.mark.both_loops
async def test_a_call_sees_nothing_an_earlier_call_left(h: Harness) -> None:
    """Each call has a store and instance of its own: memory written, a global set
    and pages grown by one call are not there for the next, on the same thread or
    the other, one after another or side by side."""
    for _ in range(3):
        assert outcome(await call(h, "leftover")) == ("wasmout", "001")
    side_by_side = await asyncio.gather(*(call(h, "leftover") for _ in range(6)))
    assert [outcome(frames) for frames in side_by_side] == [("wasmout", "001")] * 6


def config_text(tmp_path: Path, **keys: object) -> str:
    module = W.compile_to(tmp_path / "echo.wasm", W.ECHO)
    return (f"organism: {{name: t}}\npython_path: [{json.dumps(str(TESTS_DIR.parent))}]\n"
            "listeners:\n" + wasm_listener("echo", module, response="WasmIn", **keys))


def test_a_module_whose_hash_differs_from_sha256_is_a_configuration_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text(config_text(tmp_path, sha256="0" * 64), base_dir=tmp_path)
    assert "SHA-256" in str(info.value)
    assert str(info.value).startswith("<string>:5:11: listeners[0].tool: module ")


def test_a_module_pinned_by_its_hash_loads(tmp_path: Path) -> None:
    digest = hashlib.sha256(W.compile_to(tmp_path / "echo.wasm", W.ECHO).read_bytes())
    config = load_config_text(config_text(tmp_path, sha256=digest.hexdigest()),
                              base_dir=tmp_path)
    loaded = config.listener("echo").loaded_tool
    assert loaded is not None and loaded.runs.digest == digest.hexdigest()


def test_a_file_that_is_not_a_module_is_a_configuration_error(tmp_path: Path) -> None:
    text = config_text(tmp_path)
    (tmp_path / "echo.wasm").write_bytes(b"\0asm garbage")
    with pytest.raises(ConfigError) as info:
        load_config_text(text, base_dir=tmp_path)
    assert "cannot be loaded" in str(info.value)


def test_modules_are_compiled_once_per_content(tmp_path: Path) -> None:
    from agentd.tools import wasm

    tool = load_config_text(config_text(tmp_path), base_dir=tmp_path).listener("echo").tool
    (first,), (second,) = wasm.describe(tool, "echo"), wasm.describe(tool, "echo")
    assert first == second and first.runs.pre is second.runs.pre
    (one,), (two,) = wasm.handlers([first]), wasm.handlers([second])
    assert one is not two
    assert one.module.pre is two.module.pre  # type: ignore[attr-defined]
