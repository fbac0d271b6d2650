"""What a WASM module could use to get past its limits, attacked with real modules
(WAT, compiled by wasmtime) on the real runtime: a second memory, a table grown
without bound, a WASI call that waits (no fuel, no epoch: past its timeout), a
symbolic link planted in a preopen that points out of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import wasmtime

from agentd._errors import HuhCode
from agentd.config.tools import WasmTool
from agentd.tools.kinds import ToolUnavailable
from agentd.tools.wasm import describe, handlers

EXIT = '(import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))'


def module(tmp_path: Path, wat: str, **keys: object) -> object:
    """The configured module (what a call runs), for `wat`."""
    path = tmp_path / "m.wasm"
    path.write_bytes(wasmtime.wat2wasm(wat))
    config = WasmTool(kind="wasm", module=path,
                      payload_class="tests.organisms.wasm_payloads:WasmIn",
                      response_class="tests.organisms.wasm_payloads:WasmOut", **keys)
    (handler,) = handlers(describe(config, "m"))
    return handler.module  # type: ignore[attr-defined]


def test_a_module_with_a_second_memory_is_refused_at_load(tmp_path: Path) -> None:
    wat = """(module (memory $a 1) (memory $b 256) (export "memory" (memory $a))
               (func (export "_start")))"""
    with pytest.raises(ToolUnavailable):
        module(tmp_path, wat, memory_mb=1)


def test_a_table_cannot_grow_past_what_memory_mb_allows(tmp_path: Path) -> None:
    """table.grow past the store's limit fails (-1) instead of taking host memory:
    the module exits with 1 when it does, 0 if 50 million elements were granted."""
    wat = f"""(module {EXIT}
      (memory (export "memory") 1)
      (table $t 0 funcref)
      (func (export "_start")
        (call $exit (i32.eq (table.grow $t (ref.null func) (i32.const 50000000))
                            (i32.const -1)))))"""
    out = module(tmp_path, wat, memory_mb=1).run(b"<x/>")  # type: ignore[attr-defined]
    assert out.failure is HuhCode.INTERNAL and "exit code 1" in out.reason


def test_a_module_cannot_wait_in_poll_oneoff(tmp_path: Path) -> None:
    """A two-second clock subscription past a 100 ms timeout: answered `notsup` (58)
    at once, not slept on a pool thread that neither fuel nor the epoch deadline can
    interrupt."""
    wat = f"""(module {EXIT}
      (import "wasi_snapshot_preview1" "poll_oneoff"
        (func $poll (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "_start")
        (i32.store8 (i32.const 8) (i32.const 0))            ;; a clock subscription
        (i64.store (i32.const 24) (i64.const 2000000000))    ;; two seconds, in ns
        (call $exit (call $poll (i32.const 0) (i32.const 128) (i32.const 1)
                                (i32.const 256)))))"""
    out = module(tmp_path, wat, timeout_ms=100).run(b"<x/>")  # type: ignore[attr-defined]
    assert out.failure is HuhCode.INTERNAL and "exit code 58" in out.reason


def test_a_module_cannot_plant_a_symlink_in_its_preopen(tmp_path: Path) -> None:
    target, link = b"../../../../../../etc/shadow", b"planted"
    data = tmp_path / "data"
    data.mkdir()
    wat = f"""(module {EXIT}
      (import "wasi_snapshot_preview1" "path_symlink"
        (func $sym (param i32 i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 100) "{target.decode()}")
      (data (i32.const 200) "{link.decode()}")
      (func (export "_start")
        (call $exit (call $sym (i32.const 100) (i32.const {len(target)}) (i32.const 3)
                               (i32.const 200) (i32.const {len(link)})))))"""
    out = module(tmp_path, wat, preopens={"/data": data}).run(b"<x/>")  # type: ignore[attr-defined]
    assert out.failure is HuhCode.INTERNAL and "exit code 63" in out.reason
    assert list(data.iterdir()) == []


@pytest.mark.parametrize("wat", [
    '(module (memory (export "memory") 1))',
    '(module (memory (export "_start") 1))',
    '(module (func (export "_start") (param i32)))',
])
def test_a_module_that_is_no_wasi_command_is_refused_at_load(tmp_path: Path, wat: str) -> None:
    """No `_start() -> ()`: every call raised KeyError or an assertion (gone under
    `python -O`); the configuration loaded."""
    with pytest.raises(ToolUnavailable, match="not a WASI command"):
        module(tmp_path, wat)


@pytest.mark.parametrize(("body", "reason"), [
    ("unreachable", "unreachable"),
    ("(call $exit (i32.const 1))", "exit code 1"),
])
def test_a_start_section_that_fails_is_internal_not_a_memory_budget(
        tmp_path: Path, body: str, reason: str) -> None:
    wat = f"""(module {EXIT} (memory (export "memory") 1)
      (func $init {body}) (start $init) (func (export "_start")))"""
    out = module(tmp_path, wat).run(b"<x/>")  # type: ignore[attr-defined]
    assert out.failure is HuhCode.INTERNAL and reason in out.reason
    over = """(module (memory (export "memory") 1000) (func (export "_start")))"""
    out = module(tmp_path, over, memory_mb=4).run(b"<x/>")  # type: ignore[attr-defined]
    assert out.failure is HuhCode.BUDGET_EXCEEDED


def test_each_listener_runs_its_modules_on_threads_of_its_own() -> None:
    """One pool of four threads for every module: twelve long calls of one listener
    made another listener's instant module time out."""
    from agentd.tools.wasm import runtime

    rt = runtime()
    spin, echo = rt.executor("spin"), rt.executor("echo")
    assert spin is not echo and rt.executor("spin") is spin
    assert spin.count == echo.count == rt.threads


def test_compiled_code_goes_with_the_last_listener_using_it(tmp_path: Path) -> None:
    """Every module a reload (or a dry run) compiled stayed in memory for the
    daemon's life (148 -> 654 MiB over four reloads of a 7 MiB module)."""
    import gc
    import hashlib

    from agentd.tools.wasm import runtime

    wat = ('(module (memory (export "memory") 1) (func (export "_start"))'
           ' (data (i32.const 0) "once"))')
    digest = hashlib.sha256(wasmtime.wat2wasm(wat)).hexdigest()
    held = module(tmp_path, wat)
    assert runtime().holds(digest)
    del held
    gc.collect()
    assert not runtime().holds(digest)
