"""The sections of `organism.yaml`: one frozen pydantic dataclass each, every key
declared once with its default and constraints.

A section is what the rest of agentd reads (plain dataclass attributes, no
validation on access). Rules that span keys are the section's wrap validator,
which reports them together with pydantic's own errors; rules that span sections
belong to `OrganismDocument`. A new section is one more class here and one more
field of `OrganismDocument`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
)
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from agentd.config.embeddings import EmbeddingsConfig
from agentd.config.references import cross_references
from agentd.config.routing import ProfileRoutingConfig, RoutingConfig
from agentd.config.tools import ToolConfig
from agentd.config.values import (
    AnyText,
    Bool,
    ClassRefs,
    EnvName,
    FilePath,
    Folder,
    HandlerRef,
    HostPort,
    Members,
    Name,
    Names,
    NonNegative,
    NonNegativeNumber,
    PerSecond,
    Port,
    Positive,
    Problem,
    ProfileName,
    Prompt,
    PromptName,
    RetentionValue,
    Seconds,
    Synchronous,
    Text,
    Url,
    WssUrl,
    rules,
    split_host_port,
    unknown_user,
)
from agentd.kernel import DEFAULT_KERNEL_OPTIONS, RETAIN_FOREVER

SECTION = ConfigDict(extra="forbid")

Provider = Literal["openai", "anthropic", "replay"]
Strategy = Literal["failover", "round-robin"]
# `core` is the platform's own sender name (`<from>core</from>`); a listener with
# that name would make the platform's messages forgeable.
RESERVED_LISTENER_NAMES = frozenset({"core"})


# ------------------------------------------------------------- rules across keys
# Pure: the raw mapping of one section in, the problems out.


def _provider_rules(data: dict[str, Any]) -> list[Problem]:
    provider, problems = data.get("provider"), []
    if provider == "replay":
        if "cassette" not in data:
            problems.append(Problem(("cassette",), "required for provider replay", data))
        if "record" in data:
            problems.append(Problem(("record",), "a replay backend cannot record", data))
    elif provider in ("openai", "anthropic"):
        if "model" not in data:
            problems.append(Problem(("model",), f"required for provider {provider}", data))
        if "cassette" in data:
            problems.append(Problem(("cassette",), "only for provider replay", data))
    return problems


def _backend_rules(data: dict[str, Any]) -> list[Problem]:
    backends, problems = data.get("backends"), []
    if "backends" not in data:
        problems.append(Problem(("backends",), "missing", data))
    elif backends == ():
        problems.append(Problem(("backends",), "at least one backend is required", backends))
    seen: set[str] = set()
    for i, backend in enumerate(backends if isinstance(backends, tuple) else ()):
        name = backend.get("name") if isinstance(backend, dict) else None
        if isinstance(name, str) and name in seen:
            message = f"duplicate backend name {name!r}"
            problems.append(Problem(("backends", i, "name"), message, name, at_entry=True))
        elif isinstance(name, str):
            seen.add(name)
    return problems


def _name_is_the_key(data: dict[str, Any]) -> list[Problem]:
    """A profile is named by its key; `name` is not a key one writes."""
    return [Problem(("name",), "extra_forbidden", data["name"])] if "name" in data else []


def _kind_rules(data: dict[str, Any]) -> list[Problem]:
    """A listener has exactly one of a handler, an agent or a tool; a handler needs a
    description and a payload class; a tool's classes are built in."""
    name, problems = data.get("name"), []
    if name in RESERVED_LISTENER_NAMES:
        problems.append(Problem(("name",), f"{name!r} is reserved for the platform", name))
    kinds = [key for key in ("handler", "agent", "tool") if key in data]
    if len(kinds) > 1:
        message = "a listener has one of `handler`, `agent` or `tool`, not several"
        problems.append(Problem((kinds[1],), message, data[kinds[1]]))
    elif not kinds:
        problems.append(Problem((), "a listener needs a `handler`, an `agent` or a `tool`", data))
    elif "agent" in data and "response_class" in data:
        message = "an agent answers with core `answer`; response_class is for handlers"
        problems.append(Problem(("response_class",), message, data["response_class"]))
    if "tool" in data:
        for key in ("payload_class", "response_class"):
            if key in data:
                message = "a tool's classes are built in (a wasm tool names them under `tool:`)"
                problems.append(Problem((key,), message, data[key]))
    elif "payload_class" not in data:
        problems.append(Problem(("payload_class",), "missing", data))
    if "isolation" in data and "handler" not in data and "agent" not in data:
        message = ("isolation is for handler and agent listeners; a tool confines itself "
                   "(an mcp server: `isolation` under `tool:`)")
        problems.append(Problem(("isolation",), message, data["isolation"]))
    if kinds == ["handler"] and data.get("description") is None:
        problems.append(Problem(("description",), "missing", data))
    if data.get("stream") is True and "agent" not in data:
        message = "stream is for agent listeners: their model's text as it is written"
        problems.append(Problem(("stream",), message, data["stream"]))
    return problems


