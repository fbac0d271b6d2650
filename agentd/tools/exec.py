"""The `exec` tool: runs the configured program, never a shell, confined.

The argv comes from the configuration (`agentd.tools.command`): a call only fills
`{name}` placeholders, one element each, with values its `allow_args` patterns
accept. The child is started by `agentd.confine.spawn` (an exec shim applies the
limits in the child, before the program runs): its own process group, an empty
environment plus `env:`, no descriptor of the daemon's (stdin is /dev/null),
rlimits (`memory_mb`, CPU seconds from `timeout_s`, open files), Landlock where
the kernel has it (read and execute: the system's library paths and the program's
own folder; read and write: `root`; TCP denied when `network: false`, or a network
namespace). `network: false` that nothing here can enforce is a configuration
error; filesystem confinement that the kernel lacks is a logged warning.

Whatever happens (exit, timeout, the pump cancelling the call), the whole process
group is SIGKILLed before the call returns, so nothing the program started
outlives it. Output is captured up to `max_output_bytes` per stream (`truncated`
says so; the rest is read and dropped so the child never blocks on a full pipe).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from agentd._errors import Denied
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import MaxLen, XmlName, xmlify
from agentd.confine import (
    SHIM_FAILED,
    SYSTEM_READ_PATHS,
    ConfinementUnavailable,
    Policy,
    check_enforceable,
    kill_group,
    landlock_status,
    resolve_executable,
    spawn,
)
from agentd.tools.beneath import relative_parts
from agentd.tools.command import CommandTemplate, TemplateError
from agentd.tools.content import xml_safe
from agentd.tools.kinds import Handler, LoadedTool, ToolUnavailable

log = logging.getLogger("agentd.tools")

NS = "https://xml-pipeline.org/ns/tools/exec/v1"
_VALUE_CHARS = 16384
_OUTPUT_CHARS = 64 * 1024 * 1024
_SHIM_PREFIX = b"confine: "


@xmlify(namespace=NS, tag="arg")
@dataclass
class Arg:
    name: Annotated[str, MaxLen(128), "the placeholder's name"]
    value: Annotated[str, MaxLen(_VALUE_CHARS), "the value (one argument)"]


@xmlify(namespace=NS, tag="run")
@dataclass
class Run:
    """Runs this tool's program with the given arguments."""

    arg: list[Arg]


@xmlify(namespace=NS, tag="run-result")
@dataclass
class RunResult:
    """How the program ended and what it wrote."""

    exit_code: Annotated[int, "the exit status; negative: killed by that signal",
                         XmlName("exit-code")]
    stdout: Annotated[str, MaxLen(_OUTPUT_CHARS)]
    stderr: Annotated[str, MaxLen(_OUTPUT_CHARS)]
    truncated: Annotated[bool, "true when output was cut at max_output_bytes"]


class _TimedOut(Exception):
    pass


class _ShimFailed(Exception):
    pass


def _text(data: bytes) -> str:
    """Output as XML can carry it: invalid UTF-8 and control characters replaced."""
    return xml_safe(data.decode("utf-8", "replace"))


