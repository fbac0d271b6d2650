"""The bus-side `agentd` commands: `init`, `send`, `totp` (see docs/commands.md).

They only turn flags into calls. `agentd.cli` registers them on the `agentd` group:

    main.add_command(init_cmd); main.add_command(send_cmd); main.add_command(totp_cmd)

Exit codes of `send`: 0 every conversation was answered and none with `huh`; 1 a
`huh` came back, or --timeout passed first; 2 usage or unreadable input; 3 cannot
connect; 4 authentication refused.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import shlex
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import click
import pyotp
import yaml

from agentd._credentials import read_secret, read_session_file
from agentd._errors import AgentdError, Rejection
from agentd._xml import c14n, parse_untrusted
from agentd.demo import AGENT_FILES, AGENT_ORGANISM, DEMO_DIR, ORGANISM, SAMPLE_FILES

DEFAULT_HOME = Path("agentd-home")
DEFAULT_URL = "wss://127.0.0.1:8765/bus"
OPERATOR_KEY_ID = "ops-1"

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONNECT, EXIT_AUTH = 0, 1, 2, 3, 4
# `-h` as well as `--help`, set on each command too: click keeps a command's help
# option once made, so one invoked on its own first would forget the group's.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


# ---------------------------------------------------------------------------- init

INIT_FILES = (
    "organism.yaml",
    "clients.yaml",
    "{client}.totp",
    "tls/cert.pem",
    "tls/key.pem",
    "operator.key",
    "authorized_keys",
    "identity.key",
    *AGENT_FILES,
    *SAMPLE_FILES,
)
DEFAULT_METRICS_PORT = 9464


def _demo_sections() -> dict[str, Any]:
    """The organism `init` writes, below its bus/auth/oob/metrics head: the demo's
    tools (agentd/demo/organism.yaml) and the `tutor` agent with its prompts and
    cassette (agentd/demo/agent-demo.yaml). The agent's file paths stay relative:
    `init_home` copies those files into the home under the same names."""
    data = yaml.safe_load(ORGANISM.read_text(encoding="utf-8"))
    sections = {k: data[k] for k in ("pump", "journal", "meta", "profiles", "listeners")}
    agent = yaml.safe_load(AGENT_ORGANISM.read_text(encoding="utf-8"))
    names = {lst["name"] for lst in sections["listeners"]}
    agents = [lst for lst in agent["listeners"] if "agent" in lst]
    sections["listeners"] = sections["listeners"] + [
        lst for lst in agents if lst["name"] not in names
    ]
    public = sections["profiles"]["public"]
    public["listeners"] = public["listeners"] + [lst["name"] for lst in agents]
    sections["prompts"] = agent["prompts"]
    sections["llm"] = agent["llm"]
    sections["pump"] = {**sections["pump"], "handler_timeout_s": agent["pump"]["handler_timeout_s"]}
    return sections


def organism_yaml(host: str, port: int, metrics: str, name: str | None = None) -> str:
    # The organism's name is part of every prompt; the cassette's keys leave it out
    # (see LlmRequest.normalised), so any name replays it.
    if name is None:
        name = yaml.safe_load(AGENT_ORGANISM.read_text(encoding="utf-8"))["organism"]["name"]
    head = f"""\
# Written by `agentd init` on {dt.date.today().isoformat()}.
# Relative paths resolve against this file's folder, so the folder can be moved.
# The daemon opens: the bus on {host}:{port} (wss) and metrics on {metrics} (http).
organism: {{name: {name}}}
state_dir: state
bus:
  host: {host}
  port: {port}
  tls: {{cert: tls/cert.pem, key: tls/key.pem}}
