"""The `agentd` command line (click). It only turns flags into calls; the work is
done by the library."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from agentd._envelope import parse_envelope

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "organism.yaml"


@click.group()
@click.version_option(package_name="agentd")
def main() -> None:
    """agentd: a zero-trust runtime for multi-agent LLM systems."""


@main.command("check-config")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def check_config(file: Path) -> None:
    """Validate a configuration: exit 0, or 1 with every error and its location."""
    from agentd._config import check_config_main

    sys.exit(check_config_main(file))


@main.command("run")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path))
def run(config_file: Path | None, state_dir: Path | None) -> None:
    """Run the daemon; with no --config, run the built-in demo."""
    if config_file is not None:
        raise click.ClickException(
            "the network bus is not built yet (issue 4), so there is no daemon to run; "
            "`agentd run` with no --config runs the built-in demo in-process"
        )
    sys.exit(asyncio.run(_demo()))


async def _demo() -> int:
    """A demo conversation through the whole pipeline, in process (no network yet)."""
    from agentd.testing import Harness
    from agentd.tools.calculator import Add
    from agentd.tools.echo import Echo
    from agentd.tools.relay import Relay

    click.echo(f"agentd demo: organism {DEMO_CONFIG}")
    async with Harness.from_config(DEMO_CONFIG, clients={"alice": "public"}) as h:
        steps: list[tuple[str, object]] = [
            ("alice asks calculator.add for 2 + 3", Add(a=2, b=3)),
            ("alice asks the relay, which asks the calculator, for 20 + 22", Relay(a=20, b=22)),
            ("alice sends text to echo", Echo(text="hello <world> & all")),
            ("alice sends malformed XML", b"<message><unclosed>"),
            (
                "alice claims to be bob",
                b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>bob</from>'
                b"<thread>6f1c2a9e-8d4b-4c1e-9a57-2b1f0c3d4e5f</thread></meta>"
                b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><b>1</b>'
                b"</add></message>",
            ),
        ]
        for title, data in steps:
            click.echo(f"\n--- {title}")
            for frame in await h.send("alice", data):
                click.echo(f"  <- {_summary(frame)}")
                click.echo(f"     {frame.decode()}")
    click.echo("\nThe network bus (TLS WebSocket + TOTP) is not built yet; see docs/.")
    return 0


def _summary(frame: bytes) -> str:
    env = parse_envelope(frame)
    local = env.payload.tag.split("}")[-1]
    return f"{local} from {env.sender} on thread {env.thread}"


if __name__ == "__main__":  # pragma: no cover
    main()
