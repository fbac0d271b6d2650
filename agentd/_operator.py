"""The operator commands: what `agentctl` asks of a running daemon over the
out-of-band channel, answered as XML result elements.

The OOB server (`agentd.oob`) authenticates and rate-limits a command before it
gets here; this module only reads the daemon's state and, for `reload`, `approve`,
`deny`, `memory` and `shutdown`, asks the daemon to act. Unknown commands and bad
arguments raise `CommandFailed` with a generic code; nothing here writes the
database except through the kernel. `introspect thread UUID` is the only place a
private call-chain path is revealed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from lxml import etree

from agentd._errors import ConfigError
from agentd._threads import ThreadState
from agentd._xmlify import spec_of
from agentd.durable import END_THREAD, end_thread
from agentd.oob import format_time, result_element

if TYPE_CHECKING:
    from agentd._routing import Routing
    from agentd.kernel import Kernel
    from agentd.platform import AgentHandlers
    from agentd.pump import Pump
    from agentd.semantic import SemanticRouter


class OperatedDaemon(Protocol):
    """The daemon as its operator commands see it (`agentd._daemon.Daemon`): what
    they read and the three things they ask of it."""

    kernel: Kernel | None
    pump: Pump | None
    routing: Routing | None
    router: SemanticRouter | None

    @property
    def agents(self) -> AgentHandlers | None: ...

    role: str  # "primary", or "standby" while it waits for the lease

    def status(self) -> dict[str, Any]: ...

    async def kernel_status(self) -> dict[str, Any]: ...

    async def reload(self, dry_run: bool) -> dict[str, Any]: ...

    def request_stop(self, mode: str = "graceful") -> None: ...


def mcp_status() -> dict[str, Any]:
    """MCP servers' states and restarts, when an organism declares any (imported
    only then: an organism without MCP tools does not load the SDK)."""
    mcp = sys.modules.get("agentd.mcp")
    return {"mcp_servers": mcp.servers_status()} if mcp is not None and mcp.SERVERS else {}


def mcp_pin(lst: Any) -> dict[str, Any]:
    """An MCP tool's server and pin, for `introspect capabilities`."""
    ref = getattr(lst.config, "handler_ref", "")
    if not ref.startswith("tool:mcp:"):
        return {}
    server, _, tool = lst.name.rpartition(".")
    return {"mcp": {"server": server, "tool": tool, "pin_sha256": ref.removeprefix("tool:mcp:")}}