auth: {{clients_file: clients.yaml}}
oob: {{authorized_keys: authorized_keys}}
identity: {{key: identity.key}}  # the organism's Ed25519 key, for federation gateways
metrics: {{listen: "{metrics}"}}
"""
    body = yaml.safe_dump(_demo_sections(), sort_keys=False, default_flow_style=None, width=100)
    return head + body


def _write(path: Path, data: bytes | str, mode: int) -> None:
    from agentd.bus import write_new

    write_new(path, data.encode() if isinstance(data, str) else data, mode)


def init_home(
    home: Path, client: str = "alice", host: str = "127.0.0.1", port: int = 8765,
    metrics: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}", name: str | None = None,
) -> dict[str, Any]:
    """Write a working setup into `home`; refuses to overwrite any of its files.
    Everything the organism refers to is inside `home`, by relative path. `name`:
    the organism's (and its identity key's); by default the demo's."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agentd.bus import make_self_signed
    from agentd.config import CLIENT_ID
    from agentd.config.values import NAME_PATTERN, NAME_RULE

    if not CLIENT_ID.fullmatch(client) or client == "core":
        raise AgentdError(f"invalid client id {client!r}")
    organism_name = name  # (`name` is reused for file names below)
    if organism_name is not None and not NAME_PATTERN.fullmatch(organism_name):
        raise AgentdError(f"invalid organism name {organism_name!r}: {NAME_RULE}")
    metrics_port = int(metrics.rpartition(":")[2])
    if port != 0 and port == metrics_port:
        raise AgentdError(f"the bus and the metrics listener cannot share port {port}")
    names = [f.format(client=client) for f in INIT_FILES]
    existing = [n for n in names if (home / n).exists()]
    if existing:
        raise AgentdError(
            f"{home} already holds {', '.join(existing)}; agentd init never overwrites "
            "(choose another --dir or remove them)"
        )
    home.mkdir(parents=True, exist_ok=True)
    (home / "tls").mkdir(exist_ok=True)
    (home / "state").mkdir(mode=0o700, exist_ok=True)
    secret = pyotp.random_base32(32)  # 160 bits
    uri = pyotp.TOTP(secret).provisioning_uri(name=client, issuer_name="agentd")
    hosts = ["localhost", "127.0.0.1", "::1"]
    if host not in hosts and host not in ("0.0.0.0", "::"):
        hosts.insert(0, host)
    make_self_signed(home / "tls" / "cert.pem", home / "tls" / "key.pem", hosts)
    _write(home / "clients.yaml", yaml.safe_dump(
        {"clients": {client: {"totp_secret": secret, "profile": "public"}}}, sort_keys=False
    ), 0o600)
    _write(home / f"{client}.totp", secret + "\n", 0o600)
    from agentd.oob import authorized_keys_line, write_private_key

    key = Ed25519PrivateKey.generate()
    # The key file carries its key-id as its comment, so agentctl needs no --key-id.
    write_private_key(home / "operator.key", key, OPERATOR_KEY_ID)
    _write(home / "authorized_keys",
           authorized_keys_line(key.public_key(), OPERATOR_KEY_ID) + "\n", 0o644)
    for name in (*AGENT_FILES, *SAMPLE_FILES):
        _write(home / name, (DEMO_DIR / name).read_bytes(), 0o644)
    organism = organism_yaml(host, port, metrics, organism_name)
    from agentd.federation import write_identity

    identity = write_identity(home / "identity.key", yaml.safe_load(organism)["organism"]["name"])
    _write(home / "organism.yaml", organism, 0o644)
    # Folders are made with the umask's mode; none that holds the configuration, its
    # prompts or the TLS pair may be writable by others (whoever can replace a file
    # there chooses what the daemon runs), whatever the umask was.
    for folder in {home, *((home / name).parent for name in names)}:
        mode = stat.S_IMODE(folder.stat().st_mode)
        if mode & 0o022:
            os.chmod(folder, mode & ~0o022)
    from agentd.config import load_config

    load_config(home / "organism.yaml")  # what init writes must load
    return {"dir": str(home), "client": client, "otpauth_uri": uri, "files": names,
            "identity": identity.public_line}


