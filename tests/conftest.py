"""Test-wide settings. Under CI (CI=true), hypothesis runs derandomized: the same
examples on every run, so a submission cannot pass or fail by the luck of the draw.
Locally the search stays random, which is how new counterexamples are found.
No profile has a per-example deadline: speed is measured by benchmarks/, never
asserted by a test (a loaded 2-core machine once failed a kernel property at 252 ms
against hypothesis's default 200 ms)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest
from hypothesis import settings

from tests.daemon_process import DaemonProcess

settings.register_profile("local", deadline=None)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True,
                          deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "local")


@pytest.fixture
async def daemons() -> AsyncIterator[list[DaemonProcess]]:
    """Real `agentd run` processes a test starts; any still running is killed."""
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        if d.proc is not None and d.proc.returncode is None:
            await d.stop(signal.SIGKILL)
