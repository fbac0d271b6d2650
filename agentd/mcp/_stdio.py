"""The stdio transport to an MCP server we spawned confined.

The SDK's `stdio_client` spawns the server itself (with the host's environment and
no confinement) and passes unparsable lines on as exceptions. Here the process
comes from `agentd.confine.spawn` and its stdout is JSON-RPC only: the first line
that is not a JSON-RPC message, or a line longer than the cap (a flood), ends the
session: the process group is killed and the reason is kept for the log and the
restart. So do messages that answer nothing we asked past `UNASKED_PER_S` a second
(after a burst): notifications, requests, and answers to an id that is not one of
our requests in flight (those are dropped, never handed to the session): valid
JSON-RPC can flood too. The SDK's
`ClientSession` runs over the two memory streams this yields.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from mcp import types
from mcp.shared.message import SessionMessage

from agentd.bus import TokenBucket
from agentd.confine import Policy, kill_group, spawn

log = logging.getLogger("agentd.mcp")
STDERR_KEEP = 4096  # the last bytes of a server's stderr, for the log when it dies
UNASKED_PER_S = 100.0  # notifications, requests and stray answers from a server, a second
_UNASKED_BURST = 1000
_ANSWERS = (types.JSONRPCResponse, types.JSONRPCError)


def _take(in_flight: set[types.RequestId], request_id: types.RequestId) -> bool:
    """Whether `request_id` was in flight (it no longer is)."""
    if request_id in in_flight:
        in_flight.discard(request_id)
        return True
    return False


@dataclass
class Ending:
    """Why a session ended, set once by whichever side noticed first."""

    reason: str = ""
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    stderr: str = ""  # the last line or so the server wrote there, once it has ended

    def set(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason


# Children alive in this process, killed if the daemon exits without closing them.
_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_live_groups() -> None:
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def confined_stdio(
    argv: list[str], policy: Policy, *, max_line: int, ending: Ending,
) -> AsyncIterator[tuple[anyio.abc.ObjectReceiveStream, anyio.abc.ObjectSendStream]]:
    proc = await spawn(argv, policy, check=False)
    _LIVE_GROUPS.add(proc.pid)
    assert proc.stdin and proc.stdout and proc.stderr
    to_session, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](16)
    write_stream, from_session = anyio.create_memory_object_stream[SessionMessage](16)
    stderr_tail = bytearray()
    # The ids of our requests the server has not answered yet (written by write_stdin
    # before the request goes out, so an answer never arrives before its id).
    in_flight: set[types.RequestId] = set()

    async def read_stdout() -> None:
        try:
            async with to_session:
                await pass_messages()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            ending.set("session closed")
        finally:
            ending.ended.set()
        # Keep reading to the end: a pipe nobody reads keeps a killed child unreaped.
        while await proc.stdout.read(65536):  # type: ignore[union-attr]
            pass

    async def pass_messages() -> None:
        loop = asyncio.get_running_loop()
        unasked = TokenBucket(UNASKED_PER_S, _UNASKED_BURST, loop.time())
        buffer = b""
        while chunk := await proc.stdout.read(65536):  # type: ignore[union-attr]
            *lines, buffer = (buffer + chunk).split(b"\n")
            if len(buffer) > max_line or any(len(line) > max_line for line in lines):
                ending.set(f"server wrote a line over {max_line} bytes")
                return
            for line in lines:
                if not line.strip():
                    continue
                try:
                    message = types.JSONRPCMessage.model_validate_json(line)
                except ValueError:
                    ending.set("server wrote something other than JSON-RPC on its output")
                    return
                answer = isinstance(message.root, _ANSWERS)
                asked = answer and _take(in_flight, message.root.id)  # type: ignore[union-attr]
                if not asked and not unasked.take(loop.time()):
                    ending.set(f"server sent more than {UNASKED_PER_S:.0f} notifications, "
                               "requests or answers to nothing asked a second")
                    return
                if answer and not asked:
                    continue  # it answers nothing of ours: the session never sees it
                await to_session.send(SessionMessage(message))
        ending.set("server closed its output")

    async def write_stdin() -> None:
        async with from_session:
            async for item in from_session:
                if isinstance(item.message.root, types.JSONRPCRequest):
                    in_flight.add(item.message.root.id)
                data = item.message.model_dump_json(by_alias=True, exclude_none=True)
                try:
                    proc.stdin.write(data.encode() + b"\n")  # type: ignore[union-attr]
                    await proc.stdin.drain()  # type: ignore[union-attr]
                except (BrokenPipeError, ConnectionResetError):
                    ending.set("server closed its input")
                    return

    async def drain_stderr() -> None:
        while chunk := await proc.stderr.read(65536):  # type: ignore[union-attr]
            stderr_tail.extend(chunk)
            del stderr_tail[:-STDERR_KEEP]

    tasks = [asyncio.ensure_future(f()) for f in (read_stdout, write_stdin, drain_stderr)]
    failed = False
    try:
        yield read_stream, write_stream
    except BaseException:
        failed = True
        raise
    finally:
        # Ended by us (check-config and reload list the tools and stop it; a reload
        # retires it): not an alert. Ended on its own, or a session that failed: one.
        ours = not failed and not ending.reason
        tasks[1].cancel()  # the writer: nothing more goes in
        code = await kill_group(proc)  # the reader and stderr drain to the end
        _LIVE_GROUPS.discard(proc.pid)
        await asyncio.gather(*tasks, return_exceptions=True)
        ending.stderr = bytes(stderr_tail[-512:]).decode("utf-8", "replace").strip()
        if ours:
            log.debug("mcp server stopped (argv[0]=%s)", argv[0])
        elif ending.reason or code not in (0, -9):
            ending.set(f"server exited with {code}")
            log.error("mcp server ended: %s (argv[0]=%s); stderr tail: %r",
                      ending.reason, argv[0], ending.stderr)