def executable(name: str) -> str:
    """The full path of the `agentd` or `agentctl` next to the running program, so a
    printed command works when pasted into a shell whose PATH lacks the venv."""
    for folder in (Path(sys.argv[0]).parent, Path(sys.executable).parent):
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate.absolute())
    return shutil.which(name) or name


def next_steps(home: Path, client: str = "alice") -> list[str]:
    """The shell lines that talk to the daemon of a home written by `init_home`: the
    operator's environment and status, and a question to the demo tutor."""
    from agentd.config import load_config

    config = load_config(home / "organism.yaml")
    tls = config.bus.tls
    cafile = f" --cafile {shlex.quote(str(tls.cert))}" if tls is not None else ""
    secret = (home / f"{client}.totp").absolute()
    socket = config.oob.socket or config.state_dir / "oob.sock"
    key = (home / "operator.key").absolute()
    # bus.port 0: the daemon takes a free port at each start and logs it ("bus
    # listening url=..."); the lines say where to put it.
    port = config.bus.port or "PORT"
    return [
        f"export AGENTCTL_SOCKET={shlex.quote(str(socket.absolute()))} "
        f"AGENTCTL_KEY={shlex.quote(str(key))}",
        f"{shlex.quote(executable('agentctl'))} status",
        f"echo {shlex.quote(DEMO_QUESTION)} | {shlex.quote(executable('agentd'))} send "
        f"--url wss://{_url_host(config.bus.host)}:{port}/bus --client {client} "
        f"--secret-file {shlex.quote(str(secret))}{cafile} -",
        f"echo {shlex.quote(DEMO_READ)} | {shlex.quote(executable('agentd'))} send "
        f"--url wss://{_url_host(config.bus.host)}:{port}/bus --client {client} "
        f"--secret-file {shlex.quote(str(secret))}{cafile} -",
        *(["# PORT: the port the daemon logs at start (bus listening url=...); "
           "bus.port 0 takes a free one each time"] if not config.bus.port else []),
    ]


# The question the demo cassette holds an answer to.
DEMO_QUESTION = (
    '<mathquestion xmlns="https://xml-pipeline.org/ns/agents/math-tutor/v1">'
    "<text>What is (2 + 3) * 7?</text></mathquestion>"
)
# A file the demo's `files` tool reads from the home's samples/ folder.
DEMO_READ = ('<read-file xmlns="https://xml-pipeline.org/ns/tools/file-read/v1">'
             "<path>welcome.txt</path></read-file>")


@click.command("init", context_settings=HELP_OPTIONS)
@click.option("--dir", "home", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_HOME, show_default=True, help="Folder to write the setup into.")
@click.option("--client", default="alice", show_default=True, help="The first client's id.")
@click.option("--name", "name", default=None,
              help="The organism's name (and its identity key's) [default: agent-demo].")
@click.option("--host", default="127.0.0.1", show_default=True, help="bus.host to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="bus.port: the TLS WebSocket bus (0: any free port).")
@click.option("--metrics-port", default=DEFAULT_METRICS_PORT, show_default=True,
              type=click.IntRange(0, 65535),
              help="Port of metrics.listen on 127.0.0.1 (/metrics, /healthz, /readyz).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def init_cmd(
    home: Path, client: str, name: str | None, host: str, port: int, metrics_port: int,
    as_json: bool,
) -> None:
    """Write a working setup into the --dir folder: organism.yaml (the demo tools and
    the tutor agent with its prompt and cassette), a self-signed TLS cert, a clients
    file with one client and its TOTP secret, an operator key, the organism's
    identity key (printed as its public line)."""
    try:
        info = init_home(home, client, host, port, f"127.0.0.1:{metrics_port}", name)
    except AgentdError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(info))
        return
    click.echo(f"agentd init: wrote {home}/")
    for name in info["files"]:
        click.echo(f"  {home / name}")
    click.echo(f"  {home / 'state'}/")
    click.echo(f"\nPorts: bus {host}:{port} (wss), metrics 127.0.0.1:{metrics_port} (http).")
    click.echo(f"\nTOTP for client {client} (scan into an authenticator app or keep for scripts):")
    click.echo(f"  {info['otpauth_uri']}")
    click.echo("\nThis organism's public identity (give it to a peer's operator for `gateways:`):")
    click.echo(f"  {info['identity']}")
    click.echo("\nNext: run the daemon")
    config = (home / "organism.yaml").absolute()
    click.echo(f"  {shlex.quote(executable('agentd'))} run --config {shlex.quote(str(config))}")
    click.echo("and talk to it from another shell:")
    for line in next_steps(home, client):
        click.echo(f"  {line}")


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


