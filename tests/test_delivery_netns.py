"""Acknowledged delivery across a real link cut: the daemon runs in a network
namespace of its own, joined to the test's by a veth pair the test creates and
removes. The client's calls are accepted, the link goes down before their answers
(timers a second long) are written, so the daemon writes them into a socket whose
peer cannot hear; the client's keepalive gives the old connection up, and when the
link is up again it resumes with its session token and the last delivery seq it
received: every answer arrives, each once. Skipped with the reason where `ip netns`
is not permitted (it needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from agentd._cli_bus import init_home
from agentd.client import Accepted, Answer, Client
from agentd.durable.timers import Wait, Woke
from tests.daemon_process import DaemonProcess
from tests.network_namespaces import ip, network

HOST, DAEMON = "10.231.9.1", "10.231.9.2"
CALLS = 20


@pytest.fixture
def link() -> Iterator[tuple[str, str]]:
    """(the daemon's namespace, the test's end of the veth pair)."""
    with network(f"agd{os.getpid()}") as net:
        ns = net.namespace("d")
        here = f"{net.tag}h"
        net.veth(here, f"{net.tag}t", peer_ns=ns, address=f"{HOST}/30",
                 peer_address=f"{DAEMON}/30")
        yield ns, here


def home_on(home: Path) -> None:
    """`agentd init` with the bus on the daemon's veth address, plus a timer."""
    init_home(home, host=DAEMON, port=0, metrics="127.0.0.1:0")
    path = home / "organism.yaml"
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["listeners"].append({"name": "clock", "tool": {"kind": "timer", "max_delay_s": 60}})
    doc["profiles"]["public"]["listeners"].append("clock")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


async def test_answers_written_while_the_link_is_down_arrive_once_after_the_resume(
    tmp_path: Path, link: tuple[str, str],
) -> None:
    ns, here = link
    home = tmp_path / "home"
    home_on(home)
    d = await DaemonProcess(home, wrapper=("ip", "netns", "exec", ns)).start()
    try:
        assert d.url.startswith(f"wss://{DAEMON}:")
        async with Client.connect(d.url, "alice", secret=d.secret, cafile=d.cafile,
                                  ping_interval=0.5, ping_timeout=0.5,
                                  open_timeout=1.0) as c:
            first = c.session
            calls = [await c.start(Wait(seconds=Decimal("1.5"), note=f"n{i}"), timeout=120)
                     for i in range(CALLS)]
            streams = [call.events() for call in calls]
            for events in streams:  # every call is in before the link goes
                assert isinstance(await anext(events), Accepted)
            assert ip("link", "set", here, "down").returncode == 0
            # The timers fire 1.5 s on: the daemon writes every answer into a socket
            # whose peer cannot hear, and the client's keepalive gives that link up.
            await asyncio.sleep(3.0)
            assert ip("link", "set", here, "up").returncode == 0
            answers = [await anext(events) for events in streams]
            assert c.session == first  # resumed with its session, no new TOTP code
        log = "\n".join(d.log)
    finally:
        ip("link", "set", here, "up")
        assert await d.stop() == 0
    assert all(isinstance(a, Answer) and isinstance(a.payload, Woke) for a in answers)
    assert sorted(a.payload.note for a in answers) == sorted(f"n{i}" for i in range(CALLS))
    assert "outbox replay client=alice" in log  # they came again, from the outbox
    assert not [o for o in c.others if o.tag.endswith("}woke")]  # and none twice
