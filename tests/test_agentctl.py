"""`agentctl` against a real OobServer on a real socket: every command, the exit
codes of docs/commands.md, --json, environment defaults, keygen, completion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from lxml import etree

from agentctl._render import render_text, result_to_text
from agentctl.cli import main
from agentd.oob import load_authorized_keys, load_private_key
from tests.test_oob_fixtures import THREAD, XSD, ServerThread, make_key

ROOT = Path(__file__).resolve().parent.parent


class Env:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.key, self.key_path, line = make_key(tmp, "ops-1")
        self.other, self.other_path, _ = make_key(tmp, "intruder")
        self.authorized = tmp / "authorized_keys"
        self.authorized.write_text(line + "\n")
        self.socket = tmp / "oob.sock"

    def base(self, key: Path | None = None) -> list[str]:
        return ["--socket", str(self.socket), "--key", str(key or self.key_path)]


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return Env(tmp_path)


@pytest.fixture
def server(env: Env) -> Iterator[ServerThread]:
    with ServerThread(env.socket, env.authorized) as srv:
        yield srv


def ctl(env: Env, *args: str, key: Path | None = None, json_out: bool = False,
        environ: dict[str, str] | None = None) -> Any:
    argv = env.base(key) + (["--json"] if json_out else []) + list(args)
    return CliRunner().invoke(main, argv, env=environ, prog_name="agentctl")


def ctl_json(env: Env, *args: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    result = ctl(env, *args, json_out=True, **kw)
    return result.exit_code, json.loads(result.stdout)


def run_ctl(*args: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """agentctl as a real process."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(environ or {})}
    return subprocess.run([sys.executable, "-m", "agentctl.cli", *args], capture_output=True,
                          text=True, env=full_env, cwd=ROOT, timeout=60)


# --- every command, human and JSON ----------------------------------------------------


def test_status(env: Env, server: ServerThread) -> None:
    result = ctl(env, "status")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "status:",
        "  organism: hello",
        "  uptime_s: 12.5",
        "  config_sha256: abc123",
        "  listeners:",
        "    - calculator.add",
        "    - greeter",
        "  threads: 3",
        "  queue_depth: 0",
    ]
    code, doc = ctl_json(env, "status")
    assert code == 0
    assert doc == {"ok": True, "error": None, "result": {"status": {
        "organism": "hello", "uptime_s": 12.5, "config_sha256": "abc123",
        "listeners": ["calculator.add", "greeter"], "threads": 3, "queue_depth": 0,
    }}}


@pytest.mark.parametrize(("flags", "dry"), [([], False), (["--dry-run"], True)])
def test_reload(env: Env, server: ServerThread, flags: list[str], dry: bool) -> None:
    result = ctl(env, "reload", *flags)
    assert result.exit_code == 0
    assert server.commands.calls[-1] == ("reload", {"dry-run": "true" if dry else "false"})
    assert "  added:\n    - new.one\n  removed: (none)\n" in result.stdout
    code, doc = ctl_json(env, "reload", *flags)
    assert code == 0
    assert doc["result"]["reload"] == {
        "added": ["new.one"], "removed": [], "changed": ["greeter"], "version": 2,
        "dry_run": dry}


@pytest.mark.parametrize(("argv", "args"), [
    (["capabilities"], {"what": "capabilities"}),
    (["schema", "calculator.add"], {"what": "schema", "name": "calculator.add"}),
    (["example", "calculator.add"], {"what": "example", "name": "calculator.add"}),
    (["prompt", "calculator.add"], {"what": "prompt", "name": "calculator.add"}),
    (["threads"], {"what": "threads"}),
    (["thread", THREAD], {"what": "thread", "thread": THREAD}),
])
def test_introspect(env: Env, server: ServerThread, argv: list[str],
                    args: dict[str, str]) -> None:
    result = ctl(env, "introspect", *argv)
    assert result.exit_code == 0, result.output
    assert server.commands.calls[-1] == ("introspect", args)
    assert result.stdout.strip()


