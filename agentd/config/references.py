"""The rules that span sections: listener names are unique; peers and profile
members name listeners; an agent's model names a backend and its prompt names
prompts; one payload class per routing key, and an agent alone on its own.

They read the plain data (not the validated sections), so they run even when
another part of the file is broken: every problem is reported in the same pass.
A value of the wrong shape is skipped here; its section reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentd.config import imports
from agentd.config.embeddings import embeddings_references
from agentd.config.routing import routing_references
from agentd.config.values import NAME_PATTERN, REMOTE_PATTERN, Problem
from agentd.llm.tools import XML, ToolNameError, tool_names

LineOf = Callable[[tuple[str | int, ...]], int]


def cross_references(data: dict[str, Any], line_of: LineOf) -> list[Problem]:
    listeners = _entries(data.get("listeners"))
    names: dict[str, int] = {}
    problems: list[Problem] = []
    for i, entry in listeners:
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name == "core":
            continue
        if name in names:
            first = names[name]
            message = (
                f"duplicate listener name {name!r} (also listeners[{first}], line "
                f"{line_of(('listeners', first))})"
            )
            problems.append(Problem(("listeners", i, "name"), message, name))
            continue
        names[name] = i
        for tool in _mcp_tools(entry):  # one `tool: {kind: mcp}` block names several
            names.setdefault(f"{name}.{tool}", i)
    for _, gateway in _entries(data.get("gateways")):  # GATEWAY:LISTENER for each import
        for _, remote in _strings(gateway.get("import")):
            names.setdefault(f"{gateway.get('name')}:{remote}", -1)
    problems += _peers(listeners, names)
    problems += _agents(listeners, data)
    problems += _members(data.get("profiles"), names)
    problems += _payload_keys(listeners)
    problems += _isolation(listeners, data.get("profiles"))
    problems += embeddings_references(data)
    problems += _gateways(data, names)
    problems += routing_references(data)
    return problems


def _mcp_tools(entry: dict[str, Any]) -> list[str]:
    """The allowlisted tools of an MCP `tool:` block: its listeners are `NAME.TOOL`."""
    tool = entry.get("tool")
    if not isinstance(tool, dict) or tool.get("kind") != "mcp":
        return []
    return [name for _, name in _strings(tool.get("tools"))]


def _entries(value: Any) -> list[tuple[int, dict[str, Any]]]:
    items = value if isinstance(value, tuple) else ()
    return [(i, item) for i, item in enumerate(items) if isinstance(item, dict)]


def _strings(value: Any) -> list[tuple[int, str]]:
    items = value if isinstance(value, tuple) else ()
    return [(i, item) for i, item in enumerate(items) if isinstance(item, str)]


def _peers(listeners: list[tuple[int, dict[str, Any]]], names: dict[str, int]) -> list[Problem]:
    return [
        Problem(("listeners", i, "peers", j), _unknown(peer), peer)
        for i, entry in listeners
        for j, peer in _strings(entry.get("peers"))
        if _is_ref(peer) and peer not in names
    ]


def _is_ref(name: str) -> bool:
    return bool(NAME_PATTERN.fullmatch(name) or REMOTE_PATTERN.fullmatch(name))


def _unknown(name: str) -> str:
    if REMOTE_PATTERN.fullmatch(name):
        gateway, _, remote = name.partition(":")
        return f"no gateway {gateway!r} imports {remote!r}"
    return f"no listener is named {name!r}"


def _members(profiles: Any, names: dict[str, int]) -> list[Problem]:
    if not isinstance(profiles, dict):
        return []
    return [
        Problem(("profiles", key, "listeners", j), _unknown(member), member)
        for key, body in profiles.items()
        if isinstance(body, dict)
        for j, member in _strings(body.get("listeners"))
        if _is_ref(member) and member not in names
    ]


def _agents(listeners: list[tuple[int, dict[str, Any]]], data: dict[str, Any]) -> list[Problem]:
    llm = data.get("llm")
    backends = {
        b.get("name") for _, b in _entries(llm.get("backends") if isinstance(llm, dict) else ())
    }
    prompts = data.get("prompts")
    declared = set(prompts) if isinstance(prompts, dict) else set()
    problems: list[Problem] = []
    for i, entry in listeners:
        agent = entry.get("agent")
        if "handler" in entry or not isinstance(agent, dict):
            continue
        model, prompt = agent.get("model"), agent.get("prompt")
        at = ("listeners", i, "agent", "model")
        if isinstance(model, str) and model.strip():
            if not isinstance(llm, dict):
                problems.append(Problem(at, "an agent needs an `llm` section", model))
            elif model not in backends:
                problems.append(Problem(at, f"no backend named {model!r} in llm.backends", model))
        context = agent.get("context")
        summarizer = context.get("summarizer") if isinstance(context, dict) else None
        if (isinstance(summarizer, str) and summarizer != "extractive"
                and isinstance(llm, dict) and summarizer not in backends):
            problems.append(Problem(("listeners", i, "agent", "context", "summarizer"),
                                    f"no backend named {summarizer!r} in llm.backends "
                                    "(or `extractive`)", summarizer))
        if agent.get("tool_calling") != XML:
            try:  # its peers are offered as provider tools
                tool_names(peer for _, peer in _strings(entry.get("peers")))
            except ToolNameError as exc:
                problems.append(Problem(("listeners", i, "peers"), str(exc), entry.get("peers")))
        if not isinstance(prompt, str) or not prompt.strip():
            continue
        at = ("listeners", i, "agent", "prompt")
        for part in (part.strip() for part in prompt.split("&")):
            if not part:
                problems.append(Problem(at, "empty prompt name around '&'", prompt))
            elif part not in declared:
                problems.append(Problem(at, f"no prompt named {part!r} in prompts", prompt))
    return problems


def _payload_keys(listeners: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    """Routing keys: one class per (namespace, tag); an agent alone on its own.
    (`@xmlify` itself refuses the platform's namespaces.)"""
    from agentd import _xmlify as xmlify  # late: the schema layer imports our error type

    problems: list[Problem] = []
    users: dict[tuple[str, str], list[tuple[int, dict[str, Any], type]]] = {}
    for i, entry in listeners:
        refs = entry.get("payload_class")
        listed = isinstance(refs, tuple)
        for j, ref in _strings(refs) if listed else [(0, refs)] if isinstance(refs, str) else []:
            try:
                cls = imports.resolve(ref)  # already imported: its problems are reported
            except imports.ReferenceProblem:
                continue
            if not (isinstance(cls, type) and xmlify.is_xmlified(cls)):
                continue
            several = isinstance(refs, tuple) and len(refs) > 1
            loc = ("listeners", i, "payload_class", *((j,) if several else ()))
            spec = xmlify.spec_of(cls)
            for other, _, other_cls in users.get(spec.key, []):
                if other_cls is not cls:
                    message = (
                        f"{ref} has the same root {spec.clark} as a different class in "
                        f"listeners[{other}] ({other_cls.__module__}:{other_cls.__qualname__})"
                    )
                    problems.append(Problem(loc, message, ref))
            users.setdefault(spec.key, []).append((i, entry, cls))
    for uses in users.values():
        for i, entry, _ in uses:
            others = sorted({_label(o, e) for o, e, _ in uses if o != i})
            if "agent" not in entry or "handler" in entry or not others:
                continue
            clark = xmlify.spec_of(uses[0][2]).clark
            message = (
                f"an LLM agent needs a payload root of its own; {clark} "
                f"is also the payload of {', '.join(others)}"
            )
            problems.append(Problem(("listeners", i, "payload_class"), message, entry))
    return problems


def _isolation(listeners: list[tuple[int, dict[str, Any]]], profiles: Any) -> list[Problem]:
    """A handler or agent listener without `isolation:` of its own takes its
    profiles'; two profiles that list it must then agree."""
    if not isinstance(profiles, dict):
        return []
    problems: list[Problem] = []
    for i, entry in listeners:
        name = entry.get("name")
        if "isolation" in entry or "tool" in entry or not isinstance(name, str):
            continue
        seen: dict[str, Any] = {}
        for key, body in profiles.items():
            if not isinstance(body, dict) or "isolation" not in body:
                continue
            members = body.get("listeners")
            if members == "all" or (isinstance(members, tuple) and name in members):
                seen[key] = body["isolation"]
        if len({repr(v) for v in seen.values()}) > 1:
            message = (f"profiles {', '.join(sorted(seen))} give {name!r} different isolation; "
                       "give the listener an `isolation:` of its own")
            problems.append(Problem(("listeners", i, "name"), message, name))
    return problems


def _label(index: int, entry: dict[str, Any]) -> str:
    name = entry.get("name")
    return repr(name) if isinstance(name, str) else f"listeners[{index}]"


def _gateways(data: dict[str, Any], names: dict[str, int]) -> list[Problem]:
    """Gateways need the organism's identity and the federation endpoint; each names
    a known profile and exports known listeners; gateway names are unique."""
    gateways = _entries(data.get("gateways"))
    if not gateways:
        return []
    problems: list[Problem] = []
    for key in ("identity", "federation"):
        if data.get(key) is None:
            problems.append(Problem((key,), "required when gateways are declared", data))
    raw_profiles = data.get("profiles")
    profiles = raw_profiles if isinstance(raw_profiles, dict) else {}
    seen: set[str] = set()
    for i, entry in gateways:
        name = entry.get("name")
        if isinstance(name, str) and name in seen:
            problems.append(Problem(("gateways", i, "name"), f"duplicate gateway {name!r}", name))
        elif isinstance(name, str):
            seen.add(name)
            if name in names:
                message = f"{name!r} is also a listener's name"
                problems.append(Problem(("gateways", i, "name"), message, name))
        profile = entry.get("profile")
        if isinstance(profile, str) and profile not in profiles:
            message = f"no profile is named {profile!r}"
            problems.append(Problem(("gateways", i, "profile"), message, profile))
        problems += [
            Problem(("gateways", i, "export", j), f"no listener is named {member!r}", member)
            for j, member in _strings(entry.get("export"))
            if NAME_PATTERN.fullmatch(member) and member not in names
        ]
        body = profiles.get(profile) if isinstance(profile, str) else None
        members = body.get("listeners") if isinstance(body, dict) else None
        if isinstance(members, tuple):
            problems += [
                Problem(("gateways", i, "export", j),
                        f"{member!r} is not in profile {profile!r}", member)
                for j, member in _strings(entry.get("export"))
                if member in names and member not in members
            ]
        problems += [
            Problem(("gateways", i, key, j), f"{member!r}: a local listener name here", member)
            for key in ("export", "import")
            for j, member in _strings(entry.get(key))
            if ":" in member
        ]
        if entry.get("export") and profile is None:
            message = "a gateway that exports listeners needs a profile"
            problems.append(Problem(("gateways", i, "profile"), message, entry))
    return problems
