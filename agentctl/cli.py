"""`agentctl`: the operator's client for agentd's out-of-band socket
(docs/commands.md).

It only turns flags into one signed request and the answer into output; signing,
framing and parsing are `agentd.oob`'s.

Exit codes: 0 done; 1 the daemon refused or the command failed (or a local step
failed, e.g. keygen's file exists); 2 usage (including a missing or unusable key);
3 cannot connect, or no valid answer; 4 the daemon rejected the signature, key,
time or nonce.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import click

from agentctl._render import render_text, render_trace, result_to_json
from agentd import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_CONNECT, EXIT_REJECTED = 0, 1, 2, 3, 4
DEFAULT_SOCKET = Path("/var/lib/agentd/oob.sock")

_AUTH_HINTS = {
    "bad-signature": "the daemon does not accept this key's signature for this key-id "
                     "(is --key the private half of the key authorized as --key-id?)",
    "unknown-key": "this key-id is not in the daemon's authorized_keys "
                   "(add the line `agentctl keygen` printed, then restart or reload)",
    "stale": "this host's clock and the daemon's differ by more than the allowed skew",
    "replay": "this exact request was already received (each request needs a new nonce)",
}


@dataclass
class Settings:
    socket: Path
    key: Path | None
    key_id: str | None
    as_json: bool
    timeout: float


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="AGENTCTL_SOCKET", show_envvar=True,
              type=click.Path(dir_okay=False, readable=False, path_type=Path),
              default=DEFAULT_SOCKET,
              show_default=True, help="The daemon's out-of-band socket.")
@click.option("--key", envvar="AGENTCTL_KEY", show_envvar=True,
              type=click.Path(dir_okay=False, readable=False, path_type=Path),
              help="Ed25519 private key (OpenSSH format) to sign with.")
@click.option("--key-id", envvar="AGENTCTL_KEY_ID", show_envvar=True, metavar="ID",
              help="Key-id to sign as [default: the key file's comment].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              metavar="SECONDS",
              envvar="AGENTCTL_TIMEOUT", help="Seconds to wait for the daemon.")
@click.version_option(version=__version__, prog_name="agentctl")
@click.pass_context
def main(ctx: click.Context, socket_path: Path, key: Path | None, key_id: str | None,
         as_json: bool, timeout: float) -> None:
    """Send signed privileged commands to a running agentd.

    Exit codes: 0 done, 1 refused or failed, 2 usage, 3 cannot connect,
    4 signature, key, time or nonce rejected.
    """
    ctx.obj = Settings(socket_path, key, key_id, as_json, timeout)


# --- output --------------------------------------------------------------------------


def _emit_json(ok: bool, result: Any = None, error: tuple[str, str] | None = None) -> None:
    doc = {
        "ok": ok,
        "result": result,
        "error": None if error is None else {"code": error[0], "message": error[1]},
    }
    click.echo(json.dumps(doc, ensure_ascii=False, indent=2))


def _fail(settings: Settings, code: str, message: str, exit_code: int,
          hint: str = "") -> NoReturn:
    if settings.as_json:
        _emit_json(False, error=(code, message))
    else:
        click.echo(f"agentctl: {message}" if code in ("connect", "usage", "local")
                   else f"agentctl: {code}: {message}", err=True)
        if hint:
            click.echo(f"agentctl: {hint}", err=True)
    sys.exit(exit_code)


# --- the request -------------------------------------------------------------------------


def _signing_key(settings: Settings) -> tuple[Any, str]:
    from agentd.oob import KeyFileError, load_private_key, valid_key_id

    if settings.key is None:
        _fail(settings, "usage", "no key: pass --key FILE or set AGENTCTL_KEY "
              "(create one with `agentctl keygen --out FILE`)", EXIT_USAGE)
    try:
        private, comment = load_private_key(settings.key)
    except KeyFileError as exc:
        _fail(settings, "usage", str(exc), EXIT_USAGE)
    key_id = settings.key_id or comment
    if not key_id:
        _fail(settings, "usage", f"no key-id: pass --key-id or set AGENTCTL_KEY_ID "
              f"({settings.key} has no key-id comment)", EXIT_USAGE)
    if not valid_key_id(key_id):
        _fail(settings, "usage", f"key-id {key_id!r} must match [A-Za-z0-9_.@-]{{1,128}}",
              EXIT_USAGE)
    return private, key_id


def _send(ctx: click.Context, command: str, args: dict[str, str], unwrap: str = "",
          text: Callable[[Any], str] = render_text) -> NoReturn:
    """Sign and send one command, print its result, exit. `unwrap`: the result's root
    element whose content is the command's document (`{"thread", "segments"}` rather
    than `{"context": {...}}`)."""
    from agentd.oob import AUTH_CODES, OobClient, OobConnectError, OobProtocolError, sign_request

    settings: Settings = ctx.obj
    private, key_id = _signing_key(settings)
    request = sign_request(private, key_id, command, args)
    try:
        with OobClient(settings.socket, timeout=settings.timeout) as client:
            response = client.request(request)
    except OobConnectError as exc:
        _fail(settings, "connect", str(exc), EXIT_CONNECT, _connect_hint(exc.reason))
    except OobProtocolError as exc:
        _fail(settings, "connect", f"{settings.socket}: {exc}", EXIT_CONNECT)
    if not response.ok:
        code = response.error_code
        exit_code = EXIT_REJECTED if code in AUTH_CODES else EXIT_FAILED
        _fail(settings, code, response.error_message, exit_code, _AUTH_HINTS.get(code, ""))
    value = result_to_json(response.result)
    if unwrap and isinstance(value, dict) and list(value) == [unwrap]:
        value = value[unwrap]
    if settings.as_json:
        _emit_json(True, value)
    else:
        shown = text(value)
        if shown:
            click.echo(shown.rstrip("\n"))
    sys.exit(EXIT_OK)


def _connect_hint(reason: str) -> str:
    if "no such file" in reason or "connection refused" in reason:
        return "is agentd running? (--socket or AGENTCTL_SOCKET names its oob.sock)"
    if "permission denied" in reason:
        return "the socket is mode 0600: run as the daemon's user or root"
    return ""


# --- commands ----------------------------------------------------------------------


@main.command()
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the private key (mode 0600; never overwritten).")
@click.option("--key-id", "keygen_key_id", metavar="ID",
              help="Key-id for the key [default: USER@HOST].")
@click.pass_context
def keygen(ctx: click.Context, out: Path, keygen_key_id: str | None) -> None:
    """Write a new Ed25519 key and print its authorized_keys line.

    The private key goes to FILE (OpenSSH format, mode 0600, the key-id as its
    comment) and the public line to FILE.pub; append that line to the daemon's
    authorized_keys.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agentd.oob import authorized_keys_line, valid_key_id, write_private_key

    settings: Settings = ctx.obj
    key_id = keygen_key_id or settings.key_id or _default_key_id()
    if not valid_key_id(key_id):
        raise click.BadParameter(f"{key_id!r} must match [A-Za-z0-9_.@-]{{1,128}}",
                                 param_hint="--key-id")
    pub_path = out.with_name(out.name + ".pub")
    if not out.parent.is_dir():  # a mistyped folder would be created, the key put there
        _fail(settings, "local", f"{out.parent} is not a folder; create it first", EXIT_FAILED)
    for path in (out, pub_path):
        if path.exists() or path.is_symlink():
            _fail(settings, "local", f"{path} exists; refusing to overwrite it", EXIT_FAILED)
    key = Ed25519PrivateKey.generate()
    line = authorized_keys_line(key.public_key(), key_id)
    try:
        write_private_key(out, key, key_id)
        pub_path.write_text(line + "\n", encoding="utf-8")
    except OSError as exc:
        _fail(settings, "local", f"cannot write {exc.filename}: "
              f"{(exc.strerror or str(exc)).lower()}", EXIT_FAILED)
    if settings.as_json:
        _emit_json(True, {"key_file": str(out), "public_file": str(pub_path),
                          "key_id": key_id, "authorized_keys_line": line})
    else:
        click.echo(f"wrote {out} (mode 0600) and {pub_path}; add this line to the "
                   f"daemon's authorized_keys:", err=True)
        click.echo(line)


