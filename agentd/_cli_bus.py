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
    sections = {k: data[k] for k in ("pump", "journal", "profiles", "listeners")}
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


def organism_yaml(host: str, port: int, metrics: str) -> str:
    # The organism's name is part of every prompt, so it is the one the cassette
    # was recorded with.
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
    metrics: str = f"127.0.0.1:{DEFAULT_METRICS_PORT}",
) -> dict[str, Any]:
    """Write a working setup into `home`; refuses to overwrite any of its files.
    Everything the organism refers to is inside `home`, by relative path."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agentd.bus import make_self_signed
    from agentd.config import CLIENT_ID

    if not CLIENT_ID.fullmatch(client) or client == "core":
        raise AgentdError(f"invalid client id {client!r}")
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
    organism = organism_yaml(host, port, metrics)
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
@click.option("--host", default="127.0.0.1", show_default=True, help="bus.host to listen on.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535),
              help="bus.port: the TLS WebSocket bus (0: any free port).")
@click.option("--metrics-port", default=DEFAULT_METRICS_PORT, show_default=True,
              type=click.IntRange(0, 65535),
              help="Port of metrics.listen on 127.0.0.1 (/metrics, /healthz, /readyz).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def init_cmd(
    home: Path, client: str, host: str, port: int, metrics_port: int, as_json: bool
) -> None:
    """Write a working setup into the --dir folder: organism.yaml (the demo tools and
    the tutor agent with its prompt and cassette), a self-signed TLS cert, a clients
    file with one client and its TOTP secret, an operator key, the organism's
    identity key (printed as its public line)."""
    try:
        info = init_home(home, client, host, port, f"127.0.0.1:{metrics_port}")
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


def read_secret(path: Path) -> str:
    """A TOTP secret file: the base32 secret, or an otpauth:// URI, on one line."""
    from agentd.config import normalise_secret

    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise AgentdError(f"cannot read secret file {path}: {exc.strerror or exc}") from None
    if text.startswith("otpauth://"):
        text = pyotp.parse_uri(text).secret
    try:
        return normalise_secret(text)
    except ValueError as exc:
        raise AgentdError(f"secret file {path}: {exc}") from None


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


def read_session_file(path: Path) -> tuple[str | None, str | None]:
    """(the bus URL the token was issued by, the token) from a session file: `agentd
    send` caches "URL\\nTOKEN"; a file of one line is a bare token (URL None).
    (None, None) if there is none."""
    try:
        lines = path.read_text(encoding="utf-8").split()
    except OSError:
        return None, None
    if len(lines) == 1:
        return None, lines[0]
    if len(lines) == 2:
        return lines[0], lines[1]
    return None, None


async def _send_main(
    url: str, client: str, secret_file: Path | None, session_file: Path | None,
    thread: str | None, timeout: float, cafile: Path | None, verify: bool,
    docs: list[bytes], emit: Any,
) -> tuple[int, dict[str, Any]]:
    from agentd.client import AuthenticationFailed, BusClient, BusError, frame_kind, is_answer

    secret_path = secret_file or DEFAULT_HOME / f"{client}.totp"
    secret = read_secret(secret_path)
    session_path = session_file or secret_path.with_suffix(".session")
    if cafile is None and verify:
        cafile = default_cafile(secret_path)
    issued_by, session = read_session_file(session_path)
    if issued_by != url:  # a token is sent only to the bus that issued it
        session = None
    report: dict[str, Any] = {"url": url, "client": client, "sent": [], "frames": []}
    try:
        bus = BusClient(url, client, secret=secret, session=session, cafile=cafile,
                        verify=verify)
    except ValueError as exc:  # not a wss:// URL
        report["error"] = str(exc)
        return EXIT_CONNECT, report
    try:
        try:
            await bus.connect()
        except AuthenticationFailed:
            if session is None:
                raise
            session_path.unlink(missing_ok=True)  # stale: log in with TOTP instead
            bus = BusClient(url, client, secret=secret, cafile=cafile, verify=verify)
            await bus.connect()
    except AuthenticationFailed as exc:
        report["error"] = str(exc)
        return EXIT_AUTH, report
    except BusError as exc:
        report["error"] = str(exc)
        return EXIT_CONNECT, report
    if bus.session and bus.session != session:
        try:
            from agentd.bus import write_private_atomic

            write_private_atomic(session_path, f"{url}\n{bus.session}\n".encode())
        except OSError:
            pass  # the cache is a convenience
    open_threads: dict[str, bool] = {}
    code = EXIT_OK
    try:
        for doc in docs:
            frame, sent_thread = bus.wrap(doc, thread)
            await bus.send_raw(frame)
            open_threads[sent_thread] = True
            report["sent"].append(sent_thread)
            emit("sent", {"thread": sent_thread})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(open_threads.values()):
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError
            frame = await bus.recv(timeout=left)
            sender, kind, frame_thread = frame_kind(frame)
            entry = {"thread": frame_thread, "from": sender, "kind": kind,
                     "xml": frame.decode("utf-8", "replace")}
            report["frames"].append(entry)
            emit("frame", entry)
            if is_answer(frame):
                if sender == "core" and kind == "huh":
                    code = EXIT_FAILED
                if frame_thread in open_threads:
                    open_threads[frame_thread] = False
                elif "" in open_threads or frame_thread == "00000000-0000-0000-0000-000000000000":
                    # the answer to input too broken to have a thread
                    for key, still in open_threads.items():
                        if still:
                            open_threads[key] = False
                            break
    except TimeoutError:
        report["error"] = f"no answer within {timeout} s"
        code = EXIT_FAILED
    except BusError as exc:
        report["error"] = str(exc)
        code = EXIT_FAILED
    finally:
        await bus.close()
    report["complete"] = not any(open_threads.values())
    return code, report