# ---------------------------------------------------------------------------- totp


def _secret_for(client: str, secret_file: Path | None, clients_file: Path | None) -> str:
    if clients_file is not None:
        from agentd.bus import read_clients_file

        entries = read_clients_file(clients_file)
        if client not in entries:
            raise AgentdError(f"client {client} is not in {clients_file}")
        return entries[client].totp_secret
    return read_secret(secret_file or DEFAULT_HOME / f"{client}.totp")


@click.command("totp", context_settings=HELP_OPTIONS)
@click.option("--client", required=True, help="The client id.")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path),
              help="File with the base32 secret [default: agentd-home/CLIENT.totp].")
@click.option("--clients-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Read the secret from a clients file instead.")
def totp_cmd(client: str, secret_file: Path | None, clients_file: Path | None) -> None:
    """Print the current TOTP code for a client (for scripts and tests)."""
    try:
        secret = _secret_for(client, secret_file, clients_file)
    except AgentdError as exc:
        raise click.ClickException(str(exc)) from None
    from agentd.bus import current_totp

    click.echo(current_totp(secret))


# ---------------------------------------------------------------------------- send


def read_input(data: bytes) -> list[bytes]:
    """The documents to send: one envelope or payload, or several top-level elements
    one after another (each its own conversation)."""
    raw = data.strip()
    if raw.startswith(b"<?xml"):
        end = raw.find(b"?>")
        raw = raw[end + 2:].strip() if end >= 0 else raw
    try:
        parse_untrusted(raw, max_bytes=16 * 1024 * 1024)
        return [raw]
    except Rejection:
        pass  # several documents one after another, or not XML at all
    try:
        wrapper = parse_untrusted(b"<agentd-input>" + raw + b"</agentd-input>",
                                  max_bytes=16 * 1024 * 1024)
    except Rejection as exc:
        raise AgentdError(f"the input is not well-formed XML: {exc.detail or exc}") from None
    docs = [c14n(el) for el in wrapper if isinstance(el.tag, str)]
    if not docs:
        raise AgentdError("the input holds no XML element")
    return docs


def _hint(exc: BaseException, client: str) -> str:
    """What to do next about an error of `agentd send` (indented lines, or "")."""
    from agentd.client import AuthenticationFailed, BusError, Huh

    if isinstance(exc, AuthenticationFailed):
        return (
            "  The daemon does not say why a login failed. Check:\n"
            "  - this machine's clock (a TOTP code is good for 30 s; `date -u`);\n"
            f"  - --secret-file holds {client}'s secret as in the daemon's clients file;\n"
            "  - another process that logged in as the same client within the last 30 s\n"
            "    (a code is accepted once): give both the same --session-file;\n"
            "  - 5 failures within 60 s lock the client out for 60 s: wait, then retry.\n"
            "  The daemon's log says which it was (`auth failed client=... reason=...`)."
        )
    if isinstance(exc, BusError) and exc.certificate:
        return ("  The daemon's certificate is not trusted: name it with --cafile (for a home\n"
                "  made by `agentd init`, its tls/cert.pem).")
    if isinstance(exc, Huh) and exc.code == "unroutable":
        return (
            "  Nothing this client may call takes that payload: check its root tag and\n"
            "  namespace against the listener's. A valid one: `agentctl introspect example\n"
            "  LISTENER`, or send <request-example xmlns=\"https://xml-pipeline.org/ns/core/v1\">"
            "\n  <name>LISTENER</name></request-example> (when meta.allow_example_requests is on)."
        )
    return ""


