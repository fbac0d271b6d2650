"""agentd's one bus client (docs/user-guide.md, "From Python").

`Client` makes calls: `await c.call(payload)` returns the answer or raises `Huh`;
`c.stream(payload)` yields its events (`Accepted`, `Partial` previews of a
model's text and each stream's `Final`, `Step`s of what the agent does,
`ApprovalRequired`, the `Answer` last).
`agentd send` and `agentd mcp-serve` use it. `BusClient` is the connection
underneath (raw frames; tests use it for hostile input).
"""

from agentd.client._calls import (
    Accepted,
    Answer,
    ApprovalRequired,
    Event,
    Final,
    Huh,
    Other,
    Partial,
    Step,
)
from agentd.client._client import Client, Exchange, read_secret, read_session_file
from agentd.client._connection import (
    AuthenticationFailed,
    BusClient,
    BusError,
    frame_kind,
    is_answer,
)

__all__ = [
    "Accepted",
    "Answer",
    "ApprovalRequired",
    "AuthenticationFailed",
    "BusClient",
    "BusError",
    "Client",
    "Event",
    "Exchange",
    "Final",
    "Huh",
    "Other",
    "Partial",
    "Step",
    "frame_kind",
    "is_answer",
    "read_secret",
    "read_session_file",
]