def _default_key_id() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    raw = f"{user}@{socket.gethostname()}"
    return re.sub(r"[^A-Za-z0-9_.@\-]", "-", raw)[:128]


@main.command()
@click.pass_context
def status(ctx: click.Context) -> None:
    """Uptime, config hash, listeners, threads, queue depth."""
    _send(ctx, "status", {})


@main.command()
@click.option("--dry-run", is_flag=True, help="Validate the configuration only.")
@click.pass_context
def reload(ctx: click.Context, dry_run: bool) -> None:
    """Re-read the configuration and print the diff (added/removed/changed listeners)."""
    _send(ctx, "reload", {"dry-run": "true" if dry_run else "false"})


@main.group()
def introspect() -> None:
    """Capabilities, schemas, examples, prompts and threads of the running organism."""


@introspect.command("capabilities")
@click.pass_context
def introspect_capabilities(ctx: click.Context) -> None:
    """The listeners the organism offers."""
    _send(ctx, "introspect", {"what": "capabilities"})


@introspect.command("schema")
@click.argument("name")
@click.pass_context
def introspect_schema(ctx: click.Context, name: str) -> None:
    """The XSD of listener NAME's payload."""
    _send(ctx, "introspect", {"what": "schema", "name": name})


@introspect.command("example")
@click.argument("name")
@click.pass_context
def introspect_example(ctx: click.Context, name: str) -> None:
    """A valid example payload for listener NAME."""
    _send(ctx, "introspect", {"what": "example", "name": name})


