"""`hold` for daemon tests: blocks while AGENTD_TEST_HOLD=block (so requests are
accepted but unanswered when the daemon is killed), answers otherwise."""

from __future__ import annotations

import asyncio
import os
import sys

from agentd import HandlerMetadata, HandlerResponse
from tests.organisms.listeners import Done, Hold


async def hold(payload: Hold, meta: HandlerMetadata) -> HandlerResponse:
    if os.environ.get("AGENTD_TEST_HOLD") == "block":
        # The message is committed before its handler runs: tests wait for this line.
        print(f"hold: n={payload.n} blocking", file=sys.stderr, flush=True)
        await asyncio.Event().wait()
    return HandlerResponse.respond(
        Done(seq=payload.n, by="redelivered" if meta.redelivered else "hold")
    )
