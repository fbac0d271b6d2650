"""Network namespaces and veth links a test makes and removes (`ip netns`, iproute2).

`network(tag)` yields a `Network` that names what it makes after `tag` (a name of
the test's process, so two runs of different tests do not collide; kernel interface
names are at most 15 characters) and removes it all on leaving: the namespaces
(which takes their ends of the veths with them) and the ends left in the test's
namespace. Where iproute2 is missing, a namespace may not be made (it needs root,
or CAP_SYS_ADMIN and CAP_NET_ADMIN) or a step fails, the test is skipped with the
reason.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _in(ns: str | None) -> tuple[str, ...]:
    return ("-n", ns) if ns else ()


class Network:
    def __init__(self, tag: str) -> None:
        self.tag = tag
        self._namespaces: list[str] = []
        self._here: list[str] = []  # veth ends in the test's own namespace

    def namespace(self, role: str) -> str:
        """A new namespace `<tag><role>` with its loopback up; its name."""
        name = f"{self.tag}{role}"
        made = ip("netns", "add", name)
        if made.returncode != 0:
            pytest.skip(f"`ip netns add` is not permitted here: {made.stderr.strip()}")
        self._namespaces.append(name)
        self._run((*_in(name), "link", "set", "lo", "up"))
        return name

    def veth(self, end: str, peer: str, *, ns: str | None = None, peer_ns: str | None = None,
             address: str | None = None, peer_address: str | None = None) -> None:
        """A veth pair `end` to `peer`, each end moved into its namespace (None: the
        test's), given its address (with its prefix, `10.0.0.1/30`) if any, and up."""
        self._run(("link", "add", end, "type", "veth", "peer", "name", peer))
        if ns is None or peer_ns is None:
            self._here.append(end if ns is None else peer)
        for name, where, cidr in ((end, ns, address), (peer, peer_ns, peer_address)):
            if where is not None:
                self._run(("link", "set", name, "netns", where))
            if cidr is not None:
                self._run((*_in(where), "addr", "add", cidr, "dev", name))
            self._run((*_in(where), "link", "set", name, "up"))

    def bridge(self, ns: str, name: str, ports: list[str]) -> None:
        """A bridge `name` in `ns`, up, switching between `ports` (veth ends in `ns`)."""
        self._run(("-n", ns, "link", "add", name, "type", "bridge"))
        self._run(("-n", ns, "link", "set", name, "up"))
        for port in ports:
            self._run(("-n", ns, "link", "set", port, "master", name))

    def _run(self, step: tuple[str, ...]) -> None:
        done = ip(*step)
        if done.returncode != 0:
            pytest.skip(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")

    def remove(self) -> None:
        for end in self._here:  # deletes both ends
            ip("link", "delete", end)
        for name in self._namespaces:
            ip("netns", "delete", name)


@contextmanager
def network(tag: str) -> Iterator[Network]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    made = Network(tag)
    try:
        yield made
    finally:
        made.remove()