def test_introspect_schema_prints_the_xsd_as_is(env: Env, server: ServerThread) -> None:
    assert ctl(env, "introspect", "schema", "calculator.add").stdout == XSD + "\n"
    code, doc = ctl_json(env, "introspect", "schema", "calculator.add")
    assert (code, doc["result"]) == (0, XSD)


def test_introspect_thread_maps_uuid_to_path(env: Env, server: ServerThread) -> None:
    code, doc = ctl_json(env, "introspect", "thread", THREAD)
    assert code == 0
    assert doc["result"] == {"thread": {"uuid": THREAD, "path": "alice.relay.calculator.add"}}


def test_journal(env: Env, server: ServerThread) -> None:
    result = ctl(env, "journal", "--thread", THREAD, "--limit", "2")
    assert result.exit_code == 0
    assert server.commands.calls[-1] == ("journal", {"thread": THREAD, "limit": "2"})
    assert result.stdout.splitlines()[:4] == [
        "journal:", "  - seq: 1", f"    thread: {THREAD}", "    text: message 1"]
    ctl(env, "journal")
    assert server.commands.calls[-1] == ("journal", {})
    code, doc = ctl_json(env, "journal", "--limit", "1")
    assert code == 0
    assert doc["result"] == {"journal": [{"seq": "1", "thread": THREAD, "#text": "message 1"}]}


@pytest.mark.parametrize(("flags", "mode"), [([], "graceful"), (["--now"], "now")])
def test_shutdown(env: Env, server: ServerThread, flags: list[str], mode: str) -> None:
    result = ctl(env, "shutdown", *flags)
    assert result.exit_code == 0
    assert server.commands.calls[-1] == ("shutdown", {"mode": mode})


def test_every_command_is_audited(env: Env, server: ServerThread) -> None:
    for argv in (["status"], ["reload"], ["introspect", "threads"], ["journal"], ["shutdown"]):
        assert ctl(env, *argv).exit_code == 0
    assert [(k, f["command"], f["outcome"]) for k, f in server.audit] == [
        ("oob-command", name, "ok")
        for name in ("status", "reload", "introspect threads", "journal", "shutdown")]


# --- exit codes --------------------------------------------------------------------------


def test_command_failure_exits_1(env: Env, server: ServerThread) -> None:
    result = ctl(env, "introspect", "schema", "nope")
    assert result.exit_code == 1
    assert "invalid: no listener 'nope'" in result.stderr
    code, doc = ctl_json(env, "introspect", "schema", "nope")
    assert (code, doc["ok"], doc["error"]["code"]) == (1, False, "invalid")
    assert doc["result"] is None


def test_usage_errors_exit_2(env: Env, server: ServerThread) -> None:
    assert ctl(env, "journal", "--limit", "0").exit_code == 2
    assert ctl(env, "introspect", "thread", "not-a-uuid").exit_code == 2
    assert ctl(env, "introspect", "schema").exit_code == 2
    assert ctl(env, "frobnicate").exit_code == 2
    no_key = CliRunner().invoke(main, ["--socket", str(env.socket), "status"], env={
        "AGENTCTL_KEY": None})
    assert no_key.exit_code == 2 and "no key" in no_key.stderr
    assert server.commands.calls == []


def test_unusable_key_exits_2(env: Env, server: ServerThread) -> None:
    os.chmod(env.key_path, 0o644)
    result = ctl(env, "status")
    assert result.exit_code == 2 and "chmod 600" in result.stderr
    missing = ctl(env, "status", key=env.dir / "missing")
    assert missing.exit_code == 2 and "cannot read key" in missing.stderr


