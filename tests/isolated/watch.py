"""What the isolation and confinement tests watch from outside: whether a process
still lives, and whether anything connected to a loopback server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def gone(pid: int, seconds: float = 3.0) -> bool:
    """Wait (bounded, not timed) for `pid` to be reaped by whoever inherits it."""
    for _ in range(int(seconds * 100)):
        if not alive(pid):
            return True
        await asyncio.sleep(0.01)
    return False


@contextlib.asynccontextmanager
async def recording_server() -> AsyncIterator[tuple[int, list[object]]]:
    """A loopback TCP server that records every connection it accepts: (port, accepted)."""
    accepted: list[object] = []

    async def on_conn(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)
        w.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], accepted
