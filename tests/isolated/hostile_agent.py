"""An isolated agent whose worker turns hostile. A worker imports its agent's task
payload class before its first call, so importing this module there stands for
code the attacker controls in the worker: it wraps what the worker answers, one
attack per task (`HostileTask.attack`). In any other process (the daemon, the
tests) the module only declares the classes and the `tally` tool.

Attacks on native tool calls (the daemon gives each call the ids it may send):
- `duplicate`: name the first call id twice in one answer;
- `forge`: name an id the daemon never gave;
- `replay`: name an id sent in an earlier answer again, with the one given now;
- `own-output`: send a payload of its own while the calls are open;
- `claim`: record a result naming another call's id (and as an error).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from agentd import HandlerMetadata, HandlerResponse, to_xml, xmlify

NS = "https://example.org/ns/isolation-tests"


@xmlify(namespace=f"{NS}/hostile-task/v1")
@dataclass
class HostileTask:
    """A task whose worker carries out `attack`."""

    attack: str


@xmlify(namespace=f"{NS}/tally/v1")
@dataclass
class Tally:
    """Counts one call under a tag."""

    tag: str


@xmlify(namespace=f"{NS}/tallied/v1")
@dataclass
class Tallied:
    tag: str
    n: int


TALLIED: list[str] = []  # the tags the tally tool ran for (in the daemon's process)


async def tally(payload: Tally, meta: HandlerMetadata) -> HandlerResponse:
    TALLIED.append(payload.tag)
    return HandlerResponse.respond(Tallied(tag=payload.tag, n=len(TALLIED)))


def _in_worker() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "agentd.isolation.worker"


def _arm() -> None:
    from agentd.isolation import _agent

    agent_cls, session_cls = _agent.WorkerAgent, _agent.WorkerSession
    real_call, real_leave, real_request = (agent_cls.__call__, agent_cls.leave,
                                           session_cls._request)
    attack: dict[str, Any] = {"name": "", "sent": []}

    async def call(self: Any, payload: Any, meta: HandlerMetadata) -> Any:
        if isinstance(payload, HostileTask):
            attack["name"] = payload.attack
        result = await real_call(self, payload, meta)
        if attack["name"] == "own-output" and result is _agent.SEND_CALLS:
            self.sending = []
            return HandlerResponse.addressed(to_xml(Tally(tag="own")), ["tally"])
        return result

    def leave(self: Any, thread: str) -> dict[str, Any]:
        out = real_leave(self, thread)
        ids, name = out.get("calls"), attack["name"]
        if ids and name == "duplicate":
            out["calls"] = [*ids, ids[0]]
        elif ids and name == "forge":
            out["calls"] = ["forged-1"]
        elif ids and name == "replay":
            if attack["sent"]:
                out["calls"] = [*attack["sent"], *ids]
            attack["sent"] = list(ids)
        return out

    def request(self: Any, op: str, fields: dict[str, Any] | None = None,
                body: bytes = b"") -> Any:
        if op == "record" and attack["name"] == "claim" and not (fields or {}).get("notice"):
            fields = {**(fields or {}), "call_id": "t2", "is_error": True}
        return real_request(self, op, fields, body)

    agent_cls.__call__ = call  # type: ignore[method-assign]
    agent_cls.leave = leave  # type: ignore[method-assign]
    session_cls._request = request  # type: ignore[method-assign]


if _in_worker():
    _arm()
