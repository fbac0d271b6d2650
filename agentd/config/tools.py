"""The `tool:` block of a listener: one frozen dataclass per tool kind, chosen by
`kind`.

A listener with a `tool:` block has no `handler` or `agent`: the tool's payload and
response classes are built in (except for `wasm`, whose module speaks the classes
given under `tool:`). These classes only declare the keys and their limits; what a
kind does with them, and the checks that need the host (is Landlock there, does the
module's hash match), live with the tool in `agentd.tools`, which describes the tool
from one of these at load (a value; a configuration error at this block's location
when it cannot run here) and builds its handler when the daemon puts it in service.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, Strict
from pydantic.dataclasses import dataclass

from agentd.config.values import (
    AnyText,
    Bool,
    ClassRefs,
    Directory,
    EnvName,
    FilePath,
    Positive,
    Problem,
    Seconds,
    Text,
    Url,
    problem,
    rules,
    unknown_user,
)

SECTION = ConfigDict(extra="forbid")
MIB = 1024 * 1024


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise problem(f"not a regular expression: {exc}") from None
    return value


def _cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise problem(f"not an address range (CIDR): {value!r}") from None
    return value


def _host_pattern(value: str) -> str:
    """An exact host name, `*.suffix`, or an IPv6 literal, bracketed or bare (kept in
    its compressed form, as the tool compares it); never a bare `*`."""
    literal = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if ":" in literal and "%" in literal:
        raise problem(f"an IPv6 literal with a zone cannot be allowed: {value!r}")
    if ":" in literal:
        try:
            return ipaddress.IPv6Address(literal).compressed
        except ValueError:
            pass
    name = value[2:] if value.startswith("*.") else value
    if not name or any(c in name for c in "*/:[]"):
        raise problem(f"not a host name, *.suffix pattern or IPv6 literal: {value!r}")
    return value.lower()


def _sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise problem("not a SHA-256 in hex (64 hex digits)")
    return value.lower()


Regex = Annotated[str, Strict(), AfterValidator(_regex)]
Cidr = Annotated[str, Strict(), AfterValidator(_cidr)]
HostPattern = Annotated[str, Strict(), AfterValidator(_host_pattern)]
Sha256 = Annotated[str, Strict(), AfterValidator(_sha256)]
Bytes = Annotated[int, Strict(), Field(ge=1)]
Megabytes = Annotated[int, Strict(), Field(ge=1, le=1024 * 1024)]
Argv = Annotated[tuple[Text, ...], Field(min_length=1)]


@dataclass(frozen=True, config=SECTION)
class FileReadTool:
    kind: Literal["file-read"]
    root: Directory
    max_bytes: Bytes = MIB


@dataclass(frozen=True, config=SECTION)
class FileWriteTool:
    kind: Literal["file-write"]
    root: Directory
    max_bytes: Bytes = MIB


@dataclass(frozen=True, config=SECTION)
class FileListTool:
    kind: Literal["file-list"]
    root: Directory
    max_entries: Positive = 1000


@dataclass(frozen=True, config=SECTION)
class ExecTool:
    kind: Literal["exec"]
    argv: Argv  # argv[0] is the program; `{name}` placeholders are filled per call
    allow_args: dict[str, Regex] = Field(default_factory=dict)
    root: Directory | None = None  # what the program may read and write besides itself
    cwd: Text | None = None  # relative to `root`
    timeout_s: Seconds = 10.0
    max_output_bytes: Bytes = 64 * 1024
    memory_mb: Megabytes = 256
    max_tasks: Positive = 64  # processes and threads at once, all it starts included
    network: Bool = False
    env: dict[EnvName, str] = Field(default_factory=dict)


@dataclass(frozen=True, config=SECTION)
class HttpFetchTool:
    kind: Literal["http-fetch"]
    allow_hosts: Annotated[tuple[HostPattern, ...], Field(min_length=1)]
    allow_schemes: tuple[Literal["https", "http"], ...] = ("https",)
    max_bytes: Bytes = MIB
    timeout_s: Seconds = 10.0
    max_redirects: Annotated[int, Strict(), Field(ge=0, le=20)] = 3
    allow_private: tuple[Cidr, ...] = ()


@dataclass(frozen=True, config=SECTION)
class WasmTool:
    kind: Literal["wasm"]
    module: FilePath
    payload_class: ClassRefs
    response_class: ClassRefs = ()
    sha256: Sha256 | None = None
    fuel: Positive = 1_000_000_000
    memory_mb: Megabytes = 64
    timeout_ms: Positive = 1000
    preopens: dict[Text, Directory] = Field(default_factory=dict)  # guest dir -> host dir


@dataclass(frozen=True, config=SECTION)
class TimerTool:
    kind: Literal["timer"]
    max_delay_s: Seconds = 86_400.0
    max_pending_per_thread: Positive = 16


# Keys of a handler's `isolation:` that have no meaning for an MCP server, and why.
_MCP_NOT_ISOLATION = {
    "process": "a stdio MCP server always runs in a process of its own",
    "cpu_s": "cpu_s bounds one call; a server's RLIMIT_CPU would count its whole life",
    "workers": "a server is one process with one session; it is restarted when it ends",
    "max_calls": "a server is one process with one session; it is restarted when it ends",
    "max_rss_mb": "a server is one process with one session; it is restarted when it ends",
    "env": "give a server's environment as tool `env`",
}
# The isolation keys that also exist on the tool: one value each, given once or equal.
_MCP_SHARED = ("memory_mb", "network")


def _mcp_rules(data: dict[str, Any]) -> list[Problem]:
    """`isolation:` confines a stdio server's process: refused for a `url` server,
    for keys that cannot apply to a server, and where it contradicts the tool's own
    `memory_mb` or `network`."""
    iso = data.get("isolation")
    if not isinstance(iso, dict):
        return []
    if data.get("url") is not None:
        return [Problem(("isolation",), "isolation confines a stdio server's process; a "
                        "`url` server is not a process of this daemon", iso)]
    problems = [Problem(("isolation", key), why, iso[key])
                for key, why in _MCP_NOT_ISOLATION.items() if key in iso]
    for key in _MCP_SHARED:
        if key in iso and key in data and iso[key] != data[key]:
            problems.append(Problem(("isolation", key), f"contradicts the tool's own {key} "
                                    f"({data[key]!r}); give it once", iso[key]))
    return problems


def _mcp_shared(data: Any) -> Any:
    """The tool's `memory_mb` and `network` take the isolation's values when only the
    isolation gives them (one value each, read by the confinement)."""
    iso = data.get("isolation") if isinstance(data, dict) else None
    if not isinstance(iso, dict):
        return data
    shared = {k: iso[k] for k in _MCP_SHARED if iso.get(k) is not None and k not in data}
    # The keys refused above are reported once, by the rule, not again as unknown.
    kept = {k: v for k, v in iso.items() if k not in _MCP_NOT_ISOLATION}
    return {**data, **shared, "isolation": kept}


@dataclass(frozen=True, config=SECTION)
class McpIsolation:
    """A stdio MCP server confined like an isolated handler's worker (the keys that
    apply to one long-lived process)."""

    memory_mb: Megabytes | None = None  # RLIMIT_AS of the server (None: the tool's)
    network: Bool | None = None  # None: the tool's `network`
    open_files: Positive = 256
    # processes and threads of the server and all it starts, at once (a pids cgroup);
    # servers that drive a browser run a hundred threads and more
    max_tasks: Positive = 256
    user: AnyText | None = None  # run the server as this user (the daemon must be root)

    _rules = rules(lambda data, _: unknown_user(data), "isolation")


@dataclass(frozen=True, config=SECTION)
class McpTool:
    kind: Literal["mcp"]
    tools: Annotated[tuple[Text, ...], Field(min_length=1)]  # the allowlist
    command: Argv | None = None  # a stdio server
    url: Url | None = None  # a Streamable HTTP server
    env: dict[EnvName, str] = Field(default_factory=dict)
    timeout_s: Seconds = 30.0
    max_result_bytes: Bytes = MIB
    network: Bool = False  # stdio servers; a `url` server is reached by the daemon
    root: Directory | None = None  # a stdio server may read and write beneath it
    read: tuple[Directory, ...] = ()  # and read beneath these (its code, its packages)
    memory_mb: Megabytes = 512
    allow_private: tuple[Cidr, ...] = ()  # for `url`: as http-fetch's
    isolation: McpIsolation | None = None  # stdio: limits as an isolated worker's

    _rules = rules(lambda data, _: _mcp_rules(data), "tool", _mcp_shared)


ToolConfig = Annotated[
    FileReadTool | FileWriteTool | FileListTool | ExecTool | HttpFetchTool | WasmTool
    | TimerTool | McpTool,
    Field(discriminator="kind"),
]

# Kinds whose payload and response classes are given under `tool:` by the operator.
OPERATOR_CLASSES = frozenset({"wasm"})
