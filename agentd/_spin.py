"""Spinning briefly before a blocking read, for the child processes that serve the
daemon one request at a time (the kernel's writer, isolation workers).

On this kind of virtual machine, waking a process that sleeps in `read()` costs
50-100 us on each side, about as much as the request itself. A request that follows
the last answer closely is read without the child first going to sleep if it polls
for a moment instead. Standard library only: the children import it early.
"""

from __future__ import annotations

import select
import time

SPIN_S = 0.0002


def wait_readable(poller: select.poll, spin_s: float = SPIN_S) -> None:
    """Poll for up to `spin_s` before the caller's blocking read. Bounded: at most
    `spin_s` of CPU per call, nothing while idle."""
    deadline = time.perf_counter() + spin_s
    while time.perf_counter() < deadline:
        if poller.poll(0):
            return