@introspect.command("prompt")
@click.argument("name")
@click.pass_context
def introspect_prompt(ctx: click.Context, name: str) -> None:
    """The prompt of agent NAME."""
    _send(ctx, "introspect", {"what": "prompt", "name": name})


def _listing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--thread and --limit, for a listing that could otherwise pass 1 MiB."""
    fn = click.option("--limit", type=click.IntRange(1, 10_000), metavar="N",
                      help="At most N (default 500), the oldest first.")(fn)
    return click.option("--thread", type=click.UUID, metavar="UUID",
                        help="Only this client conversation's.")(fn)


def _listing_args(thread: Any, limit: int | None, **args: str) -> dict[str, str]:
    if thread is not None:
        args["thread"] = str(thread)
    if limit is not None:
        args["limit"] = str(limit)
    return args


@introspect.command("threads")
@_listing
@click.pass_context
def introspect_threads(ctx: click.Context, thread: Any, limit: int | None) -> None:
    """The live threads."""
    _send(ctx, "introspect", _listing_args(thread, limit, what="threads"))


@introspect.command("thread")
@click.argument("thread", type=click.UUID, metavar="UUID")
@click.pass_context
def introspect_thread(ctx: click.Context, thread: Any) -> None:
    """Thread UUID, with its private path (for forensics)."""
    _send(ctx, "introspect", {"what": "thread", "thread": str(thread)})


@introspect.command("context")
@click.argument("thread", type=click.UUID, metavar="UUID")
@click.pass_context
def introspect_context(ctx: click.Context, thread: Any) -> None:
    """A thread's context segments: tier, relevance, size, token estimate."""
    _send(ctx, "introspect", {"what": "context", "thread": str(thread)}, unwrap="context")


@main.group()
def memory() -> None:
    """An agent's long-term memory (recalled into its prompts by similarity)."""


@memory.command("add")
@click.argument("agent")
@click.argument("text")
@click.option("--key", metavar="KEY", help="A key: a keyed memory cannot redefine a fact.")
@click.pass_context
def memory_add(ctx: click.Context, agent: str, text: str, key: str | None) -> None:
    """Store TEXT as a long-term memory of AGENT."""
    args = {"action": "add", "agent": agent, "text": text}
    if key is not None:
        args["key"] = key
    _send(ctx, "memory", args, unwrap="memory")


@memory.command("list")
@click.argument("agent")
@click.pass_context
def memory_list(ctx: click.Context, agent: str) -> None:
    """AGENT's long-term memories, oldest first."""
    _send(ctx, "memory", {"action": "list", "agent": agent}, unwrap="memory")


