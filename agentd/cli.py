"""The `agentd` command line (click). It only turns flags into calls; the work is
done by the library."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from agentd._cli_bus import HELP_OPTIONS, init_cmd, mcp_serve_cmd, send_cmd, totp_cmd
from agentd._envelope import parse_envelope
from agentd._errors import AgentdError, ConfigError
from agentd.demo import AGENT_ORGANISM, ORGANISM


@click.group(context_settings=HELP_OPTIONS)
@click.version_option(package_name="agentd")
def main() -> None:
    """agentd: a zero-trust runtime for multi-agent LLM systems."""


@main.command("check-config")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--user", "user", metavar="NAME|UID",
              help="Check the secret files as the daemon running as this user would "
                   "(for root checking an install whose daemon runs as `agentd`).")
def check_config(file: Path, user: str | None) -> None:
    """Validate a configuration and the files it names (clients file, keys, TLS pair,
    prompts, cassettes), as `run` does: exit 0, or 1 with every error and its location."""
    from agentd._secrets import checking_as
    from agentd.config import check_config_main

    if user is None:
        sys.exit(check_config_main(file, preflight=_checked_with_database))
    with checking_as(_uid_of(user)):
        sys.exit(check_config_main(file, preflight=_checked_with_database))


def _checked_with_database(config: Any) -> Any:
    """The daemon's preflight, then (backend postgres) a login to the database: what
    is wrong with it, or one line on who holds the lease (held is not an error)."""
    from agentd._preflight import preflight
    from agentd._wiring import kernel_dsn
    from agentd.kernel import KernelUnavailable, check_database

    checked = preflight(config)
    dsn = kernel_dsn(config)
    if dsn is not None:
        setting = "kernel.dsn_file" if config.kernel.dsn_file is not None else "kernel.dsn"
        try:
            click.echo(f"kernel: {check_database(dsn, config.name)}")
        except KernelUnavailable as exc:
            source = config.source or "<config>"
            raise ConfigError([f"{source}: {setting}: {exc}"]) from None
    return checked


def _uid_of(user: str) -> int:
    import pwd

    if user.isdigit():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise click.BadParameter(f"no such user: {user}", param_hint="--user") from None


@main.command("config-schema")
def config_schema() -> None:
    """Print the JSON Schema of organism.yaml (for an editor's YAML language server)."""
    from agentd.config import organism_schema_text

    click.echo(organism_schema_text(), nl=False)


@main.command("run")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The organism file. Without it: the built-in demo in ./agentd-home.",
)
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Overrides the organism file's state_dir.")
@click.option("--standby", is_flag=True,
              help="Wait for the organism's lease (kernel backend postgres) while another "
                   "daemon holds it, then take over; until then only the OOB socket answers.")
@click.option("--log-format", type=click.Choice(["kv", "json"]), default="kv", show_default=True)
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def run(config_file: Path | None, state_dir: Path | None, standby: bool, log_format: str,
        log_level: str) -> None:
    """Run the daemon; with no --config, the built-in demo (initialised on first use)."""
    from agentd._cli_bus import init_home, next_steps
    from agentd._daemon import run_daemon
    from agentd._observability import setup_logging
    from agentd.isolation import WorkerFailed
    from agentd.kernel import StateLocked

    setup_logging(log_format, log_level.upper())
    try:
        if config_file is None:
            home = Path("agentd-home")
            config_file = home / "organism.yaml"
            if not config_file.exists():
                info = init_home(home)
                click.echo(f"agentd: initialised the demo in {home}/ (client alice)", err=True)
                click.echo(f"  TOTP: {info['otpauth_uri']}", err=True)
            click.echo("agentd: talk to it from another shell with", err=True)
            for line in next_steps(home):
                click.echo(f"  {line}", err=True)
        _install_uvloop()
        _exit(asyncio.run(run_daemon(config_file, state_dir, standby=standby)))
    except ConfigError as exc:
        for issue in exc.issues:
            click.echo(issue, err=True)
        sys.exit(1)
    except (StateLocked, AgentdError, WorkerFailed) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # a state dir that is a file, or cannot be made: one line
        where = f" ({exc.filename})" if exc.filename else ""
        raise click.ClickException(f"{exc.strerror or exc}{where}") from None


def _exit(code: int) -> NoReturn:
    """End `agentd run` once the daemon has stopped (everything committed, the writer
    gone). With WASM modules loaded, without the interpreter's finalization: wasmtime's
    runtime threads, torn down under a finalizing interpreter, can abort the process
    (SIGABRT, "panic in a function that cannot unwind") after a clean stop."""
    wasm = sys.modules.get("agentd.tools.wasm")
    if wasm is not None and getattr(wasm, "_runtime", None) is not None:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return
    uvloop.install()


