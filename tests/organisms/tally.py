"""`tally` for the failover tests: every run of the handler is written down (one
line appended to the file AGENTD_TEST_RUNS names: the daemon's pid and the message's
number) before it answers, so a test can tell which daemon ran what, and how often."""

from __future__ import annotations

import os
from dataclasses import dataclass

from agentd import HandlerMetadata, HandlerResponse, xmlify
from tests.organisms.listeners import NS, Done


@xmlify(namespace=f"{NS}/tally/v1")
@dataclass
class Tally:
    n: int


async def tally(payload: Tally, meta: HandlerMetadata) -> HandlerResponse:
    fd = os.open(os.environ["AGENTD_TEST_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                 0o600)
    try:
        os.write(fd, f"{os.getpid()} {payload.n}\n".encode())  # one write: one line
    finally:
        os.close(fd)
    return HandlerResponse.respond(Done(seq=payload.n, by="tally"))


# Its declaration, for `make_home(home, extra_listeners=[LISTENER])`.
LISTENER = {"name": "tally", "payload_class": "tests.organisms.tally:Tally",
            "response_class": "tests.organisms.listeners:Done",
            "handler": "tests.organisms.tally:tally",
            "description": "Writes down each of its runs, then answers."}
