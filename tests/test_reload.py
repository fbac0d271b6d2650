"""Reload as a pure plan then an apply, the one preflight shared by `run`, `reload`
and `check-config`, and binding last: unit tests of the plan and the preflight list,
then a real `agentd run` child process with the real `agentctl`."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from agentd._errors import ConfigError
from agentd._preflight import PREFLIGHT_CHECKS, CheckedConfig, preflight
from agentd._reload import AgentPlatforms, ReloadPlan, plan_reload
from agentd.cli import main
from agentd.client import BusClient, frame_kind
from agentd.config import load_config
from agentd.platform.demo import MathQuestion
from tests.daemon_process import ROOT, DaemonProcess, edit_config, make_home

RSA_LINE = (
    "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQC7vbqajDhA2Z1wYfHbF3mLbqFVg5Bsy8p1 ops-rsa\n"
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    make_home(tmp_path / "home")
    return tmp_path / "home"


def checked(home: Path) -> CheckedConfig:
    return preflight(load_config(home / "organism.yaml"))


def plan_after(home: Path, edit: Callable[[dict[str, Any]], None]) -> ReloadPlan:
    before = checked(home)
    edit_config(home, edit)
    return plan_reload(before, checked(home))


def append_to_prompt(doc: dict[str, Any]) -> None:
    doc["prompts"]["tutor_base"] += "Answer in one sentence.\n"


# ---- the plan: values in, a plan out --------------------------------------------------


def test_an_unchanged_file_plans_nothing(home: Path) -> None:
    plan = plan_after(home, lambda doc: None)
    assert plan == ReloadPlan(clients=plan.clients, tls_cert=plan.tls_cert)
    assert plan.clients is not None and not (plan.clients.added or plan.clients.changed)
    assert not plan.new_platform


def test_a_prompt_text_change_alone_changes_its_agent(home: Path) -> None:
    plan = plan_after(home, append_to_prompt)
    assert (plan.added, plan.removed, plan.changed) == ((), (), ("tutor",))
    assert plan.new_platform


def test_a_backend_change_alone_changes_the_agents(home: Path) -> None:
    def slower(doc: dict[str, Any]) -> None:
        doc["llm"]["backends"][0]["max_concurrency"] = 3

    plan = plan_after(home, slower)
    assert plan.changed == ("tutor",) and plan.new_platform


def test_a_new_cassette_in_the_same_file_changes_the_agents(home: Path) -> None:
    copy = home / "copy.jsonl"
    edit_config(home, lambda doc: (
        shutil.copy(home / doc["llm"]["backends"][0]["cassette"], copy),
        doc["llm"]["backends"][0].update(cassette=str(copy)),
    ))
    before = checked(home)
    copy.write_text(copy.read_text().splitlines()[0] + "\n")  # one exchange fewer
    plan = plan_reload(before, checked(home))
    assert plan.changed == ("tutor",) and plan.new_platform


def describe(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        for lst in doc["listeners"]:
            if lst["name"] == name:
                lst["description"] = "Described anew."

    return edit


@pytest.mark.parametrize("listener, changed, new_platform", [
    # No agent calls echo: its new description needs no new platform.
    ("echo", ("echo",), False),
    # An agent's prompt lists its peers' descriptions: a new one is a new prompt.
    ("calculator.add", ("calculator.add", "tutor"), True),
])
def test_a_description_change_changes_the_agents_whose_prompt_shows_it(
    home: Path, listener: str, changed: tuple[str, ...], new_platform: bool
) -> None:
    plan = plan_after(home, describe(listener))
    assert (plan.changed, plan.new_platform) == (changed, new_platform)


def test_settings_read_at_start_are_reported_as_needing_a_restart(home: Path) -> None:
    def move(doc: dict[str, Any]) -> None:
        doc["bus"]["port"] = 1
        doc["metrics"]["listen"] = "127.0.0.1:2"
        doc["embeddings"] = {"provider": "local", "path": "."}

    plan = plan_after(home, move)
    moved = ["bus.port", "metrics.listen", "embeddings.provider", "embeddings.path"]
    assert plan.restart_needed == tuple(moved)
    assert plan.result(2, dry_run=True)["restart_needed"] == moved


def test_restart_needed_compares_with_what_the_daemon_started_with(home: Path) -> None:
    """A reload that moved max_hops, then a reload back to the file the daemon
    started with: nothing needs a restart any more (it was still reported), and a
    need is not forgotten by a later reload that changes something else; the idle
    timeout is read again each time, so it never needs one."""
    started = checked(home)

    def hops(n: int) -> Callable[[dict[str, Any]], None]:
        def edit(doc: dict[str, Any]) -> None:
            doc.setdefault("pump", {})["max_hops"] = n
        return edit

    edit_config(home, hops(3))
    first = checked(home)
    assert plan_reload(started, first, started).restart_needed == ("pump.max_hops",)
    edit_config(home, hops(started.config.pump.max_hops))
    assert plan_reload(first, checked(home), started).restart_needed == ()
    edit_config(home, hops(3))
    third = checked(home)

    def idle(doc: dict[str, Any]) -> None:
        doc["pump"]["thread_idle_s"] = 5

    edit_config(home, idle)
    assert plan_reload(third, checked(home), started).restart_needed == ("pump.max_hops",)


def test_removing_the_bus_or_the_clients_file_is_refused(home: Path) -> None:
    def drop(doc: dict[str, Any]) -> None:
        del doc["bus"]["tls"]
        del doc["auth"]["clients_file"]

    with pytest.raises(ConfigError) as info:
        plan_after(home, drop)
    assert [issue.split(":")[0] for issue in info.value.issues] == [
        "bus.tls", "auth.clients_file"
    ]


def test_planning_touches_nothing_live(home: Path) -> None:
    """The plan is built from two checked configurations: no daemon, no platform."""
    before = checked(home)
    edit_config(home, append_to_prompt)
    after = checked(home)
    assert plan_reload(before, after) == plan_reload(before, after)
    assert before.prompt_digests["tutor"] != after.prompt_digests["tutor"]


class FakePlatform:
    def __init__(self) -> None:
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True


class FakeHandlers:
    def __init__(self) -> None:
        self.platform = FakePlatform()


async def test_a_retired_platform_closes_once_no_live_table_reaches_it() -> None:
    platforms = AgentPlatforms()
    first, second = FakeHandlers(), FakeHandlers()
    platforms.adopt(first, 1)  # type: ignore[arg-type]
    platforms.adopt(None, 2)  # a reload without agent changes keeps the platform
    platforms.adopt(second, 3)  # type: ignore[arg-type]
    assert platforms.current is second
    # A thread on table version 2 still runs on the first platform.
    assert await platforms.close_unused(lambda: {2, 3}) == 0 and not first.platform.closed
    assert await platforms.close_unused(lambda: {3}) == 1 and first.platform.closed
    assert not second.platform.closed and platforms.current is second
    await platforms.aclose()
    assert second.platform.closed


# ---- one preflight for run, reload and check-config ------------------------------------


def _break_clients(home: Path) -> None:  # readable by others: refused
    (home / "clients.yaml").chmod(0o644)


def _break_keys(home: Path) -> None:
    with (home / "authorized_keys").open("a") as f:
        f.write(RSA_LINE)


def _break_tls(home: Path) -> None:
    (home / "tls" / "cert.pem").write_text("not a certificate\n")


def _break_prompts(home: Path) -> None:
    edit_config(home, lambda doc: doc["prompts"].update(tutor_base="Use {nonsense}.\n"))


def _break_cassette(home: Path) -> None:
    cassette = home / "broken.jsonl"
    cassette.write_text("not json\n")
    edit_config(home, lambda doc: doc["llm"]["backends"][0].update(cassette=str(cassette)))


def _break_listeners(home: Path) -> None:
    def twins(doc: dict[str, Any]) -> None:
        doc["python_path"] = [str(ROOT / "tests")]
        for name, cls in (("hello", "Greeting"), ("hello2", "OtherGreeting")):
            doc["listeners"].append({
                "name": name,
                "payload_class": f"fixtures_config:{cls}",
                "handler": "fixtures_config:add",
                "description": "Two classes, one payload key.",
            })

    edit_config(home, twins)


def _break_isolation(home: Path) -> None:
    """An isolated handler whose package holds the state folder: its worker could
    read the journal."""
    package = home / "mods" / "inside"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from agentd.tools.calculator import add\n")

    def isolate(doc: dict[str, Any]) -> None:
        doc["python_path"] = [str(home / "mods")]
        doc["state_dir"] = str(package / "state")
        add = next(lst for lst in doc["listeners"] if lst["name"] == "calculator.add")
        add["handler"] = "inside:add"
        add["isolation"] = {"workers": 1}

    edit_config(home, isolate)


def _break_bus_host(home: Path) -> None:  # a name nothing resolves
    edit_config(home, lambda doc: doc["bus"].update(host="999.1.1.1"))


def _break_identity(home: Path) -> None:  # readable by others: refused
    (home / "identity.key").chmod(0o644)


# setting -> (how to break what it checks, what the report must say)
BREAKS: dict[str, tuple[Callable[[Path], None], str]] = {
    "auth.clients_file": (_break_clients, "auth.clients_file: clients file"),
    "oob.authorized_keys": (_break_keys, "ssh-rsa"),
    "bus.tls": (_break_tls, "bus.tls: cannot load TLS certificate"),
    "bus.host": (_break_bus_host, "bus.host: '999.1.1.1' cannot be resolved"),
    "prompts": (_break_prompts, "uses unknown variable {nonsense}"),
    "llm.backends": (_break_cassette, "broken.jsonl:1: not a cassette exchange"),
    "listeners": (_break_listeners, "}greeting"),
    "isolation": (_break_isolation, "the worker would be able to read"),
    "federation": (_break_identity, "federation: identity.key:"),
}


def test_every_preflight_check_has_a_breaking_case() -> None:
    """The list comes from the code path itself: a new check needs a case here."""
    assert [check.setting for check in PREFLIGHT_CHECKS] == list(BREAKS)


@pytest.mark.parametrize("setting", [check.setting for check in PREFLIGHT_CHECKS])
def test_check_config_and_run_refuse_the_same_broken_file(home: Path, setting: str) -> None:
    break_it, expected = BREAKS[setting]
    break_it(home)
    path = home / "organism.yaml"
    checked_ = agentd_cli("check-config", str(path))
    run = agentd_cli("run", "--config", str(path))
    assert checked_.returncode == run.returncode == 1
    reported = checked_.stderr.strip().splitlines()
    assert reported == run.stderr.strip().splitlines()
    assert reported and all(line.startswith(f"{path}") for line in reported)
    assert any(expected in line for line in reported), reported
    # Refused before the kernel opened its database, let alone a socket.
    assert not (home / "state").exists() or not any((home / "state").iterdir())


def test_check_config_reports_every_broken_file_at_once(home: Path) -> None:
    _break_keys(home)
    _break_tls(home)
    result = CliRunner().invoke(main, ["check-config", str(home / "organism.yaml")])
    assert result.exit_code == 1
    settings = [line.split(": ")[1] for line in result.output.strip().splitlines()]
    assert settings == ["oob.authorized_keys", "bus.tls"]


def test_check_config_accepts_what_run_accepts(home: Path) -> None:
    result = CliRunner().invoke(main, ["check-config", str(home / "organism.yaml")])
    assert result.exit_code == 0 and result.output.startswith("ok: ")


# ---- a real daemon ------------------------------------------------------------------


def agentd_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`agentd ARGS` as a fresh child process (nothing imported beforehand)."""
    return subprocess.run(
        [sys.executable, "-m", "agentd.cli", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )


def run_agentd(home: Path) -> subprocess.CompletedProcess[str]:
    return agentd_cli("run", "--config", str(home / "organism.yaml"))


@pytest.fixture
def held_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.mark.parametrize("setting", ["metrics.listen", "bus.port"])
def test_a_port_in_use_is_one_line_naming_the_setting(
    home: Path, held_port: int, setting: str
) -> None:
    if setting == "metrics.listen":
        edit_config(home, lambda doc: doc["metrics"].update(listen=f"127.0.0.1:{held_port}"))
    else:
        edit_config(home, lambda doc: doc["bus"].update(port=held_port))
    done = run_agentd(home)
    assert done.returncode == 1
    assert f"{setting}: 127.0.0.1:{held_port} is already in use\n" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bus_host_that_does_not_resolve_is_blamed_on_bus_host(home: Path) -> None:
    """It said `bus.port: cannot listen on 999.1.1.1:...`: the port was fine (and
    check-config passed it: see BREAKS, where check-config and run refuse it alike)."""
    _break_bus_host(home)
    done = run_agentd(home)
    assert done.returncode == 1
    assert "bus.host: '999.1.1.1' cannot be resolved (" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_run_refuses_an_rsa_operator_key_before_listening(home: Path) -> None:
    _break_keys(home)
    done = run_agentd(home)
    assert done.returncode == 1
    assert "oob.authorized_keys" in done.stderr and "ssh-rsa" in done.stderr
    assert "listening" not in done.stderr and "Traceback" not in done.stderr


async def prompt_hash(d: DaemonProcess) -> str:
    code, doc = await asyncio.to_thread(d.agentctl, "introspect", "prompt", "tutor")
    assert code == 0, doc
    return str(doc["result"]).split("sha256 ", 1)[1].split()[0]


async def routing_version(d: DaemonProcess) -> str:
    code, doc = await asyncio.to_thread(d.agentctl, "status")
    assert code == 0, doc
    return str(doc["result"]["status"]["routing_version"])


def replays_around_the_reload(log: list[str]) -> tuple[int, int]:
    """How many LLM calls were replayed by conversation (a system prompt other than the
    recorded one) before and after the applied reload's audit line."""
    at = next(i for i, line in enumerate(log) if "kind=reload" in line)
    replays = [i for i, line in enumerate(log) if "replaying by conversation" in line]
    return sum(i < at for i in replays), sum(i > at for i in replays)


async def test_a_dry_run_changes_nothing_and_a_prompt_change_is_served(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        before = await prompt_hash(d)
        version = await routing_version(d)
        edit_config(home, append_to_prompt)
        code, doc = await asyncio.to_thread(d.agentctl, "reload", "--dry-run")
        assert code == 0, doc
        result = doc["result"]["reload"]
        assert "tutor" in str(result["changed"]) and str(result["dry_run"]) in ("true", "True")
        # Nothing was swapped: the same tables, the same prompt in service.
        assert (await prompt_hash(d), await routing_version(d)) == (before, version)
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(MathQuestion(text="What is (2 + 3) * 7?"))
            assert frame_kind(frames[-1])[:2] == ("tutor", "answer")

            code, doc = await asyncio.to_thread(d.agentctl, "reload")
            assert code == 0, doc
            assert "tutor" in str(doc["result"]["reload"]["changed"])
            after = await prompt_hash(d)
            assert after != before
            frames = await bus.exchange(MathQuestion(text="What is (2 + 3) * 7?"))
            assert frame_kind(frames[-1])[:2] == ("tutor", "answer")
    finally:
        await d.stop()
    # The cassette was recorded with the old prompt: it was served until the reload
    # (the dry run swapped nothing), the new one after it.
    before_reload, after_reload = replays_around_the_reload(d.log)
    assert before_reload == 0 and after_reload > 0


async def test_a_backend_change_alone_is_reported_and_applied(home: Path) -> None:
    d = await DaemonProcess(home).start()
    try:
        doc_now = yaml.safe_load((home / "organism.yaml").read_text())
        original = home / doc_now["llm"]["backends"][0]["cassette"]  # relative to the home
        copy = home / "copy.jsonl"
        shutil.copy(original, copy)
        edit_config(home, lambda doc: doc["llm"]["backends"][0].update(cassette=str(copy)))
        code, doc = await asyncio.to_thread(d.agentctl, "reload")
        assert code == 0, doc
        assert "tutor" in str(doc["result"]["reload"]["changed"])
        code, doc = await asyncio.to_thread(d.agentctl, "reload")  # nothing left to change
        assert code == 0 and "tutor" not in str(doc["result"]["reload"]["changed"])
        async with BusClient(d.url, "alice", secret=d.secret, cafile=d.cafile) as bus:
            frames = await bus.exchange(MathQuestion(text="What is (2 + 3) * 7?"))
            assert frame_kind(frames[-1])[:2] == ("tutor", "answer")
    finally:
        await d.stop()
    # No thread ran on the first platform: the reload that retired it closed it.
    assert sum("llm platforms closed count=1" in line for line in d.log) == 1
