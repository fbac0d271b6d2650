"""`hold` for daemon tests: blocks while AGENTD_TEST_HOLD=block (so requests are
accepted but unanswered when the daemon is killed), answers otherwise."""

from __future__ import annotations

import asyncio
import os

from agentd import HandlerMetadata, HandlerResponse
from tests.organisms.listeners import Done, Hold


async def hold(payload: Hold, meta: HandlerMetadata) -> HandlerResponse:
    if os.environ.get("AGENTD_TEST_HOLD") == "block":
        await asyncio.Event().wait()
    return HandlerResponse.respond(
        Done(seq=payload.n, by="redelivered" if meta.redelivered else "hold")
    )
