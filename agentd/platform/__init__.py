"""The LLM platform: the trusted layer that owns prompts, history and LLM calls.

- `PromptRegistry`: every agent's system prompt, composed, resolved, frozen, hashed.
- six-layer context assembly with spotlighting and `validate_no_override`;
- `Platform.complete` (through an agent's `AgentSession`): budgets, router, audit;
- `make_agent_handlers(config, platform)`: the agents' handlers, for
  `Routing.build(config, agent_handlers=...)`.

Wiring, in short::

    platform = Platform.from_config(config, audit=kernel_audit(kernel))
    routing = Routing.build(config, agent_handlers=make_agent_handlers(config, platform))
    pump = Pump(routing, ...)
    platform.bind_threads(pump.registry)   # conversation budgets
"""

from typing import TYPE_CHECKING

from agentd._lazy import lazy_exports

if TYPE_CHECKING:
    from agentd.platform._agent import (
        AgentHandlers,
        AgentLoop,
        Phase,
        TaskState,
        make_agent_handlers,
        render_result,
    )
    from agentd.platform._assembly import ContextOverflow, OverrideViolation
    from agentd.platform._audit import kernel_audit
    from agentd.platform._budget import BudgetExceeded, BudgetLedger, Scope
    from agentd.platform._calls import (
        AddressedCall,
        PeerTool,
        call_ref,
        decide,
        open_calls,
        peer_tools,
    )
    from agentd.platform._context import (
        AssembledContext,
        Fragment,
        Layer,
        SecurityEvent,
        assemble,
        neutralise,
        prepare,
        validate_no_override,
    )
    from agentd.platform._history import (
        ASSISTANT,
        RESULT,
        HistoryFull,
        HistoryStore,
        InMemoryHistoryStore,
        KernelHistoryStore,
        Turn,
    )
    from agentd.platform._metered import AuditFn, Completion
    from agentd.platform._platform import AgentSession, Platform
    from agentd.platform._prompts import AgentPrompt, PromptRegistry, Tool, ToolCatalogue
    from agentd.platform._reply import ParsedReply, parse_reply
    from agentd.platform._scope import IsolationError, ThreadScope, registry_resolver

__getattr__, __dir__ = lazy_exports(__name__, {
    "agentd.platform._agent": (
        "AgentHandlers",
        "AgentLoop",
        "Phase",
        "TaskState",
        "make_agent_handlers",
        "render_result",
    ),
    "agentd.platform._assembly": ("ContextOverflow", "OverrideViolation"),
    "agentd.platform._audit": ("kernel_audit",),
    "agentd.platform._budget": ("BudgetExceeded", "BudgetLedger", "Scope"),
    "agentd.platform._calls": ("AddressedCall", "PeerTool", "call_ref", "decide", "open_calls",
                               "peer_tools"),
    "agentd.platform._context": (
        "AssembledContext",
        "Fragment",
        "Layer",
        "SecurityEvent",
        "assemble",
        "neutralise",
        "prepare",
        "validate_no_override",
    ),
    "agentd.platform._history": (
        "ASSISTANT",
        "RESULT",
        "HistoryFull",
        "HistoryStore",
        "InMemoryHistoryStore",
        "KernelHistoryStore",
        "Turn",
    ),
    "agentd.platform._metered": ("AuditFn", "Completion"),
    "agentd.platform._platform": ("AgentSession", "Platform"),
    "agentd.platform._prompts": ("AgentPrompt", "PromptRegistry", "Tool", "ToolCatalogue"),
    "agentd.platform._reply": ("ParsedReply", "parse_reply"),
    "agentd.platform._scope": ("IsolationError", "ThreadScope", "registry_resolver"),
})

__all__ = [
    "ASSISTANT",
    "RESULT",
    "AddressedCall",
    "AgentHandlers",
    "AgentLoop",
    "AgentPrompt",
    "AgentSession",
    "AssembledContext",
    "AuditFn",
    "BudgetExceeded",
    "BudgetLedger",
    "Completion",
    "ContextOverflow",
    "Fragment",
    "HistoryFull",
    "HistoryStore",
    "InMemoryHistoryStore",
    "IsolationError",
    "KernelHistoryStore",
    "Layer",
    "OverrideViolation",
    "ParsedReply",
    "PeerTool",
    "Phase",
    "Platform",
    "PromptRegistry",
    "Scope",
    "SecurityEvent",
    "TaskState",
    "ThreadScope",
    "Tool",
    "ToolCatalogue",
    "Turn",
    "assemble",
    "call_ref",
    "decide",
    "kernel_audit",
    "make_agent_handlers",
    "neutralise",
    "open_calls",
    "parse_reply",
    "peer_tools",
    "prepare",
    "registry_resolver",
    "render_result",
    "validate_no_override",
]