@memory.command("forget")
@click.argument("agent")
@click.argument("memory_id", metavar="ID")
@click.pass_context
def memory_forget(ctx: click.Context, agent: str, memory_id: str) -> None:
    """Delete AGENT's memory ID."""
    _send(ctx, "memory", {"action": "forget", "agent": agent, "id": memory_id},
          unwrap="memory")


@introspect.command("route")
@click.argument("profile")
@click.argument("text")
@click.pass_context
def introspect_route(ctx: click.Context, profile: str, text: str) -> None:
    """The permitted ranking for intent TEXT in PROFILE, with scores."""
    _send(ctx, "introspect", {"what": "route", "profile": profile, "text": text},
          unwrap="route")


@introspect.command("timers")
@_listing
@click.pass_context
def introspect_timers(ctx: click.Context, thread: Any, limit: int | None) -> None:
    """Pending timers: id, thread, listener, due time, note (the soonest first)."""
    _send(ctx, "introspect", _listing_args(thread, limit, what="timers"))


@main.command()
@_listing
@click.pass_context
def approvals(ctx: click.Context, thread: Any, limit: int | None) -> None:
    """Messages parked at approval gates, waiting for a decision."""
    _send(ctx, "approvals", _listing_args(thread, limit))


@main.command()
@click.argument("approval_id", metavar="ID")
@click.option("--payload-sha256", "sha", metavar="HEX",
              help="Approve only if the parked payload has this SHA-256.")
@click.pass_context
def approve(ctx: click.Context, approval_id: str, sha: str | None) -> None:
    """Approve parked message ID: it is dispatched once, as if it had just arrived."""
    args = {"id": approval_id}
    if sha:
        args["payload-sha256"] = sha
    _send(ctx, "approve", args)


@main.command("end-thread")
@click.argument("thread")
@click.pass_context
def end_thread(ctx: click.Context, thread: str) -> None:
    """End client conversation THREAD now: its timers are cancelled, its handler
    state dropped and its parked messages denied (the client is told)."""
    _send(ctx, "end-thread", {"thread": thread})


@main.command()
@click.argument("approval_id", metavar="ID")
@click.option("--reason", metavar="TEXT", default="", help="Recorded in the journal.")
@click.pass_context
def deny(ctx: click.Context, approval_id: str, reason: str) -> None:
    """Deny parked message ID: its caller gets `huh denied` "not approved"."""
    args = {"id": approval_id}
    if reason:
        args["reason"] = reason
    _send(ctx, "deny", args)


@main.command()
@click.option("--thread", type=click.UUID, metavar="UUID", help="Only this thread.")
@click.option("--limit", type=click.IntRange(min=1), metavar="N",
              help="At most N entries (the newest).")
@click.pass_context
def journal(ctx: click.Context, thread: Any, limit: int | None) -> None:
    """Journal entries, newest last."""
    args: dict[str, str] = {}
    if thread is not None:
        args["thread"] = str(thread)
    if limit is not None:
        args["limit"] = str(limit)
    _send(ctx, "journal", args)


@main.command()
@click.argument("thread", type=click.UUID, metavar="THREAD")
@click.option("--limit", type=click.IntRange(min=1, max=10_000), metavar="N",
              help="Build the tree from at most the first N journal entries (2000).")
@click.option("--content", is_flag=True,
              help="Show each LLM call's prompt and completion (kept only with "
                   "telemetry.capture_content).")
@click.pass_context
def trace(ctx: click.Context, thread: Any, limit: int | None, content: bool) -> None:
    """The conversation of client thread THREAD as a tree, from the journal: each
    hop, LLM call, tool call and result, approval and federation hop."""
    args = {"thread": str(thread)}
    if limit is not None:
        args["limit"] = str(limit)
    if content:
        args["content"] = "true"
    _send(ctx, "trace", args, unwrap="trace", text=render_trace)


@main.command()
@click.option("--now", is_flag=True, help="Stop at once instead of draining.")
@click.pass_context
def shutdown(ctx: click.Context, now: bool) -> None:
    """Stop the daemon (a graceful drain by default)."""
    _send(ctx, "shutdown", {"mode": "now" if now else "graceful"})


if __name__ == "__main__":  # pragma: no cover
    main(prog_name="agentctl")