class DaemonCommands:
    """The `Commands` the OOB server runs: results as XML elements."""

    def __init__(self, daemon: OperatedDaemon) -> None:
        self.daemon = daemon

    async def run(self, name: str, args: Mapping[str, str]) -> etree._Element | str:
        from agentd.oob import CommandFailed

        d = self.daemon
        try:
            if name == "status":
                return result_element("status", {**d.status(),
                                                 "kernel": await d.kernel_status()})
            if d.role == "standby" and name != "shutdown":
                raise CommandFailed("failed", "this daemon is a standby waiting for the "
                                    "lease; ask the primary (`status` names it)")
            if name == "reload":
                dry = args.get("dry-run", "false") == "true"
                try:
                    diff = await d.reload(dry)
                except ConfigError as exc:
                    raise CommandFailed("invalid", "\n".join(exc.issues)) from None
                return result_element("reload", diff)
            if name == "introspect" and args.get("what") == "context":
                return await self._context(args)
            if name == "introspect" and args.get("what") == "route":
                return await self._route(args)
            if name == "introspect":
                return self._introspect(args)
            if name == "memory":
                return await self._memory(args)
            if name == "journal":
                return await self._journal(args)
            if name == "trace":
                return await self._trace(args)
            if name == "approvals":
                return self._approvals(args)
            if name in ("approve", "deny"):
                return await self._decide(name == "approve", args)
            if name == END_THREAD and d.pump is not None:
                return await end_thread(d.pump, d.kernel, args)
            if name == "shutdown":
                mode = args.get("mode", "graceful")
                if mode not in ("graceful", "now"):
                    raise CommandFailed("invalid", "mode must be graceful or now")
                asyncio.get_running_loop().call_soon(d.request_stop, mode)
                return result_element("shutdown", {"mode": mode})
        except CommandFailed:
            raise
        except (KeyError, ValueError) as exc:
            raise CommandFailed("invalid", str(exc)) from None
        raise CommandFailed("unknown-command", f"unknown command {name!r}")

    def _introspect(self, args: Mapping[str, str]) -> etree._Element | str:
        from agentd.oob import CommandFailed

        d = self.daemon
        assert d.routing is not None and d.pump is not None
        what = args.get("what", "")
        if what == "capabilities":
            return result_element(
                "capabilities",
                [
                    {
                        "name": lst.name,
                        "kind": "agent" if lst.is_agent else "tool",
                        "description": lst.description,
                        "accepts": [spec.clark for spec in lst.payload_specs],
                        "peers": sorted(lst.peers),
                        **mcp_pin(lst),
                    }
                    for lst in sorted(d.routing.listeners.values(), key=lambda x: x.name)
                ],
            )
        if what in ("schema", "example", "prompt"):
            name = args.get("name", "")
            named = d.routing.listeners.get(name)
            if named is None:
                raise CommandFailed("invalid", f"no listener named {name!r}")
            spec = named.payload_specs[0]
            if what == "schema":
                return spec.xsd
            if what == "example":
                return spec.example.decode()
            if named.is_agent and d.agents is not None:
                # Operators only: the assembled system prompt and its hash.
                prompt = d.agents.platform.prompt(name)
                return f"sha256 {prompt.sha256}\n\n{prompt.system_prompt}"
            return "\n\n".join(spec_of(s.cls).prompt for s in named.payload_specs)
        if what == "threads":
            thread = args.get("thread")
            return result_element(
                "threads",
                [
                    {
                        "uuid": frame.uuid,
                        "owner": frame.owner,
                        "profile": frame.profile.name,
                        "root": frame.is_root,
                    }
                    for frame in _first(
                        (f for f in d.pump.registry if f.state is ThreadState.ACTIVE
                         and (thread is None or f.root.uuid == thread)), args)
                ],
            )
        if what == "thread":
            uuid = args.get("thread", "")
            found = d.pump.registry.get(uuid)
            if found is None:
                raise CommandFailed("invalid", f"no live thread {uuid!r}")
            frame = found
            # The one place a private call-chain path is ever revealed.
            return result_element(
                "thread",
                {
                    "uuid": frame.uuid,
                    "path": ".".join(frame.path),
                    "owner": frame.owner,
                    "profile": frame.profile.name,
                    "table_version": frame.profile.table.version,
                    "parent": frame.parent.uuid if frame.parent else "",
                    "state": frame.state.value,
                },
            )
        if what == "timers":
            thread = args.get("thread")
            timers = [t for t in d.pump.waits.timers.values()
                      if thread is None or t.conversation == thread]
            return result_element("timers", [
                {"id": t.id, "thread": t.conversation, "listener": t.listener,
                 "due": format_time(t.due), "note": t.note}
                for t in _first(sorted(timers, key=lambda t: (t.due, t.id)), args)
            ])
        raise CommandFailed("invalid", f"unknown introspection {what!r}")

    async def _context(self, args: Mapping[str, str]) -> etree._Element:
        """A thread's context segments: live tasks from the platform, ended ones (kept
        while their frames' rows live) from the kernel. `thread` may be the client's
        thread or a task's own frame."""
        d = self.daemon
        assert d.kernel is not None
        uuid = args.get("thread", "")
        live: dict[str, list[Any]] = {}
        if d.agents is not None:
            platform = d.agents.platform
            for frame in platform.tasks_of(uuid):
                live[frame] = platform.task_segments(frame) or []
        rows = await d.kernel.segments(conversation=uuid) + await d.kernel.segments(thread=uuid)
        segments: dict[tuple[str, int], dict[str, Any]] = {}
        for row in rows:
            frame, sid, kind, tier, relevance, nbytes, tokens = (
                row[0], row[1], row[4], row[5], row[6], row[7], row[8])
            if frame not in live:
                segments[(frame, sid)] = {"id": sid, "kind": kind, "tier": tier,
                                          "relevance": relevance, "bytes": nbytes,
                                          "tokens": tokens, "frame": frame}
        for frame, segs in live.items():
            for seg in segs:
                segments[(frame, seg.id)] = {
                    "id": seg.id, "kind": seg.kind, "tier": seg.tier.value,
                    "relevance": float(seg.relevance), "bytes": seg.nbytes,
                    "tokens": seg.tokens, "frame": frame}
        return result_element("context", {
            "thread": uuid, "segments": [segments[k] for k in sorted(segments)]})

    async def _memory(self, args: Mapping[str, str]) -> etree._Element:
        """Long-term memory of an agent: add, list, forget (operators only)."""
        from agentd.oob import CommandFailed

        d = self.daemon
        if d.agents is None:
            raise CommandFailed("invalid", "this organism has no LLM agents")
        platform = d.agents.platform
        action, agent = args.get("action", ""), args.get("agent", "")
        if action == "add":
            from agentd.embeddings import EmbeddingsError

            try:
                record = await platform.remember(agent, args.get("text", ""),
                                                 args.get("key") or None)
            except EmbeddingsError as exc:  # (a ValueError is `invalid`, see run)
                raise CommandFailed("failed", f"the embeddings provider failed: {exc}") from None
            return result_element("memory", {
                "agent": agent, "id": record.id, "key": record.key,
                "created": format_time(record.created)})
        if action == "list":
            return result_element("memory", {"agent": agent, "memories": [
                {"id": m.id, "key": m.key, "text": m.text, "created": format_time(m.created)}
                for m in await platform.memories(agent)]})
        if action == "forget":
            memory_id = args.get("id", "")
            if not await platform.forget(agent, memory_id):
                raise CommandFailed("invalid", f"agent {agent} has no memory {memory_id!r}")
            return result_element("memory", {"agent": agent, "id": memory_id, "forgotten": True})
        raise CommandFailed("invalid", "action must be add, list or forget")

    async def _route(self, args: Mapping[str, str]) -> etree._Element:
        """The permitted ranking of TEXT in PROFILE, with scores: only listeners the
        profile's table holds are ever scored (what operators tune thresholds with)."""
        from agentd.oob import CommandFailed

        d = self.daemon
        assert d.routing is not None and d.router is not None
        name, text = args.get("profile", ""), args.get("text", "")
        profile = d.routing.profiles.get(name)
        if profile is None:
            raise CommandFailed("invalid", f"no profile named {name!r}")
        if not text.strip():
            raise CommandFailed("invalid", "the intent text is empty")
        ranking = await d.router.rank(text, profile)
        return result_element("route", {"profile": name, **ranking.as_json()})

    def _approvals(self, args: Mapping[str, str]) -> etree._Element:
        d = self.daemon
        assert d.pump is not None
        thread = args.get("thread")
        rows = [r for r in d.pump.waits.parked.values()
                if thread is None or r.conversation == thread]
        return result_element("approvals", [
            {"id": r.id, "listener": r.listener, "thread": r.conversation,
             "payload_sha256": r.payload_sha256, "expires": format_time(r.deadline),
             "approvers": list(r.approvers)}
            for r in _first(sorted(rows, key=lambda r: (r.created, r.id)), args)
        ])

    async def _decide(self, approve: bool, args: Mapping[str, str]) -> etree._Element:
        """An operator's decision, recorded as the signing key's; a refusal is one
        generic message (the reason is in the log and the security event)."""
        from agentd.durable import Decision
        from agentd.oob import CommandFailed, operator_key_id

        d = self.daemon
        assert d.pump is not None
        approval = args.get("id", "")
        reason = args.get("reason", "")[:1024]
        sha = args.get("payload-sha256") or None
        by = f"operator:{operator_key_id.get() or 'unknown'}"
        why = d.pump.decide(Decision(approval, approve, by, payload_sha256=sha,
                                     reason=reason))
        if why is not None:
            raise CommandFailed("invalid", "no pending approval with that id that an "
                                "operator may decide")
        if d.kernel is not None:
            await d.kernel.flush()  # answered once the decision is durable
        return result_element("approve" if approve else "deny", {
            "id": approval, "outcome": "approved" if approve else "denied"})

    async def _trace(self, args: Mapping[str, str]) -> etree._Element:
        """A client's thread as a tree from the journal (no exporter needed)."""
        from agentd.oob import CommandFailed
        from agentd.telemetry import conversation_tree

        d = self.daemon
        assert d.kernel is not None
        uuid = args.get("thread", "")
        row = await d.kernel.thread(uuid)
        entries = await d.kernel.conversation_journal(uuid, limit=int(args.get("limit", "2000")))
        if row is None and not entries:
            raise CommandFailed("invalid", f"no thread {uuid!r} in the journal")
        listeners = d.routing.listeners.values() if d.routing is not None else ()
        tree = conversation_tree(
            uuid, entries, state=row.state if row is not None else None,
            agents=[lst.name for lst in listeners if lst.is_agent],
            remote=[lst.name for lst in listeners
                    if str(getattr(lst.config, "handler_ref", "")).startswith("federation:")],
            content=args.get("content") == "true")
        root = dict(tree)
        root.pop("thread", None)
        return result_element("trace", {"thread": uuid, "root": root})

    async def _journal(self, args: Mapping[str, str]) -> etree._Element:
        d = self.daemon
        assert d.kernel is not None
        limit = int(args.get("limit", "100"))
        if not 0 < limit <= 10_000:
            raise ValueError("limit must be between 1 and 10000")
        entries = await d.kernel.journal(thread=args.get("thread") or None, limit=limit)
        return result_element(
            "journal",
            [
                {
                    "seq": e.seq,
                    "ts": format_time(e.ts),
                    "thread": e.thread,
                    "direction": e.direction,
                    "kind": e.kind,
                    "handler": e.handler,
                    "sender": e.sender,
                    "tag": e.tag,
                    "hash": e.payload_hash,
                    **audit_details(e.direction, e.payload),
                }
                for e in entries
            ],
        )


