"""The organism's configuration: `organism.yaml` (and the bus's clients file) read
once into frozen dataclasses, validated with pydantic, every problem reported with
its `file:line:col` and key path.

Modules: `reader` (YAML with locations, safe-YAML rules, pydantic errors worded as
issues) · `values` (the value types) · `sections` (one class per section, each key
declared once) · `references` (rules across sections) · `imports` (`module:attribute`
and `sys.path`) · `organism` (loading, the runtime objects) · `clients` (the clients
file) · `schema` (the published JSON Schema).
"""

from agentd._errors import ConfigError
from agentd.config.clients import CLIENT_ID, ClientEntry, normalise_secret, read_clients_text
from agentd.config.embeddings import EmbeddingsConfig
from agentd.config.organism import (
    FrozenMapping,
    ListenerConfig,
    OrganismConfig,
    check_config_main,
    load_config,
    load_config_text,
)
from agentd.config.routing import (
    DEFAULT_SEMANTIC,
    ProfileRoutingConfig,
    RoutingConfig,
    SemanticOverride,
    SemanticRoutingConfig,
)
from agentd.config.schema import organism_schema, organism_schema_text
from agentd.config.sections import (
    EXTRACTIVE,
    AgentConfig,
    AgentContextConfig,
    ApprovalConfig,
    AuthConfig,
    BusConfig,
    FederationConfig,
    GatewayConfig,
    IdentityConfig,
    IsolationConfig,
    JournalConfig,
    LlmBackendConfig,
    LlmConfig,
    MetaConfig,
    MetricsConfig,
    OobConfig,
    OrganismDocument,
    ProfileConfig,
    PumpConfig,
    TelemetryConfig,
    TlsConfig,
)
from agentd.kernel import Retention

__all__ = [
    "CLIENT_ID",
    "DEFAULT_SEMANTIC",
    "EXTRACTIVE",
    "AgentConfig",
    "AgentContextConfig",
    "ApprovalConfig",
    "AuthConfig",
    "BusConfig",
    "ClientEntry",
    "ConfigError",
    "EmbeddingsConfig",
    "FederationConfig",
    "FrozenMapping",
    "GatewayConfig",
    "IdentityConfig",
    "IsolationConfig",
    "JournalConfig",
    "ListenerConfig",
    "LlmBackendConfig",
    "LlmConfig",
    "MetaConfig",
    "MetricsConfig",
    "OobConfig",
    "OrganismConfig",
    "OrganismDocument",
    "ProfileConfig",
    "ProfileRoutingConfig",
    "PumpConfig",
    "Retention",
    "RoutingConfig",
    "SemanticOverride",
    "SemanticRoutingConfig",
    "TelemetryConfig",
    "TlsConfig",
    "check_config_main",
    "load_config",
    "load_config_text",
    "normalise_secret",
    "organism_schema",
    "organism_schema_text",
    "read_clients_text",
]
