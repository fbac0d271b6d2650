"""The organism's configuration: `organism.yaml` read once into frozen dataclasses.

The YAML is composed (never constructed) with PyYAML's safe loader, so every value
keeps the line and column it came from. The file is read in one pass that collects
*every* problem as `file:line:col: key.path: message` and raises one `ConfigError`
with all of them; nothing downstream ever sees a raw dict or a half-checked value.

Invariants:
- only plain data: no tags beyond the safe core types, no anchors or aliases (a
  config with `*alias` can be exponentially large once walked), no merge keys,
  no duplicate keys, no unknown keys;
- every reference is resolved here: `module:attribute` imports, prompt files,
  peers, profile members, agent backends and prompt names; a value that loads is
  a value that works, so `reload` can validate a file fully before touching anything;
- relative paths are resolved against the configuration file's folder.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar, cast

import yaml
from yaml.constructor import SafeConstructor

from agentd._errors import ConfigError

__all__ = [
    "AgentConfig",
    "AuthConfig",
    "BusConfig",
    "FrozenMapping",
    "JournalConfig",
    "ListenerConfig",
    "LlmBackendConfig",
    "LlmConfig",
    "MetaConfig",
    "MetricsConfig",
    "OobConfig",
    "OrganismConfig",
    "ProfileConfig",
    "PumpConfig",
    "RetentionPolicy",
    "TlsConfig",
    "check_config_main",
    "load_config",
    "load_config_text",
]

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")
D = TypeVar("D")

RetentionKind = Literal["retain_forever", "prune_on_delivery", "retain_days"]
Synchronous = Literal["NORMAL", "FULL"]
Provider = Literal["openai", "anthropic", "replay"]
Strategy = Literal["failover", "round-robin"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
# `core` is the platform's own sender name (`<from>core</from>`); a listener with
# that name would make the platform's messages forgeable.
RESERVED_LISTENER_NAMES = frozenset({"core"})


# --------------------------------------------------------------------------- model


class FrozenMapping(Mapping[K, V]):
    """An immutable, hashable mapping that keeps insertion order."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[K, V] | None = None) -> None:
        self._data: dict[K, V] = dict(data or {})

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMapping({self._data!r})"


@dataclass(frozen=True)
class TlsConfig:
    cert: Path
    key: Path


@dataclass(frozen=True)
class BusConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    tls: TlsConfig | None = None
    max_envelope_bytes: int = 262144
    max_inflight: int = 1000
    max_connections: int = 1024
    rate_per_s: float = 200.0  # per-client message rate (token bucket refill)
    rate_burst: int = 400
    auth_timeout_s: float = 10.0
    compression: bool = False


@dataclass(frozen=True)
class AuthConfig:
    clients_file: Path | None = None  # only a path here; the auth module reads it
    session_ttl_s: float = 28800.0
    max_failures: int = 5
    failure_window_s: float = 60.0
    lockout_s: float = 60.0


@dataclass(frozen=True)
class OobConfig:
    authorized_keys: Path | None = None
    socket: Path | None = None  # `load_*` always fills it (default state_dir/oob.sock)
    allowed_uids: tuple[int, ...] = ()
    max_frame_bytes: int = 1048576
    clock_skew_s: float = 60.0


@dataclass(frozen=True)
class MetricsConfig:
    listen: str | None = None  # "host:port"; None: no metrics endpoint

    @property
    def host_port(self) -> tuple[str, int] | None:
        return None if self.listen is None else _split_host_port(self.listen)


@dataclass(frozen=True)
class PumpConfig:
    max_concurrency: int = 256
    per_listener_concurrency: int = 64
    handler_timeout_s: float = 30.0
    max_hops: int = 64
    max_queue: int = 10000
    max_fanout: int = 64
    thread_idle_s: float = 86400.0  # conversations idle this long are ended and forgotten


@dataclass(frozen=True)
class RetentionPolicy:
    kind: RetentionKind
    days: int | None = None


RETAIN_FOREVER = RetentionPolicy("retain_forever")


@dataclass(frozen=True)
class JournalConfig:
    retention: RetentionPolicy = RETAIN_FOREVER
    synchronous: Synchronous = "NORMAL"
    commit_interval_ms: float = 0.0  # commit as soon as the writer is free (see docs)
    commit_max_entries: int = 512
    sweep_interval_s: float = 60.0
    max_outbox_per_client: int = 10000  # frames kept for an absent client (newest win)


@dataclass(frozen=True)
class ProfileConfig:
    name: str
    listeners: tuple[str, ...] | Literal["all"]
    retention: RetentionPolicy | None = None  # overrides journal.retention
    synchronous: Synchronous | None = None  # overrides journal.synchronous
    token_budget: int | None = None


@dataclass(frozen=True)
class MetaConfig:
    allow_list_capabilities: bool = False
    allow_schema_requests: bool = False
    allow_example_requests: bool = False


@dataclass(frozen=True)
class LlmBackendConfig:
    name: str
    provider: Provider
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None  # the variable's name; its value is read at use
    cassette: Path | None = None  # replay: the recorded exchanges to play back
    record: Path | None = None  # openai/anthropic: append exchanges to this cassette
    max_concurrency: int = 8
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    timeout_s: float = 60.0


@dataclass(frozen=True)
class LlmConfig:
    strategy: Strategy = "failover"
    backends: tuple[LlmBackendConfig, ...] = ()
    retries: int = 3
    cache_ttl_s: float = 0.0

    def backend(self, name: str) -> LlmBackendConfig:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


@dataclass(frozen=True)
class AgentConfig:
    prompt: str  # "a & b": names of `prompts` entries, composed in this order
    model: str  # the name of an `llm.backends` entry
    max_iterations: int = 8
    max_tokens: int = 2048
    token_budget: int | None = None
    temperature: float | None = None

    @property
    def prompt_names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.prompt.split("&"))


@dataclass(frozen=True)
class ListenerConfig:
    name: str
    payload_classes: tuple[type, ...]
    response_classes: tuple[type, ...] = ()
    handler: Callable[..., Any] | None = None
    agent: AgentConfig | None = None
    description: str = ""
    peers: tuple[str, ...] = ()
    max_concurrency: int | None = None  # None: pump.per_listener_concurrency
    timeout_s: float | None = None  # None: pump.handler_timeout_s
    location: str = ""  # "file:line:col" of the listener's entry, for later messages
    handler_ref: str = ""  # the `module:attribute` strings as written, for reload diffs
    payload_refs: tuple[str, ...] = ()
    response_refs: tuple[str, ...] = ()