@dataclass(frozen=True, config=SECTION)
class TlsConfig:
    cert: FilePath
    key: FilePath


@dataclass(frozen=True, config=SECTION)
class BusConfig:
    host: Text = "127.0.0.1"
    port: Port = 8765
    tls: TlsConfig | None = None
    max_envelope_bytes: Annotated[int, Strict(), Field(ge=256)] = 262144
    max_attributes: Positive = 64  # on one element of an envelope
    max_elements: Positive = 10000  # in one envelope
    max_inflight: Positive = 1000
    max_connections: Positive = 1024
    max_unauthenticated: Positive = 256  # connections not yet authenticated, in all
    max_unauthenticated_per_ip: Positive = 16  # the same, from one source address
    rate_per_s: PerSecond = 200.0  # per-client message rate (token bucket refill)
    rate_burst: Positive = 400
    auth_timeout_s: Seconds = 10.0
    compression: Bool = False


@dataclass(frozen=True, config=SECTION)
class AuthConfig:
    clients_file: FilePath | None = None  # only a path here; the bus reads the file
    session_ttl_s: Seconds = 28800.0
    max_failures: Positive = 5
    failure_window_s: Seconds = 60.0
    lockout_s: Seconds = 60.0


@dataclass(frozen=True, config=SECTION)
class OobConfig:
    authorized_keys: FilePath | None = None
    socket: FilePath | None = None  # the loader fills it (default state_dir/oob.sock)
    allowed_uids: tuple[NonNegative, ...] = ()
    max_frame_bytes: Annotated[int, Strict(), Field(ge=1024)] = 1048576
    clock_skew_s: Seconds = 60.0


@dataclass(frozen=True, config=SECTION)
class MetricsConfig:
    listen: HostPort | None = None  # "host:port"; None: no metrics endpoint

    @property
    def host_port(self) -> tuple[str, int] | None:
        return None if self.listen is None else split_host_port(self.listen)


@dataclass(frozen=True, config=SECTION)
class TelemetryConfig:
    """OpenTelemetry traces; the section's absence means none (no SDK loaded)."""

    otlp_endpoint: Url  # the base URL: spans go to URL/v1/traces
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    service_name: Text | None = None  # None: the organism's name
    capture_content: Bool = False
    sample_ratio: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] = 1.0
    headers_file: FilePath | None = None  # `Name: value` lines (a secret file)
    accept_client_context: Bool = False  # a client's traceparent meta extension


@dataclass(frozen=True, config=SECTION)
class PumpConfig:
    max_concurrency: Positive = 256
    per_listener_concurrency: Positive = 64
    handler_timeout_s: Seconds = 30.0
    max_hops: Positive = 64
    max_queue: Positive = 10000
    max_fanout: Positive = 64
    thread_idle_s: Seconds = 86400.0  # conversations idle this long are ended and forgotten
    max_state_bytes_per_thread: Positive = 65536  # handler state per listener and conversation
    # envelopes parked for approval, held in memory until decided: per client, in all
    max_parked_bytes_per_client: Positive = 64 << 20
    max_parked_bytes: Positive = 256 << 20


_KERNEL = DEFAULT_KERNEL_OPTIONS  # the journal's defaults are the kernel's own


