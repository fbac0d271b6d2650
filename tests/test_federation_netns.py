"""Two daemons in two network namespaces joined by a veth pair, which the test
creates and removes itself: the link comes up across a real (virtual) network,
nothing but the declared peer's address is involved, and alpha's client calls
beta's `echo` through it. Skipped with the reason where
`ip netns` is not permitted (it needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentd._envelope import build_envelope
from agentd._xmlify import to_xml
from agentd.tools.echo import Echo
from tests.daemon_process import ROOT, DaemonProcess, edit_config
from tests.network_namespaces import network
from tests.test_federation_daemons import (
    declare,
    federation_port,
    gateway_states,
    organism,
    public_line,
)

ADDRESS_A, ADDRESS_B = "10.231.7.1", "10.231.7.2"


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    with network(f"agentd{os.getpid()}") as net:
        ns_a, ns_b = net.namespace("a"), net.namespace("b")
        net.veth(f"{net.tag}va", f"{net.tag}vb", ns=ns_a, peer_ns=ns_b,
                 address=f"{ADDRESS_A}/30", peer_address=f"{ADDRESS_B}/30")
        yield ns_a, ns_b


async def test_link_across_two_network_namespaces(
    tmp_path: Path, namespaces: tuple[str, str]
) -> None:
    ns_a, ns_b = namespaces
    alpha, beta = organism(tmp_path, "alpha"), organism(tmp_path, "beta")
    edit_config(beta, lambda doc: doc["federation"].update(listen=f"{ADDRESS_B}:0"))
    declare(beta, "alpha", public_line(alpha, "alpha"))
    edit_config(beta, lambda doc: doc["gateways"][0].update(profile="public", export=["echo"]))
    b = await DaemonProcess(beta, wrapper=("ip", "netns", "exec", ns_b)).start()
    try:
        declare(alpha, "beta", public_line(beta, "beta"),
                f"wss://{ADDRESS_B}:{federation_port(b)}/federation")

        def imports(doc: dict[str, Any]) -> None:
            doc["gateways"][0]["import"] = ["echo"]
            doc["profiles"]["public"]["listeners"].append("beta:echo")

        edit_config(alpha, imports)
        a = await DaemonProcess(alpha, wrapper=("ip", "netns", "exec", ns_a)).start()
        try:
            await a.wait_for_line(r"federation gateway=beta up \(dialed\)")
            line = await b.wait_for_line(r"federation gateway=alpha up \(accepted\)")
            assert f"address={ADDRESS_A}:" in line  # alpha's veth address, not loopback
            assert gateway_states(a) == {"beta": "up"}
            # A call from alpha's client, inside alpha's namespace, to beta's echo.
            await a.wait_for_line(r"reloaded for newly pinned peer schemas")
            envelope = tmp_path / "call.xml"
            envelope.write_bytes(build_envelope(
                "alice", str(uuid.uuid4()), to_xml(Echo(text="across the veth")), to="beta:echo"))
            sent = subprocess.run(
                ["ip", "netns", "exec", ns_a, sys.executable, "-m", "agentd.cli", "send",
                 "--url", a.url, "--secret-file", str(alpha / "alice.totp"),
                 "--cafile", a.cafile, "--json", str(envelope)],
                cwd=ROOT, capture_output=True, text=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
            assert sent.returncode == 0, sent.stdout + sent.stderr
            assert "across the veth" in sent.stdout
        finally:
            await a.stop(signal.SIGKILL)
    finally:
        await b.stop(signal.SIGKILL)
