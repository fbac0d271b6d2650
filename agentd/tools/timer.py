"""The `timer` tool: `wait` {seconds, note?} -> later, `woke` {note, late}.

The handler only checks the request against the tool's limits and returns a
`TimerRequest` at once; the pump makes the timer durable in the same transaction as
the step that handled `wait`, and the daemon's deadline scheduler answers the call
when it is due (see `agentd.durable`). Refusals (a delay over `max_delay_s`, a
negative or non-finite delay) are `huh denied` with a security event, like any
tool's confinement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentd._errors import Denied
from agentd._handler import HandlerMetadata
from agentd.config.tools import TimerTool
from agentd.durable.timers import TimerRequest, Wait, Woke
from agentd.tools.kinds import Handler, LoadedTool


def describe(config: TimerTool, listener: str) -> Sequence[LoadedTool]:
    """The tool as loaded: its `tool:` block is all its handler needs."""
    return (LoadedTool("timer", listener, (Wait,), (Woke,),
                     "Waits the given number of seconds, then answers with woke.", config),)


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    return [_waiter(spec.runs) for spec in specs]


def _waiter(config: TimerTool) -> Handler:
    max_delay = float(config.max_delay_s)
    max_pending = int(config.max_pending_per_thread)

    async def wait(payload: Wait, meta: HandlerMetadata) -> Any:
        seconds = payload.seconds
        if not seconds.is_finite() or seconds < 0:
            raise Denied("timer delay is negative or not a number", seconds=str(seconds))
        if seconds > max_delay:
            raise Denied("timer delay over max_delay_s", seconds=str(seconds),
                         max_delay_s=str(max_delay))
        return TimerRequest(float(seconds), payload.note or "", max_pending)

    return wait