@dataclass(frozen=True, config=SECTION)
class JournalConfig:
    retention: RetentionValue = RETAIN_FOREVER
    synchronous: Synchronous = "NORMAL"
    commit_interval_ms: NonNegativeNumber = _KERNEL.commit_interval_s * 1000
    commit_max_entries: Positive = _KERNEL.commit_max_entries
    sweep_interval_s: Seconds = _KERNEL.sweep_interval_s
    # frames kept for an absent client (newest win)
    max_outbox_per_client: Positive = _KERNEL.max_outbox_per_client


def _kernel_rules(data: dict[str, Any]) -> list[Problem]:
    """postgres names its database once (`dsn` or `dsn_file`); sqlite names none."""
    given = [key for key in ("dsn", "dsn_file") if key in data]
    if data.get("backend", "sqlite") == "postgres":
        if not given:
            return [Problem(("dsn",), "backend postgres needs dsn or dsn_file", data)]
        if len(given) == 2:
            return [Problem(("dsn_file",), "give dsn or dsn_file, not both", data)]
        return []
    return [Problem((key,), "only for backend postgres", data) for key in given]


@dataclass(frozen=True, config=SECTION)
class KernelConfig:
    """Where the kernel keeps its state: SQLite in state_dir (the default), or a
    PostgreSQL database (`dsn`, or `dsn_file`: a file holding it, read at start)."""

    backend: Literal["sqlite", "postgres"] = "sqlite"
    dsn: Text | None = None
    dsn_file: FilePath | None = None

    _rules = rules(lambda data, _: _kernel_rules(data), "kernel")


def _isolation_rules(data: dict[str, Any]) -> list[Problem]:
    """`network: false` is never degraded: refused where nothing can enforce it. A
    `user` must exist here (whether the daemon may switch to it is checked at start)."""
    from agentd.confine import landlock_status  # late: only files that use isolation

    problems = unknown_user(data)
    if data.get("process", True) is not True or data.get("network", False) is not False:
        return problems
    if landlock_status().network_denial:
        return problems
    message = ("network: false cannot be enforced on this kernel (no Landlock TCP rules "
               "and no permission to create a network namespace)")
    return [*problems,
            Problem(("network",), message, data.get("network", False), at_entry=True)]


@dataclass(frozen=True, config=SECTION)
class IsolationConfig:
    """Run a handler in a confined worker process instead of the daemon."""

    process: Bool = True
    memory_mb: Positive | None = 512  # address space of each worker
    cpu_s: Positive | None = None  # CPU seconds of one call (see the operations guide)
    network: Bool = False
    workers: Positive = 1
    max_calls: Positive | None = None  # recycle a worker after this many calls
    max_rss_mb: Positive | None = None  # recycle a worker whose RSS is above this
    open_files: Positive = 256
    # processes and threads of a worker and all it starts, at once (a pids cgroup)
    max_tasks: Positive = 64
    env: dict[EnvName, AnyText] = Field(default_factory=dict)  # the worker's whole environment
    # run the workers as this user (name or uid; the daemon must run as root)
    user: AnyText | None = None
    # more files or folders the workers may read (a module imported at run time, data)
    read: tuple[FilePath, ...] = ()

    _rules = rules(lambda data, _: _isolation_rules(data), "isolation")


@dataclass(frozen=True, config=SECTION)
class ApprovalConfig:
    """A gate: a message for the listener waits, parked, for a human's decision."""

    required: Bool = True
    approvers: Annotated[tuple[Literal["operator", "client"], ...],
                         Field(min_length=1)] = ("operator",)
    timeout_s: Seconds = 3600.0


@dataclass(frozen=True, config=SECTION)
class ProfileConfig:
    listeners: Members
    retention: RetentionValue | None = None  # overrides journal.retention
    synchronous: Synchronous | None = None  # overrides journal.synchronous
    token_budget: Positive | None = None
    isolation: IsolationConfig | None = None  # for its handler listeners without their own
    allow_intents: Bool = False  # may its clients send core `intent`? (agents always may)
    stream: Bool = False  # its clients get previews of agents' text without asking
    routing: ProfileRoutingConfig | None = None  # overrides routing.semantic's values
    approval: ApprovalConfig | None = None  # a gate on every listener of the profile
    name: SkipJsonSchema[str] = ""  # its key in `profiles`, filled in by the loader

    _rules = rules(lambda data, _: _name_is_the_key(data), "profile")


