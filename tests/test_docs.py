"""The README and the guides, run as a newcomer would follow them.

Each document's fenced code blocks are taken in order, in a scratch folder of its own:

- a `sh` block runs in bash (`set -euo pipefail`) and must exit 0; variables it
  exports are seen by the blocks after it, as in one terminal session;
- `<!-- doc-test: background -->` on the line before a `sh` block: it runs in the
  background (a daemon); the next block waits until it logs "bus listening", and it
  must stop with exit 0 on SIGTERM once the document's blocks are done;
- `<!-- doc-test: file PATH -->`: the block is written to PATH (a module, a YAML
  file, a test the next `sh` block runs);
- `<!-- doc-test: skip REASON -->`: not run, and the reason is stated;
- other blocks are checked for what they are: `python` compiles, `yaml` parses,
  `xml` is well-formed.

The scratch folder has `.venv` pointing at the interpreter running the tests, and its
`bin` first on PATH (an activated venv). The README's install prefix
(`python3 -m venv .venv && .venv/bin/pip install -e . && `) is therefore dropped:
installing is what `.ci/run` does and what `.ci/wheel-smoke` checks from a wheel.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from lxml import etree

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "docs/listener-guide.md", "docs/operations.md",
             "docs/user-guide.md", "docs/agentctl.md"]
INSTALL_PREFIX = "python3 -m venv .venv && .venv/bin/pip install -e . && "
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
_MARK = re.compile(r"<!-- doc-test: (skip|file|background)\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int
    language: str
    text: str
    mark: str  # "", "skip", "file" or "background"
    argument: str  # the skip reason or the file's path

    def __str__(self) -> str:
        return f"{self.document}:{self.line} ({self.language or 'text'})"


def blocks(document: str) -> list[Block]:
    text = (ROOT / document).read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        found.append(Block(document, text.count("\n", 0, match.start()) + 1, match.group(1),
                           match.group(2), mark.group(1) if mark else "",
                           mark.group(2) if mark else ""))
    return found


def test_every_mark_is_on_a_block_and_every_skip_says_why() -> None:
    for document in DOCUMENTS:
        text = (ROOT / document).read_text(encoding="utf-8")
        marks = len(re.findall(r"<!-- doc-test:", text))
        marked = [b for b in blocks(document) if b.mark]
        assert marks == len(marked), f"{document}: a doc-test mark not right above a block"
        for block in marked:
            assert block.argument or block.mark == "background", block
            assert block.mark != "background" or block.language == "sh", block


def test_the_readme_keeps_the_ci_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = [b.text.strip() for b in blocks("README.md") if b.language == "sh"]
    command = "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/pytest"
    assert command in readme and f"\n{command}\n" in ci


class Session:
    """One terminal session in a scratch folder: exported variables carry over."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.env_file = folder / ".doc-env"
        venv = Path(sys.prefix)
        (folder / ".venv").symlink_to(venv)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTCTL_", "PYTEST"))}
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["HOME"] = str(folder)
        self.env = env
        self.env_file.write_text("")
        self.daemons: list[Daemon] = []
        self.holder: subprocess.Popen[bytes] | None = None
        self.prefix = self._own_network()

    def _own_network(self) -> list[str]:
        """The documents name fixed ports (8765, 9464...): where it may (root, with
        unshare, nsenter and ip), the session runs in a network namespace of its own,
        with only loopback, so a port in use elsewhere on the machine (another test
        run, a daemon) cannot clash with it. Elsewhere it runs as a newcomer would."""
        tools = ("unshare", "nsenter", "ip")
        if os.geteuid() != 0 or not all(shutil.which(t) for t in tools):
            return []
        holder = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c",
             "ip link set lo up && echo up && exec sleep 86400"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"up":
            holder.kill()
            holder.wait()
            return []
        self.holder = holder
        return ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]

    def close(self) -> None:
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()

    def script(self, block: Block) -> str:
        body = block.text.replace(INSTALL_PREFIX, "")
        return (f"set -euo pipefail\nsource {self.env_file}\n{body}\n"
                f"export -p > {self.env_file}\n")

    def run(self, block: Block) -> None:
        self.wait_for_daemons()
        proc = subprocess.run([*self.prefix, "bash", "-c", self.script(block)],
                              cwd=self.folder, env=self.env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{block} failed:\n{block.text}\n{proc.stdout}{proc.stderr}"

    def start(self, block: Block) -> None:
        command = block.text.replace(INSTALL_PREFIX, "").strip()
        assert "\n" not in command and "&&" not in command, f"{block}: one command to exec"
        proc = subprocess.Popen([*self.prefix, "bash", "-c",
                                 f"source {self.env_file}\nexec {command}"],
                                cwd=self.folder,
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        daemon = Daemon(block, proc)
        threading.Thread(target=daemon.drain, daemon=True).start()
        self.daemons.append(daemon)

    def wait_for_daemons(self) -> None:
        for daemon in self.daemons:
            ready = daemon.listening.wait(timeout=120)
            assert ready and daemon.proc.poll() is None, f"{daemon.block} never listened:\n" + (
                b"".join(daemon.output).decode(errors="replace"))

    def stop(self) -> None:
        for daemon in self.daemons:
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
            try:
                code = daemon.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.proc.kill()
                raise
            output = b"".join(daemon.output).decode(errors="replace")
            assert code == 0, f"{daemon.block} exited {code}:\n{output}"
        self.daemons = []


class Daemon:
    """A background block's process; its output is read as it comes (so it never
    blocks on a full pipe), and `listening` is set once it logs "bus listening"."""

    def __init__(self, block: Block, proc: subprocess.Popen[bytes]) -> None:
        self.block = block
        self.proc = proc
        self.output: list[bytes] = []
        self.listening = threading.Event()

    def drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if b"bus listening" in line:
                self.listening.set()
        self.listening.set()  # it exited: the waiter sees poll() is not None


@contextlib.contextmanager
def session(folder: Path) -> Iterator[Session]:
    s = Session(folder)
    try:
        yield s
    finally:
        for daemon in s.daemons:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
        s.close()


def check_text(block: Block) -> None:
    if block.language == "python":
        compile(block.text, str(block), "exec")
    elif block.language == "yaml":
        yaml.safe_load(block.text)
    elif block.language == "xml":
        etree.fromstring(block.text.encode())


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_document_runs_as_written(document: str, tmp_path: Path) -> None:
    ran = 0
    with session(tmp_path) as shell:
        for block in blocks(document):
            if block.mark == "skip":
                continue
            if block.mark == "file":
                path = tmp_path / block.argument
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(block.text)
            elif block.mark == "background":
                shell.start(block)
            elif block.language == "sh":
                shell.run(block)
                ran += 1
            else:
                check_text(block)
        shell.stop()
    assert ran or not any(b.language == "sh" and not b.mark for b in blocks(document))