def test_no_socket_exits_3_with_a_readable_message(env: Env) -> None:
    result = ctl(env, "status")
    assert result.exit_code == 3
    assert result.stderr.startswith(
        f"agentctl: cannot connect to {env.socket}: no such file or directory")
    assert "Traceback" not in result.output
    code, doc = ctl_json(env, "status")
    assert code == 3 and doc["error"]["code"] == "connect"


def test_wrong_key_exits_4(env: Env, server: ServerThread) -> None:
    result = ctl(env, "--key-id", "ops-1", "status", key=env.other_path)
    assert result.exit_code == 4
    assert "bad-signature" in result.stderr
    unknown = ctl(env, "status", key=env.other_path)  # signs as its own key-id
    assert unknown.exit_code == 4 and "unknown-key" in unknown.stderr
    code, doc = ctl_json(env, "status", key=env.other_path)
    assert (code, doc["error"]["code"]) == (4, "unknown-key")
    assert server.commands.calls == []


def test_clock_skew_exits_4(env: Env) -> None:
    with ServerThread(env.socket, env.authorized, clock=lambda: time.time() + 3600):
        result = ctl(env, "status")
        assert result.exit_code == 4
        assert "stale" in result.stderr and "clock" in result.stderr


def test_environment_defaults(env: Env, server: ServerThread) -> None:
    result = CliRunner().invoke(main, ["--json", "status"], env={
        "AGENTCTL_SOCKET": str(env.socket), "AGENTCTL_KEY": str(env.other_path),
        "AGENTCTL_KEY_ID": "ops-1"})
    assert result.exit_code == 4  # the env key-id overrides the key's comment
    ok = CliRunner().invoke(main, ["status"], env={
        "AGENTCTL_SOCKET": str(env.socket), "AGENTCTL_KEY": str(env.key_path)})
    assert ok.exit_code == 0, ok.output


# --- keygen ------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_and_prints_its_line(tmp_path: Path) -> None:
    out = tmp_path / "op.key"
    result = CliRunner().invoke(main, ["keygen", "--out", str(out), "--key-id", "ops-9"])
    assert result.exit_code == 0, result.output
    line = result.stdout.strip()
    assert line.startswith("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5") and line.endswith(" ops-9")
    assert (out.stat().st_mode & 0o777) == 0o600
    key, key_id = load_private_key(out)
    assert key_id == "ops-9"
    (tmp_path / "ak").write_text(line + "\n")
    assert load_authorized_keys(tmp_path / "ak")["ops-9"] == key.public_key()
    assert (tmp_path / "op.key.pub").read_text().strip() == line
    again = CliRunner().invoke(main, ["keygen", "--out", str(out)])
    assert again.exit_code == 1 and "refusing to overwrite" in again.stderr
    bad = CliRunner().invoke(main, ["keygen", "--out", str(tmp_path / "x"), "--key-id", "a b"])
    assert bad.exit_code == 2
    typo = CliRunner().invoke(main, ["keygen", "--out", str(tmp_path / "no" / "such" / "k")])
    assert typo.exit_code == 1 and "not a folder" in typo.stderr  # not created silently
    assert not (tmp_path / "no").exists()