@dataclass(frozen=True, config=SECTION)
class MetaConfig:
    allow_list_capabilities: Bool = False
    allow_schema_requests: Bool = False
    allow_example_requests: Bool = False
    allow_remote: Bool = False  # meta questions from federation peers (within the above)


@dataclass(frozen=True, config=SECTION)
class LlmBackendConfig:
    name: Name
    provider: Provider
    base_url: Url | None = None
    model: Text | None = None
    api_key_env: EnvName | None = None  # the variable's name; its value is read at use
    cassette: FilePath | None = None  # replay: the recorded exchanges to play back
    record: FilePath | None = None  # openai/anthropic: append exchanges to this cassette
    max_concurrency: Positive = 256  # as pump.max_concurrency: never the bottleneck by default
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None
    timeout_s: Seconds = 60.0

    _rules = rules(lambda data, _: _provider_rules(data), "llm backend")


@dataclass(
    frozen=True, config=ConfigDict(extra="forbid", json_schema_extra={"required": ["backends"]})
)
class LlmConfig:
    strategy: Strategy = "failover"
    backends: tuple[LlmBackendConfig, ...] = ()
    retries: NonNegative = 3
    cache_ttl_s: NonNegativeNumber = 0.0

    def backend(self, name: str) -> LlmBackendConfig:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)

    _rules = rules(lambda data, _: _backend_rules(data), "llm")


EXTRACTIVE = "extractive"  # the summarizer that needs no model


@dataclass(frozen=True, config=SECTION)
class AgentContextConfig:
    """How an agent's working memory is kept within its prompt (the librarian) and
    how much long-term memory is recalled into it."""

    budget_tokens: Positive = 32_000  # the whole request: every message and tool text
    fold_below: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] = 0.1
    keep_recent: NonNegative = 4  # the newest segments always stay expanded
    recall_k: NonNegative = 5
    summarizer: Name = EXTRACTIVE  # or the name of an `llm.backends` entry


@dataclass(frozen=True, config=SECTION)
class AgentConfig:
    prompt: Text  # "a & b": names of `prompts` entries, composed in this order
    model: Name  # the name of an `llm.backends` entry
    max_iterations: Positive = 8
    max_tokens: Positive = 2048
    token_budget: Positive | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=2.0)] | None = None
    context: AgentContextConfig = AgentContextConfig()
    # How the model calls its peers: provider tools, XML payloads in its text, or
    # provider tools where the backend's protocol has them.
    tool_calling: Literal["native", "xml", "auto"] = "auto"

    @property
    def prompt_names(self) -> tuple[str, ...]:
        return tuple(part.strip() for part in self.prompt.split("&"))


@dataclass(frozen=True, config=SECTION)
class ListenerSection:
    """A listener as written; `ListenerConfig` is what the loader makes of it."""

    name: Name
    payload_class: ClassRefs = ()  # required unless `tool:` (a tool's are built in)
    response_class: ClassRefs = ()
    handler: HandlerRef | None = None
    agent: AgentConfig | None = None
    tool: ToolConfig | None = None
    # Required for handlers; agents and tools: their payload's docstring.
    description: AnyText | None = None
    semantic_description: AnyText | None = None  # more text for semantic routing to match
    peers: Names = ()
    max_concurrency: Positive | None = None  # None: pump.per_listener_concurrency
    timeout_s: Seconds | None = None  # None: pump.handler_timeout_s
    isolation: IsolationConfig | None = None  # wins over its profiles' isolation
    approval: ApprovalConfig | None = None  # a human decides before it runs
    stream: Bool = False  # an agent: previews of its model's text for the client

    _rules = rules(lambda data, _: _kind_rules(data), "listener")


@dataclass(frozen=True, config=SECTION)
class IdentityConfig:
    key: FilePath  # the organism's Ed25519 private key (`agentd init` writes identity.key)


