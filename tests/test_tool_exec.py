"""The exec tool attacked with real processes: no shell, no environment, no inherited
descriptors, nothing left after the timeout, no network with `network: false`,
no file outside `root` (under Landlock), output capped."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentd._errors import ConfigError
from agentd.config import load_config_text
from agentd.config.tools import ExecTool
from agentd.confine import landlock_status
from agentd.confine._launcher import launcher_fd
from agentd.testing import Harness
from agentd.tools import Denied, ToolUnavailable
from agentd.tools.exec import Arg, ExecRunner, Run, RunResult, describe, exited, handlers

PYTHON = "/usr/bin/python3"
needs_python = pytest.mark.skipif(not os.access(PYTHON, os.X_OK),
                                  reason="needs the system's /usr/bin/python3")
pytestmark = pytest.mark.both_loops  # the daemon spawns on uvloop
needs_landlock = pytest.mark.skipif(not landlock_status().filesystem,
                                    reason="this kernel has no Landlock")


def runner(**kw: Any) -> ExecRunner:
    config = ExecTool(**{"kind": "exec", **kw})
    (handler,) = handlers(describe(config, "t"))
    assert isinstance(handler, ExecRunner)
    return handler


async def run(tool: ExecRunner, **args: str) -> RunResult:
    return await tool.run(list(args.items()))


async def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (or exits within `within_s`, since SIGKILL
    is delivered asynchronously)."""
    try:
        async with asyncio.timeout(within_s):
            await exited(pid)
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize("value", [
    "$(id)", "`id`", "a; touch /tmp/agentd-pwned", "x | cat /etc/shadow", "'q' \"q\"",
    "$HOME", "a\nb",
])
async def test_shell_metacharacters_reach_the_program_as_one_literal_argument(
    value: str,
) -> None:
    tool = runner(argv=["/bin/echo", "{msg}"], allow_args={"msg": "(?s).*"})
    result = await run(tool, msg=value)
    assert (result.exit_code, result.stdout) == (0, value + "\n")
    assert not os.path.exists("/tmp/agentd-pwned")


@pytest.mark.parametrize("value", ["-e", "--output=/tmp/x", "-n"])
async def test_option_injection_is_denied(value: str) -> None:
    tool = runner(argv=["/bin/echo", "{msg}"], allow_args={"msg": ".*"})
    with pytest.raises(Denied):
        await run(tool, msg=value)


async def test_the_environment_is_empty_except_env() -> None:
    os.environ["AGENTD_TEST_LEAK"] = "secret"
    try:
        assert (await run(runner(argv=["/usr/bin/env"]))).stdout == ""
        tool = runner(argv=["/usr/bin/env"], env={"LANG": "C.UTF-8"})
        assert (await run(tool)).stdout == "LANG=C.UTF-8\n"
    finally:
        del os.environ["AGENTD_TEST_LEAK"]


# Which descriptors beyond 0-2 are open, found with fstat (a confined child cannot
# read /proc/self/fd under Landlock).
FD_PROBE = ("import os\n"
            "def is_open(fd):\n"
            "    try:\n"
            "        os.fstat(fd)\n"
            "    except OSError:\n"
            "        return False\n"
            "    return True\n"
            "print('open:', *[fd for fd in range(3, 4096) if is_open(fd)])\n")


@needs_python
async def test_no_descriptor_of_the_daemon_is_inherited(tmp_path: Path) -> None:
    leaked = os.open(tmp_path, os.O_RDONLY)
    os.set_inheritable(leaked, True)
    try:
        result = await run(runner(argv=[PYTHON, "-I", "-S", "-c", FD_PROBE]))
    finally:
        os.close(leaked)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.split() == ["open:"]


async def test_a_child_that_forks_and_sleeps_past_the_timeout_leaves_nothing(
    tmp_path: Path,
) -> None:
    tool = runner(argv=["/bin/bash", "-c", "sleep 600 & echo $! > pid; echo $$ >> pid; "
                        "sleep 600"], root=tmp_path, timeout_s=0.5)
    with pytest.raises(Exception) as info:
        await run(tool)
    assert type(info.value).__name__ == "_TimedOut"
    pids = [int(p) for p in (tmp_path / "pid").read_text().split()]
    assert len(pids) == 2
    assert [await gone(p) for p in pids] == [True, True]


async def test_a_background_process_does_not_outlive_a_normal_exit(tmp_path: Path) -> None:
    tool = runner(argv=["/bin/bash", "-c", "sleep 600 & echo $! > pid"], root=tmp_path)
    assert (await run(tool)).exit_code == 0
    (pid,) = [int(p) for p in (tmp_path / "pid").read_text().split()]
    assert await gone(pid)


async def test_the_timeout_is_huh_timeout_for_the_caller(tmp_path: Path) -> None:
    tool = runner(argv=["/bin/sleep", "600"], timeout_s=0.2)
    response = await tool(Run(arg=[]), None)  # type: ignore[arg-type]
    assert response.error_code is not None and response.error_code.value == "timeout"