_DETAIL_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_DETAIL_MAX = 1024
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def audit_details(direction: str, payload: bytes | None) -> dict[str, Any]:
    """`{"details": {...}}` for an audit or security entry: the fields it was
    journaled with (an approval decision's `by`, `reason` and `outcome`; a
    security event's cause), each value as text of at most 1 KiB. Message
    entries show no payload here (their hash stands for it); {} for them."""
    if direction not in ("audit", "security") or not payload:
        return {}
    try:
        fields = json.loads(payload)
    except ValueError:
        return {}
    if not isinstance(fields, dict):
        return {}
    details: dict[str, Any] = {}
    for key, value in fields.items():
        if not isinstance(key, str) or not _DETAIL_KEY.fullmatch(key):
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        details[key] = _NOT_XML.sub("\ufffd", text[:_DETAIL_MAX])
    return {"details": details}


T = TypeVar("T")
LIST_LIMIT = 500  # what a listing shows unless asked: well within a 1 MiB response


def _first(rows: Iterable[T], args: Mapping[str, str]) -> list[T]:
    """The first `limit` rows (argument `limit`, 1 to 10,000; default LIST_LIMIT): a
    listing of everything could pass the response's 1 MiB and be refused whole."""
    limit = int(args.get("limit", str(LIST_LIMIT)))
    if not 0 < limit <= 10_000:
        raise ValueError("limit must be between 1 and 10000")
    return list(itertools.islice(rows, limit))