# A federation link's frame limits: the least `max_frame_bytes` a side may set and
# announce, and its default (the handshake checks and announces with both).
MIN_FRAME_BYTES = 1024
DEFAULT_FRAME_BYTES = 262144


@dataclass(frozen=True, config=SECTION)
class FederationConfig:
    listen: HostPort  # "host:port" of wss://host:port/federation, never the bus's port
    tls: TlsConfig
    handshake_timeout_s: Seconds = 10.0
    max_frame_bytes: Annotated[int, Strict(), Field(ge=MIN_FRAME_BYTES)] = DEFAULT_FRAME_BYTES
    backoff_initial_s: Seconds = 0.5
    backoff_max_s: Seconds = 30.0
    rate_per_s: PerSecond = 200.0  # a peer's calls per second (token bucket refill), per link
    rate_burst: Positive = 400
    max_inflight_calls: Positive = 256  # a peer's calls being admitted at once, per link


Sha256Hex = Annotated[str, Strict(), StringConstraints(pattern=r"^[0-9a-f]{64}$")]


def _gateway_rules(data: dict[str, Any]) -> list[Problem]:
    """A schema pin is for an imported listener."""
    pins, imports = data.get("schema_pins"), data.get("import", ())
    if not isinstance(pins, dict) or not isinstance(imports, list | tuple):
        return []
    return [Problem(("schema_pins", name), f"{name!r} is not in this gateway's import", name)
            for name in pins if name not in imports]


@dataclass(frozen=True, config=SECTION)
class GatewayConfig:
    """A peer organism: its name is the peer's `organism.name`."""

    name: Name
    public_key: Text  # "ssh-ed25519 AAAA… comment", the peer's identity line
    url: WssUrl | None = None  # wss://host:port/federation; None: only the peer dials
    cafile: FilePath | None = None  # verify the peer's TLS certificate against it
    profile: ProfileName | None = None  # what the peer's requests may reach here
    export: Names = ()  # local listeners the peer may call
    import_: Names = Field(default=(), alias="import")  # remote listeners callable here
    call_timeout_s: Seconds = 300.0  # a call to an imported listener, the peer's downtime included
    # import name -> the SHA-256 its schemas must have (instead of trust on first use)
    schema_pins: dict[str, Sha256Hex] = Field(default_factory=dict)

    _rules = rules(lambda data, _: _gateway_rules(data), "gateway")


@dataclass(frozen=True, config=SECTION)
class OrganismSection:
    name: Name


def _organism_key(data: Any) -> Any:
    """A file without `organism` is told it lacks organism.name, the key one writes."""
    if isinstance(data, dict) and "organism" not in data:
        return {**data, "organism": {}}
    return data


def _no_line(loc: tuple[str | int, ...]) -> int:
    del loc
    return 0


@dataclass(frozen=True, config=SECTION)
class OrganismDocument:
    """The whole file as written. Keys are validated in this order: `python_path`
    comes before `listeners`, whose modules it makes importable."""

    organism: OrganismSection
    state_dir: FilePath | None = None
    python_path: tuple[Folder, ...] = ()
    bus: BusConfig = BusConfig()
    auth: AuthConfig = AuthConfig()
    oob: OobConfig = OobConfig()
    metrics: MetricsConfig = MetricsConfig()
    telemetry: TelemetryConfig | None = None
    pump: PumpConfig = PumpConfig()
    journal: JournalConfig = JournalConfig()
    kernel: KernelConfig = KernelConfig()
    profiles: dict[ProfileName, ProfileConfig] = Field(default_factory=dict)
    prompts: dict[PromptName, Prompt] = Field(default_factory=dict)
    llm: LlmConfig | None = None
    listeners: tuple[ListenerSection, ...] = ()
    meta: MetaConfig = MetaConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    identity: IdentityConfig | None = None
    federation: FederationConfig | None = None
    gateways: tuple[GatewayConfig, ...] = ()
    routing: RoutingConfig = Field(default_factory=RoutingConfig)

    _rules = rules(
        lambda data, context: cross_references(data, context.get("line_of", _no_line)),
        "organism",
        prepare=_organism_key,
    )