async def exited(pid: int) -> None:
    """Until the process `pid` has exited. Not `Process.wait()`: asyncio's waits for
    its pipes to close too, which a background grandchild holding stdout delays
    until the group is killed. A pidfd becomes readable at exit."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # already exited and reaped
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _capture(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[:max(room, 0)]
    return bytes(kept), truncated


class ExecRunner:
    """The handler of one `exec` listener."""

    def __init__(self, template: CommandTemplate, policy: Policy, timeout_s: float,
                 max_output_bytes: int) -> None:
        self.template = template
        self.policy = policy
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes

    async def run(self, args: list[tuple[str, str]]) -> RunResult:
        argv = self.template.fill(args)
        proc = await spawn(argv, self.policy, stdin=subprocess.DEVNULL, check=False)
        assert proc.stdout is not None and proc.stderr is not None
        readers = (asyncio.ensure_future(_capture(proc.stdout, self.max_output_bytes)),
                   asyncio.ensure_future(_capture(proc.stderr, self.max_output_bytes)))
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await exited(proc.pid)
            except TimeoutError:
                raise _TimedOut from None
        finally:
            # Exit, timeout or cancellation: the group goes, with whatever it started;
            # then the pipes reach end of file (no process is left holding them).
            code = await kill_group(proc)
            (out, out_cut), (err, err_cut) = await asyncio.gather(*readers)
        if code == SHIM_FAILED and err.startswith(_SHIM_PREFIX):
            raise _ShimFailed(err[:500].decode("utf-8", "replace").strip())
        return RunResult(exit_code=code, stdout=_text(out), stderr=_text(err),
                         truncated=out_cut or err_cut)

    async def __call__(self, payload: Run, meta: HandlerMetadata) -> HandlerResponse:
        try:
            result = await self.run([(a.name, a.value) for a in payload.arg])
        except ValueError as exc:
            return HandlerResponse.error("invalid-payload", str(exc), retry_allowed=False)
        except _TimedOut:
            return HandlerResponse.error("timeout", "the program did not finish in time")
        except _ShimFailed as exc:
            log.error("exec: confinement could not be applied: %s", exc)
            return HandlerResponse.error("internal")
        return HandlerResponse.respond(result)


def policy_for(config: Any, program: str) -> Policy:
    """The confinement of one `exec` listener's children."""
    root = None if config.root is None else str(Path(config.root).resolve())
    cwd = root or "/"
    if config.cwd is not None:
        if root is None:
            raise ToolUnavailable("exec: cwd needs root (it is relative to root)")
        try:
            parts = relative_parts(config.cwd)
        except Denied:
            raise ToolUnavailable("exec: cwd must be a relative path inside root") from None
        cwd = os.path.join(root, *parts)
        if not os.path.isdir(cwd):
            raise ToolUnavailable(f"exec: cwd is not a folder inside root: {config.cwd}")
    own = os.path.dirname(program)
    reads = SYSTEM_READ_PATHS if own in SYSTEM_READ_PATHS else (*SYSTEM_READ_PATHS, own)
    return Policy(
        memory_mb=config.memory_mb,
        max_tasks=config.max_tasks,
        cpu_s=max(1, math.ceil(config.timeout_s)),
        read_paths=reads,
        write_paths=() if root is None else (root,),
        network=config.network,
        env=dict(config.env),
        cwd=cwd,
    )


@dataclass(frozen=True)
class ExecRun:
    """What an `exec` listener's handler runs, as checked at load: the command line
    with its program resolved, the confinement, and the limits of a call."""

    template: CommandTemplate
    policy: Policy
    timeout_s: float
    max_output_bytes: int


def describe(config: Any, listener: str) -> list[LoadedTool]:
    """Resolve the program and check the command line and its confinement."""
    try:
        template = CommandTemplate.parse(config.argv, config.allow_args)
        program = resolve_executable(config.argv[0], dict(config.env))
    except (TemplateError, FileNotFoundError) as exc:
        raise ToolUnavailable(f"exec: {exc}") from None
    if not os.access(program, os.X_OK):
        raise ToolUnavailable(f"exec: not an executable program: {program}")
    template = CommandTemplate(
        (program, *template.argv[1:]), template.patterns, template.leading,
        template.options_allowed)
    policy = policy_for(config, program)
    try:
        check_enforceable(policy)
    except ConfinementUnavailable as exc:
        raise ToolUnavailable(f"exec: {exc}") from None
    status = landlock_status()
    log.info("exec tool %s: program=%s landlock_abi=%d filesystem=%s network=%s",
             listener, program, status.abi, "confined" if status.filesystem else "NOT CONFINED",
             "allowed" if config.network else "denied")
    runs = ExecRun(template, policy, config.timeout_s, config.max_output_bytes)
    return [LoadedTool("exec", listener, (Run,), (RunResult,), Run.__doc__ or "", runs)]


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    return [ExecRunner(r.template, r.policy, r.timeout_s, r.max_output_bytes)
            for r in (spec.runs for spec in specs)]
