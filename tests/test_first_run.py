"""The newcomer's first minutes: what `agentd init` writes, what the daemon says at
start-up about what it does not serve, and what the commands print to be pasted."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from agentd._cli_bus import init_home
from agentd._daemon import unserved
from agentd.cli import main
from agentd.config import load_config
from agentd.demo import AGENT_ORGANISM, ORGANISM


def test_an_organism_without_bus_and_oob_is_warned_about_both() -> None:
    warnings = unserved(load_config(AGENT_ORGANISM))
    assert len(warnings) == 2
    assert warnings[0].startswith("NOT SERVING THE BUS: bus.tls and auth.clients_file not set")
    assert warnings[1].startswith("NO OPERATOR CHANNEL: oob.authorized_keys is not set")


def test_the_home_init_writes_serves_everything(tmp_path: Path) -> None:
    init_home(tmp_path / "home")
    assert unserved(load_config(tmp_path / "home" / "organism.yaml")) == []


def test_agentd_accepts_dash_h() -> None:
    result = CliRunner().invoke(main, ["-h"], prog_name="agentd")
    assert result.exit_code == 0 and "Usage: agentd" in result.output
    result = CliRunner().invoke(main, ["init", "-h"])
    assert result.exit_code == 0 and "--metrics-port" in result.output
    assert "into DIR" not in result.output


def test_check_config_counts_in_the_singular_and_the_plural(tmp_path: Path) -> None:
    one = tmp_path / "one.yaml"
    one.write_text(
        "organism: {name: one}\nstate_dir: state\n"
        "profiles: {public: {listeners: [echo]}}\n"
        "listeners:\n  - {name: echo, payload_class: agentd.tools.echo:Echo,\n"
        "     response_class: agentd.tools.echo:EchoReply, handler: agentd.tools.echo:echo,\n"
        "     description: Echoes text back.}\n"
    )
    result = CliRunner().invoke(main, ["check-config", str(one)])
    assert result.exit_code == 0
    assert result.output == "ok: one, 1 listener, 1 profile\n"
    result = CliRunner().invoke(main, ["check-config", str(ORGANISM)])
    assert result.output == "ok: demo, 5 listeners, 2 profiles\n"


def test_send_trusts_the_certificate_beside_the_secret_file(tmp_path: Path) -> None:
    from agentd._cli_bus import default_cafile

    init_home(tmp_path / "home")
    assert default_cafile(tmp_path / "home" / "alice.totp") == (
        tmp_path / "home" / "tls" / "cert.pem")
    assert default_cafile(tmp_path / "alice.totp") is None


def test_the_bundled_manifesto_is_package_data() -> None:
    import agentd
    from agentd.platform._prompts import BUNDLED_MANIFESTO

    assert BUNDLED_MANIFESTO.is_file()
    assert BUNDLED_MANIFESTO.is_relative_to(Path(agentd.__file__).parent)
    assert BUNDLED_MANIFESTO.read_text().startswith("# No Paperclippers")


def test_init_names_the_organism_and_its_renamed_demo_replays_its_cassette(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--name names the organism and its identity key; the tutor's cassette replays
    under any name (its keys leave the organism's name out)."""
    import asyncio
    import json

    from agentd.platform import make_agent_handlers
    from agentd.platform.demo import MathQuestion
    from agentd.testing import Harness

    result = CliRunner().invoke(main, ["init", "--dir", str(tmp_path / "home"), "--name",
                                       "my-org", "--port", "0", "--metrics-port", "0",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["identity"].endswith(" my-org")  # the key's comment
    config = load_config(tmp_path / "home" / "organism.yaml")
    assert config.name == "my-org"

    async def ask() -> bytes:
        handlers = make_agent_handlers(config)
        async with Harness(config, {"alice": "public"}, agent_handlers=handlers,
                           durable=False) as h:
            frames = await h.send("alice", MathQuestion(text="What is (2 + 3) * 7?"))
        await handlers.platform.aclose()
        return frames[-1]

    assert b"(2 + 3) * 7 = 35." in asyncio.run(ask())
    assert "replaying by conversation" not in caplog.text  # the whole key matched
    bad = CliRunner().invoke(main, ["init", "--dir", str(tmp_path / "other"), "--name", "-x"])
    assert bad.exit_code != 0 and "invalid organism name '-x'" in bad.output