def test_keygen_json_and_default_key_id(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--json", "keygen", "--out", str(tmp_path / "k")])
    doc = json.loads(result.stdout)
    assert doc["ok"] and "@" in doc["result"]["key_id"]
    assert doc["result"]["authorized_keys_line"].endswith(doc["result"]["key_id"])


def test_a_keygen_key_drives_a_daemon_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "k"
    line = run_ctl("keygen", "--out", str(out), "--key-id", "fresh").stdout.strip()
    (tmp_path / "ak").write_text(line + "\n")
    with ServerThread(tmp_path / "s.sock", tmp_path / "ak") as srv:
        result = run_ctl("--socket", str(tmp_path / "s.sock"), "--key", str(out), "status")
        assert result.returncode == 0, result.stderr
        assert srv.audit[-1][1]["key_id"] == "fresh"


# --- real processes ----------------------------------------------------------------------


def test_subprocess_round_trips(env: Env, server: ServerThread) -> None:
    base = env.base()
    status = run_ctl(*base, "status")
    assert status.returncode == 0 and "uptime_s: 12.5" in status.stdout
    journal = run_ctl(*base, "--json", "journal", "--limit", "3")
    assert journal.returncode == 0
    assert len(json.loads(journal.stdout)["result"]["journal"]) == 3
    schema = run_ctl(*base, "introspect", "schema", "calculator.add")
    assert schema.stdout.strip() == XSD
    failed = run_ctl(*base, "introspect", "example", "nope")
    assert failed.returncode == 1
    rejected = run_ctl("--socket", str(env.socket), "--key", str(env.other_path), "status")
    assert rejected.returncode == 4 and "unknown-key" in rejected.stderr
    shutdown = run_ctl(*base, "shutdown", "--now")
    assert shutdown.returncode == 0
    assert server.commands.calls[-1] == ("shutdown", {"mode": "now"})


def test_subprocess_cannot_connect_exits_3_without_traceback(env: Env) -> None:
    result = run_ctl(*env.base(), "status")
    assert result.returncode == 3
    assert result.stderr.startswith(f"agentctl: cannot connect to {env.socket}: "
                                    f"no such file or directory")
    assert "Traceback" not in result.stderr and result.stdout == ""
    usage = run_ctl(*env.base(), "journal", "--limit", "x")
    assert usage.returncode == 2 and "Usage:" in usage.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run agentctl as another uid")
def test_permission_denied_is_reported_as_such(env: Env) -> None:
    shared = Path(tempfile.mkdtemp(prefix="oobctl-", dir="/tmp"))
    os.chmod(shared, 0o711)
    try:
        key = shared / "k"
        key.write_bytes(env.key_path.read_bytes())
        os.chmod(key, 0o600)
        os.chown(key, 65534, 65534)
        sock = shared / "oob.sock"
        with ServerThread(sock, env.authorized):
            # Import first: the interpreter's own files may be private to root here.
            code = (
                "import os, sys, encodings.idna; from agentctl.cli import main; "
                "import agentd.oob; "
                "os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                f"main(['--socket', {str(sock)!r}, '--key', {str(key)!r}, 'status'], "
                "prog_name='agentctl')"
            )
            result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                    text=True, cwd=ROOT, timeout=60,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert result.returncode == 3, result.stderr
        assert result.stderr.startswith(f"agentctl: cannot connect to {sock}: permission denied")
        assert "Traceback" not in result.stderr
    finally:
        for p in shared.iterdir():
            p.unlink()
        shared.rmdir()


def test_shell_completion() -> None:
    result = run_ctl(environ={"_AGENTCTL_COMPLETE": "bash_source"})
    assert result.returncode == 0 and "_AGENTCTL_COMPLETE=bash_complete" in result.stdout
    words = run_ctl(environ={"_AGENTCTL_COMPLETE": "bash_complete", "COMP_WORDS": "agentctl intro",
                             "COMP_CWORD": "1"})
    assert "introspect" in words.stdout
    sub = run_ctl(environ={"_AGENTCTL_COMPLETE": "bash_complete",
                           "COMP_WORDS": "agentctl introspect th", "COMP_CWORD": "2"})
    assert "thread" in sub.stdout and "threads" in sub.stdout


# --- rendering ---------------------------------------------------------------------------


def test_text_rendering() -> None:
    value = {"a": [{"k": "v", "multi": "l1\nl2"}, "plain"], "empty": [], "blank": "",
             "#text": "t"}
    assert render_text(value).splitlines() == [
        "a:", "  - k: v", "    multi: |", "      l1", "      l2", "  - plain",
        "empty: (none)", "blank:", "text: t"]
    assert render_text("as is\n") == "as is\n"
    assert render_text(None) == ""
    assert result_to_text(etree.fromstring("<result>x</result>")) == "x"