async def _send_main(
    urls: list[str], client: str, secret_file: Path | None, session_file: Path | None,
    thread: str | None, to: str | None, timeout: float, cafile: Path | None, verify: bool,
    docs: list[bytes], emit: Any, stream: bool = False,
) -> tuple[int, dict[str, Any]]:
    from agentd.client import (
        Answer,
        ApprovalRequired,
        AuthenticationFailed,
        BusError,
        Client,
        Event,
        Final,
        Huh,
        Partial,
        Step,
    )

    secret_path = secret_file or DEFAULT_HOME / f"{client}.totp"
    secret = read_secret(secret_path)
    session_path = session_file or secret_path.with_suffix(".session")
    if cafile is None and verify:
        cafile = default_cafile(secret_path)
    report: dict[str, Any] = {"url": urls[0], "urls": urls, "client": client, "sent": [],
                              "frames": [], "others": []}

    def entry(event: Event, kind: str) -> dict[str, Any]:
        return {"thread": event.thread, "from": event.sender, "kind": kind,
                "xml": event.frame.decode("utf-8", "replace")}

    def other(event: Any) -> None:
        item = entry(event, event.tag.rsplit("}", 1)[-1])
        report["others"].append(item)
        emit("other", item)

    try:
        bus = Client(urls, client, secret=secret, session_file=session_path, cafile=cafile,
                     verify=verify, on_other=other)
    except ValueError as exc:  # not a wss:// URL
        report["error"] = str(exc)
        return EXIT_CONNECT, report
    try:
        await bus.open()
    except AuthenticationFailed as exc:
        report["error"], report["hint"] = str(exc), _hint(exc, client)
        return EXIT_AUTH, report
    except BusError as exc:
        report["error"], report["hint"] = str(exc), _hint(exc, client)
        return EXIT_CONNECT, report
    report["url"] = bus.url
    code = EXIT_OK
    open_threads: list[str] = []
    errors: list[str] = []
    hints: list[str] = []

    async def follow(exchange: Any) -> None:
        nonlocal code
        try:
            async for event in exchange.events():
                if isinstance(event, Partial):
                    emit("partial", {"thread": event.thread, "text": event.text})
                    continue
                if isinstance(event, Final):
                    emit("final", {"thread": event.thread, "text": ""})
                    continue
                if isinstance(event, Step):
                    emit("step", {"thread": event.thread, "text": event.describe()})
                    continue
                kind = ("accepted" if not isinstance(event, Answer | ApprovalRequired)
                        else "approval-required" if isinstance(event, ApprovalRequired)
                        else event.tag.rsplit("}", 1)[-1])
                item = entry(event, kind)
                report["frames"].append(item)
                emit("frame", item)
                if isinstance(event, ApprovalRequired):
                    emit("waiting", {"thread": event.thread, "approval": event.approval,
                                     "listener": event.listener, "expires": event.expires})
            open_threads.remove(exchange.thread)
        except Huh as exc:
            item = {"thread": exc.thread, "from": exc.sender, "kind": "huh",
                    "xml": exc.frame.decode("utf-8", "replace")}
            report["frames"].append(item)
            emit("frame", item)
            open_threads.remove(exchange.thread)
            code = EXIT_FAILED
            hint = _hint(exc, client)
            if hint and hint not in hints:
                hints.append(hint)
        except TimeoutError as exc:
            errors.append(str(exc))
            code = EXIT_FAILED
        except BusError as exc:
            errors.append(str(exc))
            code = EXIT_FAILED

    try:
        exchanges = []
        for doc in docs:
            exchange = await bus.start(doc, to=to, thread=thread, timeout=timeout,
                                       previews=stream)
            exchanges.append(exchange)
            open_threads.append(exchange.thread)
            report["sent"].append(exchange.thread)
            emit("sent", {"thread": exchange.thread})
        await asyncio.gather(*(follow(e) for e in exchanges))
    except ValueError as exc:  # --to with a whole envelope
        report["error"] = str(exc)
        code = EXIT_USAGE
    except BusError as exc:
        report["error"] = str(exc)
        code = EXIT_FAILED
    finally:
        await bus.aclose()
    if errors and "error" not in report:
        report["error"] = "; ".join(dict.fromkeys(errors))
    if hints:
        report["hint"] = "\n".join(hints)
    report["complete"] = not open_threads
    return code, report