def default_cafile(secret_file: Path) -> Path | None:
    """The certificate `agentd init` wrote beside a secret file (`tls/cert.pem` in the
    same home), if it is there: a home's own self-signed certificate is trusted
    without naming it."""
    candidate = secret_file.parent / "tls" / "cert.pem"
    return candidate if candidate.is_file() else None


@click.command("send", context_settings=HELP_OPTIONS)
@click.option("--url", default=DEFAULT_URL, show_default=True, help="The bus URL.")
@click.option("--client", default="alice", show_default=True, help="The client id.")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOTP secret file [default: agentd-home/CLIENT.totp].")
@click.option("--session-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Where the session token is cached [default: the secret file with "
                   "suffix .session].")
@click.option("--thread", type=click.UUID, metavar="UUID",
              callback=lambda _c, _p, v: None if v is None else str(v),
              help="Send bare payloads on this thread (a UUID; default: a new one each).")
@click.option("--timeout", default=30.0, show_default=True, type=float,
              help="Seconds to wait for the answers.")
@click.option("--cafile", type=click.Path(dir_okay=False, path_type=Path),
              help="CA or self-signed certificate to trust [default: tls/cert.pem beside "
                   "the secret file, if it exists; else the system's CAs].")
@click.option("--insecure", is_flag=True, help="Do not verify the server certificate.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document at the end.")
@click.argument("file", type=click.File("rb"))
def send_cmd(
    url: str, client: str, secret_file: Path | None, session_file: Path | None,
    thread: str | None, timeout: float, cafile: Path | None, insecure: bool, as_json: bool,
    file: Any,
) -> None:
    """Send envelopes or bare payloads from FILE (or - for stdin) and print every frame
    received until each conversation is answered or --timeout passes."""
    try:
        docs = read_input(file.read())
    except AgentdError as exc:
        click.echo(f"agentd send: {exc}", err=True)
        sys.exit(EXIT_USAGE)

    def emit(what: str, entry: dict[str, Any]) -> None:
        if as_json:
            return
        if what == "sent":
            click.echo(f"-> sent on thread {entry['thread']}")
        else:
            click.echo(f"<- {entry['kind']} from {entry['from']} on thread {entry['thread']}")
            click.echo(f"   {entry['xml']}")

    try:
        code, report = asyncio.run(_send_main(
            url, client, secret_file, session_file, thread, timeout, cafile, not insecure,
            docs, emit,
        ))
    except AgentdError as exc:
        click.echo(f"agentd send: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if as_json:
        click.echo(json.dumps(report))
    elif "error" in report:
        click.echo(f"agentd send: {report['error']}", err=True)
    sys.exit(code)


@click.command("mcp-serve", context_settings=HELP_OPTIONS)
@click.option("--url", default=DEFAULT_URL, show_default=True, help="The bus URL.")
@click.option("--client", required=True, help="The client id (its profile decides the tools).")
@click.option("--secret-file", type=click.Path(dir_okay=False, path_type=Path),
              help="TOTP secret file [default: agentd-home/CLIENT.totp].")
@click.option("--session-file", type=click.Path(dir_okay=False, path_type=Path),
              help="A session token to log in with instead of a TOTP code, if present.")
@click.option("--cafile", type=click.Path(dir_okay=False, path_type=Path),
              help="CA or self-signed certificate to trust [default: tls/cert.pem beside "
                   "the secret file, if it exists; else the system's CAs].")
@click.option("--timeout", default=60.0, show_default=True, type=float,
              help="Seconds a tool call waits for its answer.")
def mcp_serve_cmd(url: str, client: str, secret_file: Path | None, session_file: Path | None,
                  cafile: Path | None, timeout: float) -> None:
    """An MCP server on stdin/stdout offering the listeners CLIENT's profile permits."""
    from agentd.client import BusClient, BusError
    from agentd.mcp.serve import serve

    secret_path = secret_file or DEFAULT_HOME / f"{client}.totp"
    session = None
    if session_file is not None:  # a bare token, or `agentd send`'s cache for this URL
        issued_by, session = read_session_file(session_file)
        if issued_by not in (None, url):
            session = None
    try:
        secret = read_secret(secret_path) if session is None else None
        bus = BusClient(url, client, secret=secret, session=session,
                        cafile=cafile or default_cafile(secret_path))
    except (AgentdError, ValueError) as exc:
        click.echo(f"agentd mcp-serve: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        asyncio.run(serve(bus, timeout))
    except (BusError, AgentdError) as exc:  # AgentdError: the daemon offers nothing
        click.echo(f"agentd mcp-serve: {exc}", err=True)
        sys.exit(EXIT_CONNECT)


__all__ = [
    "executable", "init_cmd", "init_home", "mcp_serve_cmd", "next_steps", "read_secret",
    "send_cmd", "totp_cmd",
]