@main.command("verify-journal")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("agentd-home/state"),
    show_default=True,
)
@click.option("--config", "config_file", type=click.Path(dir_okay=False, path_type=Path),
              help="organism.yaml: verify the journal its `kernel` names (either backend)")
def verify_journal(state_dir: Path, config_file: Path | None) -> None:
    """Walk the journal's hash chain; exit 1 if an entry was modified or removed."""
    from agentd.kernel import verify_journal_main

    if config_file is None:
        sys.exit(verify_journal_main(state_dir))
    from agentd._wiring import kernel_dsn
    from agentd.config import load_config

    try:
        config = load_config(config_file)
        dsn = kernel_dsn(config)
    except AgentdError as exc:
        print(f"verify-journal: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(verify_journal_main(config.state_dir, dsn))


@main.command("eval-routes")
@click.option("--config", "config_file", required=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The organism.yaml.")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
@click.option("--misses", is_flag=True, help="Also list every item the router got wrong.")
@click.argument("labelled", type=click.Path(dir_okay=False, path_type=Path))
def eval_routes(config_file: Path, as_json: bool, misses: bool, labelled: Path) -> None:
    """Run a labelled file of intents against the organism's profiles and
    embeddings, offline: top-1/top-3 accuracy and abstain rate per profile."""
    import json

    from agentd.config import load_config
    from agentd.semantic import (
        SemanticRouter,
        evaluate,
        read_labelled,
        routing_for_evaluation,
    )

    async def run() -> dict[str, Any]:
        config = load_config(config_file)
        items = read_labelled(labelled.read_text(encoding="utf-8"), str(labelled))
        router = SemanticRouter.from_config(config, lambda: None)
        try:
            return await evaluate(router, routing_for_evaluation(config), items)
        finally:
            await router.aclose()

    try:
        scores = asyncio.run(run())
    except (ConfigError, OSError) as exc:
        for issue in getattr(exc, "issues", None) or [str(exc)]:
            click.echo(issue, err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps({p: s.figures() for p, s in scores.items()}, indent=2))
        return
    for profile, score in scores.items():
        figures = score.figures()
        shown = " ".join(f"{k}={'-' if v is None else v}" for k, v in figures.items())
        click.echo(f"profile={profile} {shown}")
        if misses:
            for text, expect, selected in score.misses:
                click.echo(f"  miss: {text!r} expected={expect or '-'} got={selected or '-'}")


@main.command("demo")
def demo() -> None:
    """Run a demo conversation through the whole pipeline in process (no network)."""
    sys.exit(asyncio.run(_demo()))


async def _demo() -> int:
    """A demo conversation through the whole pipeline, in process (no network yet)."""
    from agentd.testing import Harness
    from agentd.tools.calculator import Add
    from agentd.tools.echo import Echo
    from agentd.tools.files import ReadFile
    from agentd.tools.relay import Relay

    click.echo(f"agentd demo: organism {ORGANISM}")
    async with Harness.from_config(ORGANISM, clients={"alice": "public"}) as h:
        steps: list[tuple[str, object]] = [
            ("alice asks calculator.add for 2 + 3", Add(a=2, b=3)),
            ("alice asks the relay, which asks the calculator, for 20 + 22", Relay(a=20, b=22)),
            ("alice sends text to echo", Echo(text="hello <world> & all")),
            ("alice reads samples/haiku.txt through the files tool",
             ReadFile(path="haiku.txt")),
            ("alice tries to read the organism file above the tool's folder (denied)",
             ReadFile(path="../organism.yaml")),
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
    await _agent_demo()
    return 0


async def _agent_demo() -> None:
    """An LLM agent using the calculator, replayed from a recorded cassette."""
    from agentd.platform.demo import MathQuestion
    from agentd.testing import Harness

    click.echo(f"\nagentd demo: organism {AGENT_ORGANISM} (LLM replayed from a cassette)")
    async with Harness.from_config(AGENT_ORGANISM, clients={"alice": "public"}) as h:
        click.echo("\n--- alice asks the agent: What is (2 + 3) * 7?")
        for frame in await h.send("alice", MathQuestion(text="What is (2 + 3) * 7?")):
            click.echo(f"  <- {_summary(frame)}")
            click.echo(f"     {frame.decode()}")


def _summary(frame: bytes) -> str:
    env = parse_envelope(frame)
    local = env.payload.tag.split("}")[-1]
    return f"{local} from {env.sender} on thread {env.thread}"


main.add_command(init_cmd)
main.add_command(send_cmd)
main.add_command(mcp_serve_cmd)
main.add_command(totp_cmd)


if __name__ == "__main__":  # pragma: no cover
    main()