def default_cafile(secret_file: Path) -> Path | None:
    """The certificate `agentd init` wrote beside a secret file (`tls/cert.pem` in the
    same home), if it is there: a home's own self-signed certificate is trusted
    without naming it."""
    candidate = secret_file.parent / "tls" / "cert.pem"
    return candidate if candidate.is_file() else None


@click.command("send", context_settings=HELP_OPTIONS)
@click.option("--url", "urls", multiple=True, default=[DEFAULT_URL], show_default=True,
              help="The bus URL; repeat it to name others, tried in order when one cannot "
                   "be reached.")
@click.option("--client", default="alice", show_default=True, help="The client id.")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOTP secret file [default: agentd-home/CLIENT.totp].")
@click.option("--session-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Where the session token is cached [default: the secret file with "
                   "suffix .session].")
@click.option("--thread", type=click.UUID, metavar="UUID",
              callback=lambda _c, _p, v: None if v is None else str(v),
              help="Send bare payloads on this thread (a UUID; default: a new one each).")
@click.option("--to", metavar="LISTENER",
              help="Address bare payloads to this listener (meta/to): among the listeners "
                   "that take the payload, only it.")
@click.option("--timeout", default=30.0, show_default=True, type=float,
              help="Seconds to wait for each answer (a call parked for approval waits "
                   "until the approval expires, then this long).")
@click.option("--cafile", type=click.Path(dir_okay=False, path_type=Path),
              help="CA or self-signed certificate to trust [default: tls/cert.pem beside "
                   "the secret file, if it exists; else the system's CAs].")
@click.option("--insecure", is_flag=True, help="Do not verify the server certificate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document at the end.")
@click.option("--stream", is_flag=True,
              help="Write an agent's text to stdout as it is written, then the answer; "
                   "what it does (tool calls, their results, waits) goes to stderr.")
