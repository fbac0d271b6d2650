"""WASI preview 1 command modules for the WASM tool tests, written in WAT and
compiled by wasmtime's own `wat2wasm`. Each reads its request from stdin and
writes a payload of `tests/organisms/wasm_payloads.py` (or nothing) to stdout."""

from __future__ import annotations

from pathlib import Path

import wasmtime

NS = "https://xml-pipeline.org/ns/test/wasm/v1"

_IMPORTS = """
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $proc_exit (param i32)))
  (import "wasi_snapshot_preview1" "path_open"
    (func $path_open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "clock_time_get"
    (func $clock_time_get (param i32 i64 i32) (result i32)))
"""

# Writes memory[ptr, ptr+len) to fd; iovec scratch at 0, count at 16.
_WRITE = """
  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 16))))
"""

# Copies stdin to stdout (the request echoed back).
ECHO = f"""(module {_IMPORTS}
  (memory (export "memory") 2)
  {_WRITE}
  (func (export "_start")
    (local $n i32)
    (loop $more
      (i32.store (i32.const 0) (i32.const 1024))
      (i32.store (i32.const 4) (i32.const 64512))
      (drop (call $fd_read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 16)))
      (local.set $n (i32.load (i32.const 16)))
      (if (i32.gt_u (local.get $n) (i32.const 0))
        (then (call $write (i32.const 1) (i32.const 1024) (local.get $n)) (br $more))))))
"""

# Writes 64 KiB of "e" to stderr 32 times (2 MiB, past its cap: the writes past it
# fail, and it goes on), then copies stdin to stdout.
NOISY = f"""(module {_IMPORTS}
  (memory (export "memory") 2)
  {_WRITE}
  (func (export "_start")
    (local $n i32)
    (memory.fill (i32.const 65536) (i32.const 101) (i32.const 65536))
    (loop $noise
      (call $write (i32.const 2) (i32.const 65536) (i32.const 65536))
      (local.set $n (i32.add (local.get $n) (i32.const 1)))
      (br_if $noise (i32.lt_u (local.get $n) (i32.const 32))))
    (loop $more
      (i32.store (i32.const 0) (i32.const 1024))
      (i32.store (i32.const 4) (i32.const 64512))
      (drop (call $fd_read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 16)))
      (local.set $n (i32.load (i32.const 16)))
      (if (i32.gt_u (local.get $n) (i32.const 0))
        (then (call $write (i32.const 1) (i32.const 1024) (local.get $n)) (br $more))))))
"""

SPIN = """(module
  (memory (export "memory") 1)
  (func (export "_start") (loop $forever (br $forever))))
"""

# Grows its memory a page at a time until memory.grow fails, then traps.
GROW = """(module
  (memory (export "memory") 1)
  (func (export "_start")
    (loop $more
      (if (i32.ne (memory.grow (i32.const 1)) (i32.const -1)) (then (br $more))))
    unreachable))
"""

# Writes 64 KiB of "x" to stdout a hundred times (6.4 MiB), then exits normally.
FLOOD = f"""(module {_IMPORTS}
  (memory (export "memory") 2)
  {_WRITE}
  (func (export "_start")
    (local $i i32)
    (memory.fill (i32.const 1024) (i32.const 120) (i32.const 65536))
    (loop $more
      (call $write (i32.const 1) (i32.const 1024) (i32.const 65536))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $more (i32.lt_u (local.get $i) (i32.const 100))))))
"""


def exit_with(code: int) -> str:
    return f"""(module {_IMPORTS}
  (memory (export "memory") 1)
  (func (export "_start") (call $proc_exit (i32.const {code}))))
"""


def _data(text: bytes) -> str:
    return "".join(f"\\{b:02x}" for b in text)


def answer(text: str) -> bytes:
    return f'<wasmout xmlns="{NS}"><text>{text}</text></wasmout>'.encode()


_HEAD, _TAIL = answer("\x00").split(b"\x00")  # an answer around a text written later