@dataclass(frozen=True)
class OrganismConfig:
    name: str
    source: Path | None
    base_dir: Path
    state_dir: Path
    bus: BusConfig = field(default_factory=BusConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    oob: OobConfig = field(default_factory=OobConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    pump: PumpConfig = field(default_factory=PumpConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    profiles: Mapping[str, ProfileConfig] = field(default_factory=FrozenMapping)
    prompts: Mapping[str, str] = field(default_factory=FrozenMapping)
    llm: LlmConfig | None = None
    listeners: tuple[ListenerConfig, ...] = ()
    meta: MetaConfig = field(default_factory=MetaConfig)
    digest: str = ""  # SHA-256 hex of the file's bytes
    python_path: tuple[Path, ...] = ()

    def listener(self, name: str) -> ListenerConfig:
        return self._listeners_by_name[name]

    @cached_property
    def _listeners_by_name(self) -> Mapping[str, ListenerConfig]:
        return {lst.name: lst for lst in self.listeners}


# ------------------------------------------------------------------------ entry points


def load_config(path: str | Path, *, state_dir_override: Path | None = None) -> OrganismConfig:
    """Read and validate `path`. Raises `ConfigError` listing every problem."""
    source_name = str(path)
    source = Path(path).expanduser().absolute()
    try:
        data = source.read_bytes()
    except OSError as exc:
        raise ConfigError(
            [f"{source_name}:1:1: (file): cannot read: {exc.strerror or exc}"]
        ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{source_name}:1:1: (file): not UTF-8 text ({exc.reason} at byte {exc.start})"]
        ) from None
    return _load(
        text,
        source.parent,
        source_name,
        source,
        hashlib.sha256(data).hexdigest(),
        state_dir_override,
    )


def load_config_text(
    text: str,
    *,
    base_dir: Path,
    source_name: str = "<string>",
    state_dir_override: Path | None = None,
) -> OrganismConfig:
    """Like `load_config`, from text; relative paths resolve against `base_dir`."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return _load(
        text, Path(base_dir).expanduser().absolute(), source_name, None, digest, state_dir_override
    )


def check_config_main(path: str | Path) -> int:
    """`agentd check-config`: 0 and a summary on stdout, or 1 and every issue on stderr."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        for issue in exc.issues:
            print(issue, file=sys.stderr)
        return 1
    print(f"ok: {config.name}, {len(config.listeners)} listeners, {len(config.profiles)} profiles")
    return 0


# ------------------------------------------------------------------------ YAML plumbing

_TAG = "tag:yaml.org,2002:"
STR, INT, FLOAT, BOOL, NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
MAP, SEQ, TIMESTAMP, MERGE = (_TAG + t for t in ("map", "seq", "timestamp", "merge"))
# What the safe resolver gives plain scalars; `timestamp` passes here and is then
# refused by type where a string was expected (with a "quote it" hint).
_PLAIN_TAGS = frozenset({STR, INT, FLOAT, BOOL, NULL, MAP, SEQ, TIMESTAMP})
_KIND = {
    STR: "a string",
    INT: "an integer",
    FLOAT: "a number",
    BOOL: "a boolean",
    NULL: "null",
    MAP: "a mapping",
    SEQ: "a list",
    TIMESTAMP: "a date",
}
_CONSTRUCT = SafeConstructor()
MAX_DEPTH = 32  # a real organism.yaml nests about 5 levels


def _kind(node: yaml.Node) -> str:
    return _KIND.get(node.tag, f"a {node.tag} value")


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL


def _join(path: str, key: str) -> str:
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_\-]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


class _Bad(Enum):
    """Marks a value that failed its check (the issue is already recorded)."""

    BAD = 0


_BAD = _Bad.BAD


class _Mark(Protocol):
    line: int  # 0-based, like PyYAML's marks
    column: int


class _Context:
    """The state of one load: where we are reading from and what went wrong."""

    def __init__(self, source_name: str, base_dir: Path) -> None:
        self.source_name = source_name
        self.base_dir = base_dir
        self._issues: list[tuple[int, int, int, str]] = []

    def where(self, at: yaml.Node | _Mark) -> str:
        mark = at.start_mark if isinstance(at, yaml.Node) else at
        return f"{self.source_name}:{mark.line + 1}:{mark.column + 1}"

    def issue(self, at: yaml.Node | _Mark | None, path: str, message: str) -> None:
        """Record a problem at a node (its start) or mark; None: the top of the file."""
        mark = None if at is None else at.start_mark if isinstance(at, yaml.Node) else at
        line, col = (0, 0) if mark is None else (mark.line + 1, mark.column + 1)
        self._issues.append(
            (
                line,
                col,
                len(self._issues),
                f"{self.source_name}:{max(line, 1)}:{max(col, 1)}: {path or '(root)'}: {message}",
            )
        )

    @property
    def failed(self) -> bool:
        return bool(self._issues)

    def issues(self) -> list[str]:
        """All issues in file order (stable for issues at the same place)."""
        return [text for *_, text in sorted(self._issues)]

    def path(self, node: yaml.Node, path: str) -> Path | _Bad:
        """A path value: `~` expanded, relative to the configuration's folder."""
        text = string(self, node, path)
        if text is _BAD:
            return _BAD
        if "\0" in text:
            self.issue(node, path, "a path cannot contain a NUL character")
            return _BAD
        return self.base_dir / Path(text).expanduser()


Reader = Callable[[_Context, yaml.Node, str], T | _Bad]


def _mark(exc: yaml.MarkedYAMLError) -> Any:
    return exc.problem_mark or exc.context_mark


def _yaml_message(exc: yaml.MarkedYAMLError) -> str:
    return ", ".join(part for part in (exc.context, exc.problem) if part)


def _check_plain(ctx: _Context, text: str) -> yaml.Node | None:
    """Compose `text`, refusing anything that is not plain data."""
    depth = 0
    try:
        # Lazily: the depth limit must stop the scanner early, as PyYAML's cost per
        # token grows with the flow nesting depth and its composer recurses.
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                ctx.issue(event.start_mark, "", f"aliases (*{event.anchor}) are not allowed")
            elif isinstance(event, yaml.NodeEvent) and event.anchor is not None:
                ctx.issue(event.start_mark, "", f"anchors (&{event.anchor}) are not allowed")
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    ctx.issue(event.start_mark, "", f"nested more than {MAX_DEPTH} levels deep")
                    return None
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        ctx.issue(_mark(exc), "", f"invalid YAML: {_yaml_message(exc)}")
        return None
    except yaml.YAMLError as exc:
        ctx.issue(None, "", f"invalid YAML: {exc}")
        return None
    if ctx.failed:  # never walk a graph with aliases: it can be exponentially large
        return None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        ctx.issue(_mark(exc), "", f"invalid YAML: {_yaml_message(exc)}")
        return None
    if root is None:
        ctx.issue(None, "", "the configuration is empty")
        return None
    stack = [root]
    while stack:
        node = stack.pop()
        if node.tag == MERGE:
            ctx.issue(node, "", "merge keys (<<) are not allowed")
        elif node.tag not in _PLAIN_TAGS:
            ctx.issue(node, "", f"YAML tag {node.tag!r} is not allowed (plain data only)")
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.extend((key, value))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return None if ctx.failed else root


# ---------------------------------------------------------------------- value readers
# A reader checks one node and returns its value, or records an issue and returns _BAD.


def mapping(
    ctx: _Context, node: yaml.Node, path: str, known: Sequence[str] | None = None
) -> dict[str, yaml.Node] | _Bad:
    """Key -> value node; `known=None` accepts any string key. Null reads as {}."""
    if _is_null(node):
        return {}
    if not isinstance(node, yaml.MappingNode):
        ctx.issue(node, path, f"expected a mapping, got {_kind(node)}")
        return _BAD
    out: dict[str, yaml.Node] = {}
    key_nodes: dict[str, yaml.Node] = {}
    for key_node, value_node in node.value:
        if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == STR):
            ctx.issue(key_node, path, f"keys must be strings, got {_kind(key_node)}")
            continue
        key = key_node.value
        key_path = _join(path, key)
        if key in key_nodes:
            first = key_nodes[key].start_mark.line + 1
            ctx.issue(key_node, key_path, f"duplicate key (first given on line {first})")
            continue
        key_nodes[key] = key_node
        if known is not None and key not in known:
            ctx.issue(key_node, key_path, f"unknown key; expected one of: {', '.join(known)}")
            continue
        out[key] = value_node
    return out


def sequence(ctx: _Context, node: yaml.Node, path: str) -> list[yaml.Node] | _Bad:
    if _is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        ctx.issue(node, path, f"expected a list, got {_kind(node)}")
        return _BAD
    return list(node.value)


def string(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    """A non-empty string. A number or boolean is refused, not converted."""
    if not (isinstance(node, yaml.ScalarNode) and node.tag == STR):
        hint = " (quote it to make it a string)" if isinstance(node, yaml.ScalarNode) else ""
        ctx.issue(node, path, f"expected a string, got {_kind(node)}{hint}")
        return _BAD
    if not node.value.strip():
        ctx.issue(node, path, "must not be empty")
        return _BAD
    return cast(str, node.value)


def text(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    """A string that may be empty."""
    if _is_null(node):
        return ""
    if not (isinstance(node, yaml.ScalarNode) and node.tag == STR):
        ctx.issue(node, path, f"expected a string, got {_kind(node)}")
        return _BAD
    return cast(str, node.value)


def name(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    value = string(ctx, node, path)
    if value is not _BAD and not NAME_PATTERN.fullmatch(value):
        ctx.issue(
            node,
            path,
            f"invalid name {value!r}: use letters, digits, '_', '.', '-' "
            "(not first), at most 128 characters",
        )
        return _BAD
    return value


def boolean(ctx: _Context, node: yaml.Node, path: str) -> bool | _Bad:
    if not (isinstance(node, yaml.ScalarNode) and node.tag == BOOL):
        ctx.issue(node, path, f"expected true or false, got {_kind(node)}")
        return _BAD
    return cast(bool, _CONSTRUCT.construct_yaml_bool(node))


def integer(minimum: int | None = None, maximum: int | None = None) -> Reader[int]:
    def read(ctx: _Context, node: yaml.Node, path: str) -> int | _Bad:
        if not (isinstance(node, yaml.ScalarNode) and node.tag == INT):
            ctx.issue(node, path, f"expected an integer, got {_kind(node)}")
            return _BAD
        value = cast(int, _CONSTRUCT.construct_yaml_int(node))
        if not _in_range(ctx, node, path, value, minimum, maximum):
            return _BAD
        return value

    return read


def number(
    minimum: float | None = None, maximum: float | None = None, *, positive: bool = False
) -> Reader[float]:
    """An int or float, finite. `positive`: strictly greater than 0."""

    def read(ctx: _Context, node: yaml.Node, path: str) -> float | _Bad:
        if not (isinstance(node, yaml.ScalarNode) and node.tag in (INT, FLOAT)):
            ctx.issue(node, path, f"expected a number, got {_kind(node)}")
            return _BAD
        value = float(_CONSTRUCT.construct_object(node))
        if value != value or value in (float("inf"), float("-inf")):
            ctx.issue(node, path, "must be a finite number")
            return _BAD
        if positive and value <= 0:
            ctx.issue(node, path, "must be greater than 0")
            return _BAD
        if not _in_range(ctx, node, path, value, minimum, maximum):
            return _BAD
        return value

    return read


def _in_range(
    ctx: _Context, node: yaml.Node, path: str, value: float, lo: float | None, hi: float | None
) -> bool:
    if lo is not None and hi is not None and not lo <= value <= hi:
        ctx.issue(node, path, f"must be between {lo} and {hi}")
        return False
    if lo is not None and value < lo:
        ctx.issue(node, path, f"must be at least {lo}")
        return False
    if hi is not None and value > hi:
        ctx.issue(node, path, f"must be at most {hi}")
        return False
    return True


def choice(*choices: str) -> Reader[str]:
    def read(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
        value = string(ctx, node, path)
        if value is not _BAD and value not in choices:
            ctx.issue(node, path, f"expected one of {', '.join(choices)}; got {value!r}")
            return _BAD
        return value

    return read


def path_value(ctx: _Context, node: yaml.Node, path: str) -> Path | _Bad:
    return ctx.path(node, path)


def host_port(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    value = string(ctx, node, path)
    if value is _BAD:
        return _BAD
    if _split_host_port(value) is None:
        ctx.issue(
            node, path, f"expected host:port (e.g. 127.0.0.1:9464 or [::1]:9464), got {value!r}"
        )
        return _BAD
    return value


def _split_host_port(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or not re.fullmatch(r"[0-9A-Fa-f:.]+", host):
            return None
    elif not re.fullmatch(r"[A-Za-z0-9_.\-]+", host):
        return None
    return host, int(port)


def get(
    ctx: _Context,
    entries: dict[str, yaml.Node],
    key: str,
    path: str,
    read: Callable[[_Context, yaml.Node, str], T | _Bad],
    default: D,
) -> T | D:
    """An optional key. An explicit null is allowed where the default is None."""
    node = entries.get(key)
    if node is None or (default is None and _is_null(node)):
        return default
    value = read(ctx, node, _join(path, key))
    return default if value is _BAD else value


def need(
    ctx: _Context,
    entries: dict[str, yaml.Node],
    key: str,
    path: str,
    read: Callable[[_Context, yaml.Node, str], T | _Bad],
    at: yaml.Node,
) -> T | _Bad:
    """A required key; its absence is reported at the enclosing mapping `at`."""
    node = entries.get(key)
    if node is None:
        ctx.issue(at, _join(path, key), "required key is missing")
        return _BAD
    return read(ctx, node, _join(path, key))


def _section(
    ctx: _Context, root: dict[str, yaml.Node], key: str, known: Sequence[str] | None
) -> dict[str, yaml.Node]:
    """A top-level section's entries ({} when absent or broken)."""
    node = root.get(key)
    entries = {} if node is None else mapping(ctx, node, key, known)
    return {} if entries is _BAD else entries


# ------------------------------------------------------------------------ the sections

_TOP_KEYS = (
    "organism",
    "state_dir",
    "python_path",
    "bus",
    "auth",
    "oob",
    "metrics",
    "pump",
    "journal",
    "profiles",
    "prompts",
    "llm",
    "listeners",
    "meta",
)
_POSITIVE = integer(1)
_NON_NEGATIVE = integer(0)
_PORT = integer(0, 65535)
_SECONDS = number(positive=True)


def _load(
    text_: str,
    base_dir: Path,
    source_name: str,
    source: Path | None,
    digest: str,
    state_dir_override: Path | None,
) -> OrganismConfig:
    ctx = _Context(source_name, base_dir)
    root_node = _check_plain(ctx, text_)
    if root_node is None:
        raise ConfigError(ctx.issues())
    root = mapping(ctx, root_node, "", _TOP_KEYS)
    if root is _BAD:
        raise ConfigError(ctx.issues())
    config = _Organism(ctx, root, root_node, source, digest, state_dir_override).build()
    if ctx.failed or config is None:
        raise ConfigError(ctx.issues())
    return config


@dataclass
class _ListenerDraft:
    """A listener read from YAML, with the nodes the cross-checks point at."""

    index: int
    node: yaml.Node
    name: str | None
    name_node: yaml.Node | None
    payload: list[tuple[str, type, yaml.Node]]  # (ref, class, node)
    response: list[tuple[str, type, yaml.Node]]
    handler_ref: str
    handler: Callable[..., Any] | None
    agent: AgentConfig | None
    agent_nodes: dict[str, yaml.Node]
    description: str
    peers: list[tuple[str, yaml.Node, str]]  # (name, node, key path)
    max_concurrency: int | None
    timeout_s: float | None

    @property
    def path(self) -> str:
        return f"listeners[{self.index}]"


class _Organism:
    """Reads the sections in dependency order, then checks the cross-references."""

    def __init__(
        self,
        ctx: _Context,
        root: dict[str, yaml.Node],
        root_node: yaml.Node,
        source: Path | None,
        digest: str,
        state_dir_override: Path | None,
    ) -> None:
        self.ctx = ctx
        self.root = root
        self.root_node = root_node
        self.source = source
        self.digest = digest
        self.state_dir_override = state_dir_override
        self.declared_prompts: set[str] = set()  # including those that failed to load

    def build(self) -> OrganismConfig | None:
        ctx = self.ctx
        name_ = self._organism()
        state_dir = self._state_dir()
        python_path = self._python_path()
        bus = self._bus()
        auth = self._auth()
        oob = self._oob(state_dir)
        metrics = self._metrics()
        pump = self._pump()
        journal = self._journal()
        meta = self._meta()
        prompts = self._prompts()
        llm = self._llm()
        drafts = self._listeners()
        profiles = self._profiles()
        self._check_references(drafts, profiles, prompts, llm)
        if ctx.failed or name_ is _BAD:
            return None
        listeners = tuple(self._finish(d) for d in drafts)
        return OrganismConfig(
            name=name_,
            source=self.source,
            base_dir=ctx.base_dir,
            state_dir=state_dir,
            bus=bus,
            auth=auth,
            oob=oob,
            metrics=metrics,
            pump=pump,
            journal=journal,
            profiles=FrozenMapping({p.name: p for p, _ in profiles}),
            prompts=FrozenMapping(prompts),
            llm=llm,
            listeners=listeners,
            meta=meta,
            digest=self.digest,
            python_path=python_path,
        )

    # -- small sections

    def _organism(self) -> str | _Bad:
        node = self.root.get("organism")
        if node is None:
            self.ctx.issue(self.root_node, "organism.name", "required key is missing")
            return _BAD
        entries = mapping(self.ctx, node, "organism", ("name",))
        if entries is _BAD:
            return _BAD
        return need(self.ctx, entries, "name", "organism", name, node)

    def _state_dir(self) -> Path:
        if self.state_dir_override is not None:
            return Path(self.state_dir_override).expanduser().absolute()
        node = self.root.get("state_dir")
        value = _BAD if node is None else self.ctx.path(node, "state_dir")
        return self.ctx.base_dir / "state" if value is _BAD else value

    def _python_path(self) -> tuple[Path, ...]:
        """Folders prepended to `sys.path` before the listeners' modules are imported."""
        node = self.root.get("python_path")
        if node is None:
            return ()
        items = sequence(self.ctx, node, "python_path")
        if items is _BAD:
            return ()
        folders: list[Path] = []
        for i, item in enumerate(items):
            folder = self.ctx.path(item, f"python_path[{i}]")
            if folder is _BAD:
                continue
            if not folder.is_dir():
                self.ctx.issue(item, f"python_path[{i}]", f"not a folder: {folder}")
                continue
            folders.append(folder)
        for folder in reversed(folders):
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
        return tuple(folders)

    def _bus(self) -> BusConfig:
        ctx, p = self.ctx, "bus"
        keys = (
            "host",
            "port",
            "tls",
            "max_envelope_bytes",
            "max_inflight",
            "max_connections",
            "rate_per_s",
            "rate_burst",
            "auth_timeout_s",
            "compression",
        )
        e = _section(ctx, self.root, p, keys)
        d = BusConfig()
        return BusConfig(
            host=get(ctx, e, "host", p, string, d.host),
            port=get(ctx, e, "port", p, _PORT, d.port),
            tls=get(ctx, e, "tls", p, self._tls, None),
            max_envelope_bytes=get(
                ctx, e, "max_envelope_bytes", p, integer(256), d.max_envelope_bytes
            ),
            max_inflight=get(ctx, e, "max_inflight", p, _POSITIVE, d.max_inflight),
            max_connections=get(ctx, e, "max_connections", p, _POSITIVE, d.max_connections),
            rate_per_s=get(ctx, e, "rate_per_s", p, number(positive=True), d.rate_per_s),
            rate_burst=get(ctx, e, "rate_burst", p, _POSITIVE, d.rate_burst),
            auth_timeout_s=get(ctx, e, "auth_timeout_s", p, _SECONDS, d.auth_timeout_s),
            compression=get(ctx, e, "compression", p, boolean, d.compression),
        )

    @staticmethod
    def _tls(ctx: _Context, node: yaml.Node, path: str) -> TlsConfig | _Bad:
        e = mapping(ctx, node, path, ("cert", "key"))
        if e is _BAD:
            return _BAD
        cert = need(ctx, e, "cert", path, path_value, node)
        key = need(ctx, e, "key", path, path_value, node)
        if cert is _BAD or key is _BAD:
            return _BAD
        return TlsConfig(cert, key)

    def _auth(self) -> AuthConfig:
        ctx, p = self.ctx, "auth"
        keys = ("clients_file", "session_ttl_s", "max_failures", "failure_window_s", "lockout_s")
        e = _section(ctx, self.root, p, keys)
        d = AuthConfig()
        return AuthConfig(
            clients_file=get(ctx, e, "clients_file", p, path_value, None),
            session_ttl_s=get(ctx, e, "session_ttl_s", p, _SECONDS, d.session_ttl_s),
            max_failures=get(ctx, e, "max_failures", p, _POSITIVE, d.max_failures),
            failure_window_s=get(ctx, e, "failure_window_s", p, _SECONDS, d.failure_window_s),
            lockout_s=get(ctx, e, "lockout_s", p, _SECONDS, d.lockout_s),
        )

    def _oob(self, state_dir: Path) -> OobConfig:
        ctx, p = self.ctx, "oob"
        keys = ("authorized_keys", "socket", "allowed_uids", "max_frame_bytes", "clock_skew_s")
        e = _section(ctx, self.root, p, keys)
        d = OobConfig()
        uids: list[int] = []
        node = e.get("allowed_uids")
        items = [] if node is None else sequence(ctx, node, "oob.allowed_uids")
        for i, item in enumerate([] if items is _BAD else items):
            uid = _NON_NEGATIVE(ctx, item, f"oob.allowed_uids[{i}]")
            if uid is not _BAD:
                uids.append(uid)
        return OobConfig(
            authorized_keys=get(ctx, e, "authorized_keys", p, path_value, None),
            socket=get(ctx, e, "socket", p, path_value, None) or state_dir / "oob.sock",
            allowed_uids=tuple(uids),
            max_frame_bytes=get(ctx, e, "max_frame_bytes", p, integer(1024), d.max_frame_bytes),
            clock_skew_s=get(ctx, e, "clock_skew_s", p, _SECONDS, d.clock_skew_s),
        )

    def _metrics(self) -> MetricsConfig:
        e = _section(self.ctx, self.root, "metrics", ("listen",))
        return MetricsConfig(listen=get(self.ctx, e, "listen", "metrics", host_port, None))

    def _pump(self) -> PumpConfig:
        ctx, p = self.ctx, "pump"
        keys = (
            "max_concurrency",
            "per_listener_concurrency",
            "handler_timeout_s",
            "max_hops",
            "max_queue",
            "max_fanout",
            "thread_idle_s",
        )
        e = _section(ctx, self.root, p, keys)
        d = PumpConfig()
        return PumpConfig(
            max_concurrency=get(ctx, e, "max_concurrency", p, _POSITIVE, d.max_concurrency),
            per_listener_concurrency=get(
                ctx, e, "per_listener_concurrency", p, _POSITIVE, d.per_listener_concurrency
            ),
            handler_timeout_s=get(ctx, e, "handler_timeout_s", p, _SECONDS, d.handler_timeout_s),
            max_hops=get(ctx, e, "max_hops", p, _POSITIVE, d.max_hops),
            max_queue=get(ctx, e, "max_queue", p, _POSITIVE, d.max_queue),
            max_fanout=get(ctx, e, "max_fanout", p, _POSITIVE, d.max_fanout),
            thread_idle_s=get(ctx, e, "thread_idle_s", p, _SECONDS, d.thread_idle_s),
        )

    def _journal(self) -> JournalConfig:
        ctx, p = self.ctx, "journal"
        keys = (
            "retention",
            "synchronous",
            "commit_interval_ms",
            "commit_max_entries",
            "sweep_interval_s",
            "max_outbox_per_client",
        )
        e = _section(ctx, self.root, p, keys)
        d = JournalConfig()
        return JournalConfig(
            retention=get(ctx, e, "retention", p, retention, d.retention),
            synchronous=cast(
                Synchronous, get(ctx, e, "synchronous", p, choice("NORMAL", "FULL"), d.synchronous)
            ),
            commit_interval_ms=get(
                ctx, e, "commit_interval_ms", p, number(0), d.commit_interval_ms
            ),
            commit_max_entries=get(
                ctx, e, "commit_max_entries", p, _POSITIVE, d.commit_max_entries
            ),
            sweep_interval_s=get(ctx, e, "sweep_interval_s", p, _SECONDS, d.sweep_interval_s),
            max_outbox_per_client=get(
                ctx, e, "max_outbox_per_client", p, _POSITIVE, d.max_outbox_per_client
            ),
        )

    def _meta(self) -> MetaConfig:
        ctx, p = self.ctx, "meta"
        keys = ("allow_list_capabilities", "allow_schema_requests", "allow_example_requests")
        e = _section(ctx, self.root, p, keys)
        return MetaConfig(
            allow_list_capabilities=get(ctx, e, "allow_list_capabilities", p, boolean, False),
            allow_schema_requests=get(ctx, e, "allow_schema_requests", p, boolean, False),
            allow_example_requests=get(ctx, e, "allow_example_requests", p, boolean, False),
        )

    # -- prompts and LLM

    def _prompts(self) -> dict[str, str]:
        """name -> text; a `file:PATH` value is replaced by the file's content."""
        ctx = self.ctx
        e = _section(ctx, self.root, "prompts", None)
        prompts: dict[str, str] = {}
        self.declared_prompts = set(e)
        for key, node in e.items():
            path = _join("prompts", key)
            if not NAME_PATTERN.fullmatch(key):
                ctx.issue(
                    node, path, f"invalid prompt name {key!r}: use letters, digits, '_', '.', '-'"
                )
                continue
            value = string(ctx, node, path)
            if value is _BAD:
                continue
            if value.startswith("file:"):
                content = self._read_prompt_file(node, path, value[len("file:") :].strip())
                if content is _BAD:
                    continue
                value = content
            prompts[key] = value
        return prompts

    def _read_prompt_file(self, node: yaml.Node, path: str, relative: str) -> str | _Bad:
        if not relative:
            self.ctx.issue(node, path, "file: needs a path")
            return _BAD
        file = self.ctx.base_dir / Path(relative).expanduser()
        try:
            return file.read_text(encoding="utf-8")
        except FileNotFoundError:
            self.ctx.issue(node, path, f"prompt file not found: {file}")
        except UnicodeDecodeError:
            self.ctx.issue(node, path, f"prompt file is not UTF-8 text: {file}")
        except OSError as exc:
            self.ctx.issue(node, path, f"cannot read prompt file {file}: {exc.strerror or exc}")
        return _BAD

    def _llm(self) -> LlmConfig | None:
        ctx = self.ctx
        node = self.root.get("llm")
        if node is None or _is_null(node):
            return None
        e = mapping(ctx, node, "llm", ("strategy", "backends", "retries", "cache_ttl_s"))
        if e is _BAD:
            return None
        backends: list[LlmBackendConfig] = []
        seen: dict[str, yaml.Node] = {}
        items = need(ctx, e, "backends", "llm", sequence, node)
        if items is not _BAD and not items:
            ctx.issue(e["backends"], "llm.backends", "at least one backend is required")
        for i, item in enumerate([] if items is _BAD else items):
            backend = self._backend(item, f"llm.backends[{i}]")
            if backend is _BAD:
                continue
            if backend.name in seen:
                ctx.issue(
                    item, f"llm.backends[{i}].name", f"duplicate backend name {backend.name!r}"
                )
                continue
            seen[backend.name] = item
            backends.append(backend)
        d = LlmConfig()
        return LlmConfig(
            strategy=cast(
                Strategy,
                get(ctx, e, "strategy", "llm", choice("failover", "round-robin"), d.strategy),
            ),
            backends=tuple(backends),
            retries=get(ctx, e, "retries", "llm", _NON_NEGATIVE, d.retries),
            cache_ttl_s=get(ctx, e, "cache_ttl_s", "llm", number(0), d.cache_ttl_s),
        )

    def _backend(self, node: yaml.Node, p: str) -> LlmBackendConfig | _Bad:
        ctx = self.ctx
        keys = (
            "name",
            "provider",
            "base_url",
            "model",
            "api_key_env",
            "cassette",
            "record",
            "max_concurrency",
            "requests_per_minute",
            "tokens_per_minute",
            "timeout_s",
        )
        e = mapping(ctx, node, p, keys)
        if e is _BAD:
            return _BAD
        name_ = need(ctx, e, "name", p, name, node)
        provider = need(ctx, e, "provider", p, choice("openai", "anthropic", "replay"), node)
        base_url = get(ctx, e, "base_url", p, _url, None)
        model = get(ctx, e, "model", p, string, None)
        cassette = get(ctx, e, "cassette", p, path_value, None)
        record = get(ctx, e, "record", p, path_value, None)
        if provider == "replay":
            if cassette is None and "cassette" not in e:
                ctx.issue(node, _join(p, "cassette"), "required for provider replay")
            if "record" in e:
                ctx.issue(e["record"], _join(p, "record"), "a replay backend cannot record")
        elif provider is not _BAD:
            if model is None and "model" not in e:
                ctx.issue(node, _join(p, "model"), f"required for provider {provider}")
            if "cassette" in e:
                ctx.issue(e["cassette"], _join(p, "cassette"), "only for provider replay")
        d = LlmBackendConfig("", "replay")
        result = LlmBackendConfig(
            name="" if name_ is _BAD else name_,
            provider=cast(Provider, "replay" if provider is _BAD else provider),
            base_url=base_url,
            model=model,
            api_key_env=get(ctx, e, "api_key_env", p, _env_name, None),
            cassette=cassette,
            record=record,
            max_concurrency=get(ctx, e, "max_concurrency", p, _POSITIVE, d.max_concurrency),
            requests_per_minute=get(ctx, e, "requests_per_minute", p, _POSITIVE, None),
            tokens_per_minute=get(ctx, e, "tokens_per_minute", p, _POSITIVE, None),
            timeout_s=get(ctx, e, "timeout_s", p, _SECONDS, d.timeout_s),
        )
        return _BAD if name_ is _BAD or provider is _BAD else result

    # -- listeners

    def _listeners(self) -> list[_ListenerDraft]:
        node = self.root.get("listeners")
        if node is None:
            return []
        items = sequence(self.ctx, node, "listeners")
        if items is _BAD:
            return []
        return [d for i, item in enumerate(items) if (d := self._listener(i, item)) is not None]

    def _listener(self, index: int, node: yaml.Node) -> _ListenerDraft | None:
        ctx, p = self.ctx, f"listeners[{index}]"
        keys = (
            "name",
            "payload_class",
            "response_class",
            "handler",
            "agent",
            "description",
            "peers",
            "max_concurrency",
            "timeout_s",
        )
        e = mapping(ctx, node, p, keys)
        if e is _BAD:
            return None
        name_ = need(ctx, e, "name", p, name, node)
        if name_ in RESERVED_LISTENER_NAMES:
            ctx.issue(e["name"], _join(p, "name"), f"{name_!r} is reserved for the platform")
            name_ = _BAD
        payload = self._classes(e, "payload_class", p, node, required=True)
        response = self._classes(e, "response_class", p, node, required=False)
        handler_ref, handler = "", None
        agent: AgentConfig | None = None
        agent_nodes: dict[str, yaml.Node] = {}
        if "handler" in e:
            handler_ref, handler = self._handler(e["handler"], _join(p, "handler"))
        if "agent" in e:
            agent, agent_nodes = self._agent(e["agent"], _join(p, "agent"))
        if "handler" in e and "agent" in e:
            ctx.issue(
                e["agent"], _join(p, "agent"), "a listener has a handler or an agent, not both"
            )
            agent = None  # checked as a handler listener from here on
        elif "agent" in e and "response_class" in e:
            ctx.issue(
                e["response_class"],
                _join(p, "response_class"),
                "an agent answers with core `answer`; response_class is for handlers",
            )
        elif "handler" not in e and "agent" not in e:
            ctx.issue(node, p, "a listener needs a `handler` or an `agent`")
        description = get(ctx, e, "description", p, text, None)
        if description is None:
            if "agent" not in e:
                ctx.issue(node, _join(p, "description"), "required key is missing")
            description = _xmlify().spec_of(payload[0][1]).description if payload else ""
        peers: list[tuple[str, yaml.Node, str]] = []
        for i, item in enumerate(get(ctx, e, "peers", p, sequence, [])):
            peer_path = f"{p}.peers[{i}]"
            peer = name(ctx, item, peer_path)
            if peer is _BAD:
                continue
            if any(peer == seen for seen, _, _ in peers):
                ctx.issue(item, peer_path, f"{peer!r} is listed twice")
                continue
            peers.append((peer, item, peer_path))
        return _ListenerDraft(
            index=index,
            node=node,
            name=None if name_ is _BAD else name_,
            name_node=e.get("name"),
            payload=payload,
            response=response,
            handler_ref=handler_ref,
            handler=handler,
            agent=agent,
            agent_nodes=agent_nodes,
            description=description,
            peers=peers,
            max_concurrency=get(ctx, e, "max_concurrency", p, _POSITIVE, None),
            timeout_s=get(ctx, e, "timeout_s", p, _SECONDS, None),
        )

    def _classes(
        self, e: dict[str, yaml.Node], key: str, p: str, at: yaml.Node, *, required: bool
    ) -> list[tuple[str, type, yaml.Node]]:
        """`payload_class` / `response_class`: one `module:Class` or a list of them."""
        ctx, path = self.ctx, _join(p, key)
        node = e.get(key)
        if node is None:
            if required:
                ctx.issue(at, path, "required key is missing")
            return []
        if isinstance(node, yaml.SequenceNode):
            items = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
            if not items:
                ctx.issue(node, path, "the list is empty")
        else:
            items = [(node, path)]
        out: list[tuple[str, type, yaml.Node]] = []
        for item, item_path in items:
            ref = string(ctx, item, item_path)
            if ref is _BAD:
                continue
            obj = _import(ctx, item, item_path, ref)
            if obj is _BAD:
                continue
            if not (inspect.isclass(obj) and _xmlify().is_xmlified(obj)):
                ctx.issue(item, item_path, f"{ref} is not an @xmlify dataclass")
                continue
            if any(cls is obj for _, cls, _ in out):
                ctx.issue(item, item_path, f"{ref} is listed twice")
                continue
            out.append((ref, obj, item))
        return out

    def _handler(self, node: yaml.Node, path: str) -> tuple[str, Callable[..., Any] | None]:
        ctx = self.ctx
        ref = string(ctx, node, path)
        if ref is _BAD:
            return "", None
        obj = _import(ctx, node, path, ref)
        if obj is _BAD:
            return ref, None
        if not callable(obj):
            ctx.issue(node, path, f"{ref} is not callable")
            return ref, None
        if not _is_async(obj):
            ctx.issue(node, path, f"{ref} must be an `async def` function (it is synchronous)")
            return ref, None
        return ref, obj

    def _agent(self, node: yaml.Node, p: str) -> tuple[AgentConfig | None, dict[str, yaml.Node]]:
        ctx = self.ctx
        keys = ("prompt", "model", "max_iterations", "max_tokens", "token_budget", "temperature")
        e = mapping(ctx, node, p, keys)
        if e is _BAD:
            return None, {}
        prompt = need(ctx, e, "prompt", p, string, node)
        model = need(ctx, e, "model", p, name, node)
        d = AgentConfig("", "")
        max_iterations = get(ctx, e, "max_iterations", p, _POSITIVE, d.max_iterations)
        max_tokens = get(ctx, e, "max_tokens", p, _POSITIVE, d.max_tokens)
        token_budget = get(ctx, e, "token_budget", p, _POSITIVE, None)
        temperature = get(ctx, e, "temperature", p, number(0.0, 2.0), None)
        if prompt is _BAD or model is _BAD:
            return None, e
        agent = AgentConfig(prompt, model, max_iterations, max_tokens, token_budget, temperature)
        return agent, e

    def _profiles(self) -> list[tuple[ProfileConfig, dict[str, tuple[yaml.Node, str]]]]:
        """Profiles with the node of each listed name (for the cross-check)."""
        ctx = self.ctx
        e = _section(ctx, self.root, "profiles", None)
        out: list[tuple[ProfileConfig, dict[str, tuple[yaml.Node, str]]]] = []
        keys = ("listeners", "retention", "synchronous", "token_budget")
        for key, node in e.items():
            p = _join("profiles", key)
            if not NAME_PATTERN.fullmatch(key):
                ctx.issue(
                    node, p, f"invalid profile name {key!r}: use letters, digits, '_', '.', '-'"
                )
                continue
            entries = mapping(ctx, node, p, keys)
            if entries is _BAD:
                continue
            members = need(ctx, entries, "listeners", p, _members, node)
            profile = ProfileConfig(
                name=key,
                listeners="all" if members is _BAD else members[0],
                retention=get(ctx, entries, "retention", p, retention, None),
                synchronous=cast(
                    "Synchronous | None",
                    get(ctx, entries, "synchronous", p, choice("NORMAL", "FULL"), None),
                ),
                token_budget=get(ctx, entries, "token_budget", p, _POSITIVE, None),
            )
            out.append((profile, {} if members is _BAD else members[1]))
        return out

    # -- cross-references

    def _check_references(
        self,
        drafts: list[_ListenerDraft],
        profiles: list[tuple[ProfileConfig, dict[str, tuple[yaml.Node, str]]]],
        prompts: dict[str, str],
        llm: LlmConfig | None,
    ) -> None:
        ctx = self.ctx
        names: dict[str, _ListenerDraft] = {}
        for d in drafts:
            if d.name is None or d.name_node is None:
                continue
            if d.name in names:
                first = names[d.name]
                ctx.issue(
                    d.name_node,
                    _join(d.path, "name"),
                    f"duplicate listener name {d.name!r} (also {first.path}, line "
                    f"{first.node.start_mark.line + 1})",
                )
                continue
            names[d.name] = d
        backends = {b.name for b in llm.backends} if llm is not None else set()
        for d in drafts:
            for peer, node, path in d.peers:
                if peer not in names:
                    ctx.issue(node, path, f"no listener is named {peer!r}")
            if d.agent is None:
                continue
            model_node = d.agent_nodes.get("model", d.node)
            if llm is None:
                ctx.issue(model_node, f"{d.path}.agent.model", "an agent needs an `llm` section")
            elif d.agent.model not in backends:
                ctx.issue(
                    model_node,
                    f"{d.path}.agent.model",
                    f"no backend named {d.agent.model!r} in llm.backends",
                )
            prompt_node = d.agent_nodes.get("prompt", d.node)
            for part in d.agent.prompt_names:
                if not part:
                    ctx.issue(prompt_node, f"{d.path}.agent.prompt", "empty prompt name around '&'")
                elif part not in self.declared_prompts:
                    ctx.issue(
                        prompt_node,
                        f"{d.path}.agent.prompt",
                        f"no prompt named {part!r} in prompts",
                    )
        for _, members in profiles:
            for member, (node, path) in members.items():
                if member not in names:
                    ctx.issue(node, path, f"no listener is named {member!r}")
        self._check_payload_keys(drafts)

    def _check_payload_keys(self, drafts: list[_ListenerDraft]) -> None:
        """Routing keys: one class per (namespace, tag); an agent alone on its own.
        (`@xmlify` itself refuses the platform's namespaces.)"""
        ctx = self.ctx
        xmlify = _xmlify()
        users: dict[tuple[str, str], list[tuple[_ListenerDraft, type, yaml.Node]]] = {}
        for d in drafts:
            for i, (ref, cls, node) in enumerate(d.payload):
                path = _join(d.path, "payload_class") + (f"[{i}]" if len(d.payload) > 1 else "")
                spec = xmlify.spec_of(cls)
                for other, other_cls, _ in users.get(spec.key, []):
                    if other_cls is not cls:
                        ctx.issue(
                            node,
                            path,
                            f"{ref} has the same root {spec.clark} as a different class in "
                            f"{other.path} ({other_cls.__module__}:{other_cls.__qualname__})",
                        )
                users.setdefault(spec.key, []).append((d, cls, node))
        for uses in users.values():
            for d, cls, node in uses:
                others = sorted({_label(o) for o, _, _ in uses if o is not d})
                if d.agent is None or not others:
                    continue
                ctx.issue(
                    node,
                    _join(d.path, "payload_class"),
                    f"an LLM agent needs a payload root of its own; {xmlify.spec_of(cls).clark} "
                    f"is also the payload of {', '.join(others)}",
                )

    def _finish(self, d: _ListenerDraft) -> ListenerConfig:
        return ListenerConfig(
            name=cast(str, d.name),
            payload_classes=tuple(cls for _, cls, _ in d.payload),
            response_classes=tuple(cls for _, cls, _ in d.response),
            handler=d.handler,
            agent=d.agent,
            description=d.description,
            peers=tuple(peer for peer, _, _ in d.peers),
            max_concurrency=d.max_concurrency,
            timeout_s=d.timeout_s,
            location=self.ctx.where(d.node),
            handler_ref=d.handler_ref,
            payload_refs=tuple(ref for ref, _, _ in d.payload),
            response_refs=tuple(ref for ref, _, _ in d.response),
        )


# ------------------------------------------------------------------------- small parts


def retention(ctx: _Context, node: yaml.Node, path: str) -> RetentionPolicy | _Bad:
    """`retain_forever`, `prune_on_delivery` or `{retain_days: N}`."""
    if isinstance(node, yaml.MappingNode):
        e = mapping(ctx, node, path, ("retain_days",))
        if e is _BAD:
            return _BAD
        days = need(ctx, e, "retain_days", path, _POSITIVE, node)
        return _BAD if days is _BAD else RetentionPolicy("retain_days", days)
    value = string(ctx, node, path)
    if value is _BAD:
        return _BAD
    if value in ("retain_forever", "prune_on_delivery"):
        return RetentionPolicy(cast(RetentionKind, value))
    ctx.issue(
        node,
        path,
        f"expected retain_forever, prune_on_delivery or {{retain_days: N}}; got {value!r}",
    )
    return _BAD


def _members(
    ctx: _Context, node: yaml.Node, path: str
) -> tuple[tuple[str, ...] | Literal["all"], dict[str, tuple[yaml.Node, str]]] | _Bad:
    """A profile's `listeners`: `all` or a list of names (each with its node and path)."""
    if isinstance(node, yaml.ScalarNode) and node.tag == STR:
        if node.value == "all":
            return "all", {}
        ctx.issue(node, path, f"expected `all` or a list of listener names; got {node.value!r}")
        return _BAD
    items = sequence(ctx, node, path)
    if items is _BAD:
        return _BAD
    members: dict[str, tuple[yaml.Node, str]] = {}
    for i, item in enumerate(items):
        member_path = f"{path}[{i}]"
        member = name(ctx, item, member_path)
        if member is _BAD:
            continue
        if member in members:
            ctx.issue(item, member_path, f"{member!r} is listed twice")
            continue
        members[member] = (item, member_path)
    return tuple(members), members


def _url(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    value = string(ctx, node, path)
    if value is not _BAD and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
        ctx.issue(node, path, f"expected an http:// or https:// URL, got {value!r}")
        return _BAD
    return value


def _env_name(ctx: _Context, node: yaml.Node, path: str) -> str | _Bad:
    value = string(ctx, node, path)
    if value is not _BAD and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        ctx.issue(node, path, f"not an environment variable name: {value!r}")
        return _BAD
    return value


_REF = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)


def _import(ctx: _Context, node: yaml.Node, path: str, ref: str) -> object | _Bad:
    """Resolve `module:attribute` (the attribute may be dotted)."""
    match = _REF.fullmatch(ref.strip())
    if match is None:
        ctx.issue(node, path, f"expected module:attribute, got {ref!r}")
        return _BAD
    module_name, attr = match["module"], match["attr"]
    try:
        obj: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        ):
            ctx.issue(node, path, f"no module named {exc.name!r}")
        else:
            ctx.issue(node, path, f"importing {module_name!r} failed: {exc}")
        return _BAD
    except Exception as exc:  # the module's own code raised: still a config problem
        ctx.issue(node, path, f"importing {module_name!r} failed: {type(exc).__name__}: {exc}")
        return _BAD
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            ctx.issue(node, path, f"{module_name!r} has no attribute {attr!r}")
            return _BAD
    return obj


def _is_async(obj: object) -> bool:
    if inspect.iscoroutinefunction(obj):
        return True
    call = getattr(obj, "__call__", None)  # noqa: B004 - an instance with async __call__
    return (
        not inspect.isroutine(obj)
        and not inspect.isclass(obj)
        and inspect.iscoroutinefunction(call)
    )


def _label(d: _ListenerDraft) -> str:
    return d.path if d.name is None else repr(d.name)


def _xmlify() -> Any:
    # Imported late: the configuration must stay importable on its own.
    from agentd import _xmlify as module

    return module