@click.argument("file", type=click.File("rb"))
def send_cmd(
    urls: tuple[str, ...], client: str, secret_file: Path | None, session_file: Path | None,
    thread: str | None, to: str | None, timeout: float, cafile: Path | None, insecure: bool,
    as_json: bool, stream: bool, file: Any,
) -> None:
    """Send envelopes or bare payloads from FILE (or - for stdin) and print the frames of
    their threads until each has its outcome (waiting through approval-required) or
    --timeout passes. Frames of other threads (answers an earlier run left behind) go
    to stderr, marked."""
    try:
        docs = read_input(file.read())
    except AgentdError as exc:
        click.echo(f"agentd send: {exc}", err=True)
        sys.exit(EXIT_USAGE)

    mid_line = False  # --stream text was written without its line end

    def emit(what: str, entry: dict[str, Any]) -> None:
        nonlocal mid_line
        if what == "other":  # not this run's: never mixed with its answers
            click.echo(f"<- [other thread] {entry['kind']} from {entry['from']} on thread "
                       f"{entry['thread']}\n   {entry['xml']}", err=True)
            return
        if what == "waiting":
            click.echo(f"agentd send: waiting for approval {entry['approval']} of a call to "
                       f"{entry['listener']} (expires {entry['expires']}): "
                       f"agentctl approve {entry['approval']}", err=True)
            return
        if what == "step":  # what the agent does, beside its text: stderr
            if not as_json:
                click.echo(f"agentd send: {entry['text']}", err=True)
            return
        if what in ("partial", "final"):
            if not as_json:  # raw text as it comes; a stream's end ends its line
                text = entry["text"] if what == "partial" else "\n"
                sys.stdout.write(text)
                sys.stdout.flush()
                mid_line = not text.endswith("\n")
            return
        if as_json:
            return
        if mid_line:  # a frame while a model writes: on a line of its own
            click.echo("")
            mid_line = False
        if what == "sent":
            click.echo(f"-> sent on thread {entry['thread']}")
        else:
            click.echo(f"<- {entry['kind']} from {entry['from']} on thread {entry['thread']}")
            click.echo(f"   {entry['xml']}")

    try:
        code, report = asyncio.run(_send_main(
            list(urls), client, secret_file, session_file, thread, to, timeout, cafile,
            not insecure, docs, emit, stream,
        ))
    except AgentdError as exc:
        click.echo(f"agentd send: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(report))
    if "error" in report:
        click.echo(f"agentd send: {report['error']}", err=True)
    if report.get("hint"):
        click.echo(report["hint"], err=True)
    sys.exit(code)


@click.command("mcp-serve", context_settings=HELP_OPTIONS)
@click.option("--url", "urls", multiple=True, default=[DEFAULT_URL], show_default=True,
              help="The bus URL; repeat it to name others, tried in order when one cannot "
                   "be reached.")
@click.option("--client", required=True, help="The client id (its profile decides the tools).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOTP secret file [default: agentd-home/CLIENT.totp].")
@click.option("--session-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Where the session token is kept: logged in with when present, written "
                   "after a TOTP login (so a second process within 30 s needs no code).")
@click.option("--cafile", type=click.Path(dir_okay=False, path_type=Path),
              help="CA or self-signed certificate to trust [default: tls/cert.pem beside "
                   "the secret file, if it exists; else the system's CAs].")
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Seconds a tool call waits for its answer.")
def mcp_serve_cmd(urls: tuple[str, ...], client: str, secret_file: Path | None,
                  session_file: Path | None, cafile: Path | None, timeout: float) -> None:
    """An MCP server on stdin/stdout offering the listeners CLIENT's profile permits."""
    from agentd.client import AuthenticationFailed, BusError, Client
    from agentd.mcp.serve import serve

    secret_path = secret_file or DEFAULT_HOME / f"{client}.totp"
    try:
        try:
            secret: str | None = read_secret(secret_path)
        except AgentdError:
            if session_file is None or read_session_file(session_file)[1] is None:
                raise
            secret = None  # a session token alone
        bus = Client(list(urls), client, secret=secret, session_file=session_file,
                     cafile=cafile or default_cafile(secret_path))
    except (AgentdError, ValueError) as exc:
        click.echo(f"agentd mcp-serve: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        asyncio.run(serve(bus, timeout))
    except AuthenticationFailed as exc:
        click.echo(f"agentd mcp-serve: {exc}\n{_hint(exc, client)}", err=True)
        sys.exit(EXIT_AUTH)
    except (BusError, AgentdError) as exc:  # AgentdError: the daemon offers nothing
        click.echo(f"agentd mcp-serve: {exc}", err=True)
        if isinstance(exc, BusError) and exc.certificate:
            click.echo(_hint(exc, client), err=True)
        sys.exit(EXIT_CONNECT)


__all__ = [
    "executable", "init_cmd", "init_home", "mcp_serve_cmd", "next_steps", "read_secret",
    "send_cmd", "totp_cmd",
]
