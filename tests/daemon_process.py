"""A real `agentd run` child process for end-to-end tests: a home made by
`agentd init` (bus and metrics on port 0), the ports read from its log lines."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from agentd._cli_bus import init_home

ROOT = Path(__file__).resolve().parent.parent
_BUS = re.compile(r"bus listening url=(wss://[0-9.]+:\d+/bus)")
_METRICS = re.compile(r"metrics listening url=(http://[0-9.]+:\d+)/metrics")
_OOB = re.compile(r"oob: listening on (\S+) \(keys")

TEST_LISTENERS = [
    {
        "name": "hold",
        "payload_class": "tests.organisms.listeners:Hold",
        "response_class": "tests.organisms.listeners:Done",
        "handler": "tests.organisms.env_hold:hold",
        "description": "Blocks while AGENTD_TEST_HOLD=block, answers otherwise.",
    },
]


def make_home(home: Path, extra_listeners: list[dict[str, Any]] | None = None) -> Path:
    """`agentd init` into `home` with ports 0, plus the test listeners in `public`."""
    init_home(home, port=0, metrics="127.0.0.1:0")
    path = home / "organism.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["listeners"].extend(TEST_LISTENERS + (extra_listeners or []))
    doc["profiles"]["public"]["listeners"].extend(
        lst["name"] for lst in TEST_LISTENERS + (extra_listeners or [])
    )
    doc["pump"]["handler_timeout_s"] = 600
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def edit_config(home: Path, edit: Any) -> None:
    path = home / "organism.yaml"
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


class DaemonProcess:
    def __init__(self, home: Path, env: dict[str, str] | None = None,
                 wrapper: tuple[str, ...] = (), args: tuple[str, ...] = ()) -> None:
        self.home = home
        self.args = args  # more options of `agentd run` (--standby, --state-dir DIR)
        self.env = env or {}
        self.wrapper = wrapper  # a command the daemon runs under (e.g. `ip netns exec NS`)
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.metrics_url = ""
        self.socket = ""
        self.log: list[str] = []
        self._logged = asyncio.Event()  # set whenever a line is added to `log`
        self._drain: asyncio.Task[None] | None = None

    @property
    def secret(self) -> str:
        return (self.home / "alice.totp").read_text().strip()

    @property
    def cafile(self) -> str:
        return str(self.home / "tls" / "cert.pem")

    async def start(self, timeout: float = 30.0,
                    until: tuple[str, ...] = ("url", "socket", "metrics_url")
                    ) -> DaemonProcess:
        """Start it; return once it logged where each of `until` listens (a standby
        waiting for the lease opens its OOB socket only: until=("socket",))."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.wrapper,
            sys.executable,
            "-m",
            "agentd.cli",
            "run",
            "--config",
            str(self.home / "organism.yaml"),
            *self.args,
            cwd=ROOT,
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT), **self.env},
        )
        assert self.proc.stderr is not None
        async with asyncio.timeout(timeout):
            while not all(getattr(self, attr) for attr in until):
                line = (await self.proc.stderr.readline()).decode()
                if not line:
                    raise RuntimeError("agentd exited:\n" + "".join(self.log))
                self.log.append(line)
                for pattern, attr in ((_BUS, "url"), (_METRICS, "metrics_url"), (_OOB, "socket")):
                    m = pattern.search(line)
                    if m:
                        setattr(self, attr, m.group(1))
        self._drain = asyncio.create_task(self._read_rest())
        return self

    async def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.log.append(line.decode())
            self._logged.set()
        self._logged.set()

    async def wait_for_line(self, pattern: str, after: int = 0, timeout: float = 30.0) -> str:
        """The first log line from index `after` on matching `pattern` (a regex),
        waiting for the daemon to write it."""
        regex = re.compile(pattern)
        seen = after
        async with asyncio.timeout(timeout):
            while True:
                for line in self.log[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.log)
                if self._drain is not None and self._drain.done():
                    raise RuntimeError(f"agentd exited before logging {pattern!r}")
                self._logged.clear()
                await self._logged.wait()

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
        if self._drain is not None:
            await self._drain
        return code

    async def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        async with asyncio.timeout(timeout):
            return await self.proc.wait()

    def agentctl(self, *args: str) -> tuple[int, Any]:
        """Run `agentctl --json ARGS` as a real subprocess; (exit code, JSON document)."""
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "agentctl",
                "--socket",
                self.socket,
                "--key",
                str(self.home / "operator.key"),
                "--key-id",
                "ops-1",
                "--json",
                *args,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            doc = json.loads(done.stdout) if done.stdout.strip() else None
        except json.JSONDecodeError:
            doc = done.stdout
        return done.returncode, doc