async def test_output_is_capped_and_says_so() -> None:
    tool = runner(argv=["/usr/bin/head", "-c", "1000000", "/dev/zero"],
                  max_output_bytes=1000)
    result = await run(tool)
    assert result.truncated and len(result.stdout) == 1000 and result.exit_code == 0


@pytest.fixture
async def listener() -> AsyncIterator[tuple[int, list[bytes]]]:
    accepted: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(b"connected")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], accepted


CONNECT = ("import socket,sys\n"
           "try:\n socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)\n"
           "except OSError as e:\n print('refused', e.errno); sys.exit(3)\n"
           "print('connected')\n")


@needs_python
async def test_a_child_cannot_connect_out_with_network_false(
    listener: tuple[int, list[bytes]],
) -> None:
    port, accepted = listener
    tool = runner(argv=[PYTHON, "-I", "-S", "-c", CONNECT, "{port}"],
                  allow_args={"port": "[0-9]+"})
    result = await run(tool, port=str(port))
    assert result.exit_code == 3 and result.stdout.startswith("refused")
    assert accepted == []


@needs_python
async def test_network_true_lets_the_child_connect(listener: tuple[int, list[bytes]]) -> None:
    port, _ = listener
    tool = runner(argv=[PYTHON, "-I", "-S", "-c", CONNECT, "{port}"],
                  allow_args={"port": "[0-9]+"}, network=True)
    result = await run(tool, port=str(port))
    assert (result.exit_code, result.stdout) == (0, "connected\n")


@needs_landlock
async def test_files_outside_root_cannot_be_read_or_written(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret").write_text("SECRET")
    (root / "mine").write_text("mine")
    cat = runner(argv=["/bin/cat", "{f}"], allow_args={"f": "[-/\\w.]+"}, root=root)
    assert (await run(cat, f=str(root / "mine"))).stdout == "mine"
    denied = await run(cat, f=str(outside / "secret"))
    assert denied.exit_code != 0 and "SECRET" not in denied.stdout
    assert "Permission denied" in denied.stderr
    touch = runner(argv=["/usr/bin/touch", "{f}"], allow_args={"f": "[-/\\w.]+"}, root=root)
    assert (await run(touch, f=str(root / "new"))).exit_code == 0
    assert (await run(touch, f=str(outside / "new"))).exit_code != 0
    assert not (outside / "new").exists()


@needs_python
async def test_memory_is_capped() -> None:
    tool = runner(argv=[PYTHON, "-I", "-S", "-c", "b = bytearray(512 * 1024 * 1024)"],
                  memory_mb=64)
    result = await run(tool)
    assert result.exit_code != 0 and "MemoryError" in result.stderr


def test_configurations_that_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ToolUnavailable, match="not found"):
        runner(argv=["no-such-program-anywhere"])
    with pytest.raises(ToolUnavailable, match="argv\\[0\\]"):
        runner(argv=["{prog}"], allow_args={"prog": ".*"})
    with pytest.raises(ToolUnavailable, match="cwd"):
        runner(argv=["/bin/true"], root=tmp_path, cwd="../..")
    with pytest.raises(ToolUnavailable, match="cwd needs root"):
        runner(argv=["/bin/true"], cwd="x")


def test_a_placeholder_without_a_pattern_is_a_configuration_error_with_its_line(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config_text("organism: {name: t}\nlisteners:\n  - name: run\n"
                         "    tool: {kind: exec, argv: [/bin/echo, '{x}']}\n",
                         base_dir=tmp_path)
    assert ":4:" in str(info.value) and "allow_args" in str(info.value)


async def test_refusal_end_to_end_is_huh_denied_and_a_security_event(tmp_path: Path) -> None:
    config = load_config_text(
        "organism: {name: t}\nprofiles: {p: {listeners: [echo]}}\nlisteners:\n"
        "  - name: echo\n"
        "    tool: {kind: exec, argv: [/bin/echo, '{n}'], allow_args: {n: '[0-9]+'}}\n",
        base_dir=tmp_path)
    events: list[tuple[str, dict[str, str]]] = []
    async with Harness(config, {"alice": "p"}, on_security=lambda kind, fields:
                       events.append((kind, dict(fields)))) as h:
        ok = await h.send("alice", Run(arg=[Arg(name="n", value="42")]))
        assert b"<stdout>42\n</stdout>" in ok[-1]
        refused = await h.send("alice", Run(arg=[Arg(name="n", value="$(id)")]))
        assert b"<code>denied</code>" in refused[-1] and b"$(id)" not in refused[-1]
    ((kind, fields),) = events
    assert kind == "tool-denied" and fields["listener"] == "echo"
    assert fields["cause"] == "argument does not match its allow_args pattern"
    assert fields["value"] == "$(id)"


def test_the_compiled_launcher_cannot_be_rewritten() -> None:
    """Every confined child execs the launcher from one memfd: sealed, so nothing (a
    child handed it, the daemon's own code) can change what the next child runs."""
    fd = launcher_fd()
    assert fd is not None
    with pytest.raises(PermissionError):
        os.write(fd, b"\x7fELF")
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as again, \
            pytest.raises(PermissionError):
        again.write(b"\x7fELF")