def file_reader(path: str) -> str:
    """Opens `path` under the first preopen (fd 3) and answers with its first
    bytes, or with `errno N` when the open fails."""
    head, tail = _HEAD, _TAIL
    path_bytes = path.encode()
    return f"""(module {_IMPORTS}
  (memory (export "memory") 2)
  (data (i32.const 64) "{_data(path_bytes)}")
  (data (i32.const 512) "{_data(head)}")
  (data (i32.const 768) "{_data(tail)}")
  (data (i32.const 900) "errno ")
  {_WRITE}
  (func (export "_start")
    (local $errno i32)
    (local.set $errno
      (call $path_open (i32.const 3) (i32.const 0) (i32.const 64) (i32.const {len(path_bytes)})
        (i32.const 0) (i64.const 2) (i64.const 0) (i32.const 0) (i32.const 32)))
    (call $write (i32.const 1) (i32.const 512) (i32.const {len(head)}))
    (if (i32.eqz (local.get $errno))
      (then
        (i32.store (i32.const 0) (i32.const 1024))
        (i32.store (i32.const 4) (i32.const 200))
        (drop (call $fd_read (i32.load (i32.const 32)) (i32.const 0) (i32.const 1) (i32.const 16)))
        (call $write (i32.const 1) (i32.const 1024) (i32.load (i32.const 16))))
      (else
        (call $write (i32.const 1) (i32.const 900) (i32.const 6))
        ;; two decimal digits of the errno
        (i32.store8 (i32.const 1024)
          (i32.add (i32.const 48) (i32.div_u (local.get $errno) (i32.const 10))))
        (i32.store8 (i32.const 1025)
          (i32.add (i32.const 48) (i32.rem_u (local.get $errno) (i32.const 10))))
        (call $write (i32.const 1) (i32.const 1024) (i32.const 2))))
    (call $write (i32.const 1) (i32.const 768) (i32.const {len(tail)}))))
"""


# Answers with the wall clock's nanoseconds modulo one million, as 6 digits:
# always 000000 when the host rounds clocks to the millisecond.
def clock_reader(clock: int, millis: bool) -> str:
    """A module that reads WASI clock `clock` and prints six digits: of its
    nanoseconds (the sub-millisecond part), or with `millis` of its milliseconds."""
    value = ("(i64.rem_u (i64.div_u (i64.load (i32.const 40)) (i64.const 1000000)) "
             "(i64.const 1000000))" if millis
             else "(i64.rem_u (i64.load (i32.const 40)) (i64.const 1000000))")
    return f"""(module {_IMPORTS}
  (memory (export "memory") 2)
  (data (i32.const 512) "{_data(_HEAD)}")
  (data (i32.const 768) "{_data(_TAIL)}")
  {_WRITE}
  (func (export "_start")
    (local $ns i64) (local $i i32)
    (drop (call $clock_time_get (i32.const {clock}) (i64.const 1) (i32.const 40)))
    (local.set $ns {value})
    (local.set $i (i32.const 6))
    (loop $digits
      (local.set $i (i32.sub (local.get $i) (i32.const 1)))
      (i32.store8 (i32.add (i32.const 1024) (local.get $i))
        (i32.add (i32.const 48) (i32.wrap_i64 (i64.rem_u (local.get $ns) (i64.const 10)))))
      (local.set $ns (i64.div_u (local.get $ns) (i64.const 10)))
      (br_if $digits (i32.gt_s (local.get $i) (i32.const 0))))
    (call $write (i32.const 1) (i32.const 512) (i32.const {len(_HEAD)}))
    (call $write (i32.const 1) (i32.const 1024) (i32.const 6))
    (call $write (i32.const 1) (i32.const 768) (i32.const {len(_TAIL)}))))
"""


# Answers with what an earlier call could have left behind, as three digits: a byte
# of its memory (0 when fresh), its mutable global (0), its memory's size in pages
# (1); then leaves 7 in that byte, 1 in the global, and grows its memory a page.
LEFTOVER = f"""(module {_IMPORTS}
  (memory (export "memory") 1)
  (global $calls (mut i32) (i32.const 0))
  (data (i32.const 512) "{_data(_HEAD)}")
  (data (i32.const 768) "{_data(_TAIL)}")
  {_WRITE}
  (func (export "_start")
    (i32.store8 (i32.const 1024) (i32.add (i32.const 48) (i32.load8_u (i32.const 40000))))
    (i32.store8 (i32.const 1025) (i32.add (i32.const 48) (global.get $calls)))
    (i32.store8 (i32.const 1026) (i32.add (i32.const 48) (memory.size)))
    (i32.store8 (i32.const 40000) (i32.const 7))
    (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
    (drop (memory.grow (i32.const 1)))
    (i32.store8 (i32.const 70000) (i32.const 9))
    (call $write (i32.const 1) (i32.const 512) (i32.const {len(_HEAD)}))
    (call $write (i32.const 1) (i32.const 1024) (i32.const 3))
    (call $write (i32.const 1) (i32.const 768) (i32.const {len(_TAIL)}))))
"""


CLOCK = clock_reader(0, millis=False)
PROCESS_CLOCK_MS = clock_reader(2, millis=True)
THREAD_CLOCK_MS = clock_reader(3, millis=True)


def compile_to(path: Path, wat: str) -> Path:
    path.write_bytes(wasmtime.wat2wasm(wat))
    return path
