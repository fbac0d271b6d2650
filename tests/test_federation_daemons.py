"""Federation between real `agentd run` processes on loopback: links come up,
`agentctl status` shows them, a wrong key is refused as a security event, a peer
killed with SIGKILL is redialed once it is back, and check-config checks imported
listeners against the gateways that import them."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agentd.federation import Identity, load_identity
from tests.daemon_process import ROOT, DaemonProcess, edit_config, make_home

_FEDERATION = re.compile(r"federation listening url=wss://[0-9.]+:(\d+)/federation")


def public_line(home: Path, name: str) -> str:
    return load_identity(home / "identity.key", name).public_line


def organism(tmp: Path, name: str) -> Path:
    home = tmp / name
    make_home(home)

    def edit(doc: dict[str, Any]) -> None:
        doc["organism"]["name"] = name
        doc["federation"] = {"listen": "127.0.0.1:0",
                             "tls": {"cert": "tls/cert.pem", "key": "tls/key.pem"},
                             "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
        doc["gateways"] = []

    edit_config(home, edit)
    return home


def declare(home: Path, peer: str, key_line: str, url: str | None = None) -> None:
    def edit(doc: dict[str, Any]) -> None:
        entry: dict[str, Any] = {"name": peer, "public_key": key_line}
        if url is not None:
            entry["url"] = url
        doc["gateways"] = [g for g in doc["gateways"] if g["name"] != peer] + [entry]

    edit_config(home, edit)


def federation_port(daemon: DaemonProcess) -> int:
    for line in daemon.log:
        m = _FEDERATION.search(line)
        if m:
            return int(m.group(1))
    raise AssertionError("no federation listening line")


async def start(daemons: list[DaemonProcess], home: Path) -> DaemonProcess:
    d = DaemonProcess(home)
    daemons.append(d)
    return await d.start()


def gateway_states(daemon: DaemonProcess) -> dict[str, str]:
    code, doc = daemon.agentctl("status")
    assert code == 0, doc
    return {g["name"]: g["state"] for g in doc["result"]["status"]["gateways"]}


async def alpha_dials_beta(
    tmp: Path, daemons: list[DaemonProcess], alpha_key_at_beta: str | None = None
) -> tuple[DaemonProcess, DaemonProcess]:
    """beta accepts alpha (under `alpha_key_at_beta`, default alpha's real key);
    alpha dials beta. Returns (alpha, beta), both started."""
    alpha, beta = organism(tmp, "alpha"), organism(tmp, "beta")
    declare(beta, "alpha", alpha_key_at_beta or public_line(alpha, "alpha"))
    b = await start(daemons, beta)
    declare(alpha, "beta", public_line(beta, "beta"),
            f"wss://127.0.0.1:{federation_port(b)}/federation")
    return await start(daemons, alpha), b


async def test_two_daemons_link_up_and_status_shows_it(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a, b = await alpha_dials_beta(tmp_path, daemons)
    await a.wait_for_line(r"federation gateway=beta up \(dialed\)")
    await b.wait_for_line(r"federation gateway=alpha up \(accepted\)")
    assert gateway_states(a) == {"beta": "up"}
    assert gateway_states(b) == {"alpha": "up"}


async def test_wrong_key_is_refused_and_journaled_as_security(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    impostor = Identity("alpha", Ed25519PrivateKey.generate())
    a, b = await alpha_dials_beta(tmp_path, daemons, impostor.public_line)
    await b.wait_for_line(r"security kind=federation-handshake-failed .*bad signature")
    await a.wait_for_line(r"federation dial gateway=beta|security kind=federation-handshake")
    code, doc = b.agentctl("journal", "--limit", "50")
    assert code == 0
    kinds = [e["kind"] for e in doc["result"]["journal"]]
    assert "federation-handshake-failed" in kinds
    assert gateway_states(b) == {"alpha": "down"}
    assert gateway_states(a)["beta"] != "up"


async def test_peer_killed_with_sigkill_is_redialed_when_back(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    a, b = await alpha_dials_beta(tmp_path, daemons)
    port, beta = federation_port(b), b.home
    await a.wait_for_line(r"federation gateway=beta up")
    mark = len(a.log)
    await b.stop(signal.SIGKILL)
    await a.wait_for_line(r"federation gateway=beta down", after=mark)
    edit_config(beta, lambda doc: doc["federation"].update(listen=f"127.0.0.1:{port}"))
    await start(daemons, beta)
    await a.wait_for_line(r"federation gateway=beta up", after=mark)
    assert gateway_states(a) == {"beta": "up"}


def check_config(home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentd.cli", "check-config", str(home / "organism.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


def test_imports_are_checked_against_gateways_and_profiles(tmp_path: Path) -> None:
    alpha = organism(tmp_path, "alpha")
    key = Identity("beta", Ed25519PrivateKey.generate()).public_line

    def edit(doc: dict[str, Any]) -> None:
        doc["gateways"] = [{"name": "beta", "public_key": key, "profile": "public",
                            "export": ["echo"], "import": ["calculator"]}]
        doc["profiles"]["public"]["listeners"].append("beta:calculator")

    edit_config(alpha, edit)
    done = check_config(alpha)
    assert done.returncode == 0, done.stdout + done.stderr  # not pinned yet: not a listener

    def wrong(doc: dict[str, Any]) -> None:
        doc["profiles"]["public"]["listeners"].append("beta:echo")  # not imported
        doc["gateways"][0]["import"].append("gamma:x")  # a local name here

    edit_config(alpha, wrong)
    done = check_config(alpha)
    out = done.stdout + done.stderr
    assert done.returncode == 1
    assert "no gateway 'beta' imports 'echo'" in out
    assert "gateways[0].import[1]: 'gamma:x': a local listener name here" in out


def test_a_bad_declared_key_is_a_config_error(tmp_path: Path) -> None:
    alpha = organism(tmp_path, "alpha")
    declare(alpha, "beta", "ssh-rsa AAAAB3NzaC1yc2E= beta")
    done = check_config(alpha)
    assert done.returncode == 1 and "gateways[0].public_key" in done.stdout + done.stderr


async def test_three_daemons_an_undeclared_one_is_refused_the_others_stay_up(
    tmp_path: Path, daemons: list[DaemonProcess]
) -> None:
    """alpha and beta are linked; gamma, whom beta never declared, dials beta too."""
    a, b = await alpha_dials_beta(tmp_path, daemons)
    await a.wait_for_line(r"federation gateway=beta up")
    gamma = organism(tmp_path, "gamma")
    declare(gamma, "beta", public_line(b.home, "beta"),
            f"wss://127.0.0.1:{federation_port(b)}/federation")
    g = await start(daemons, gamma)
    await b.wait_for_line(r"security kind=federation-handshake-failed .*peer=gamma")
    await g.wait_for_line(r"security kind=federation-handshake-failed|federation dial")
    assert gateway_states(g)["beta"] != "up"
    assert gateway_states(b) == {"alpha": "up"}
    assert gateway_states(a) == {"beta": "up"}
