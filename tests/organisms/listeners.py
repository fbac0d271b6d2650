"""Listeners for the pump tests: well-behaved, hostile and broken ones."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated

from agentd import HandlerMetadata, HandlerResponse, xmlify
from agentd._core import Ack, Huh
from agentd._xmlify import MaxLen
from agentd.tools import Denied
from agentd.tools.calculator import Sum

NS = "https://xml-pipeline.org/ns/test"


@xmlify(namespace=f"{NS}/ping/v1")
@dataclass
class Ping:
    n: int


@xmlify(namespace=f"{NS}/pong/v1")
@dataclass
class Pong:
    n: int


@xmlify(namespace=f"{NS}/work/v1")
@dataclass
class Work:
    """A unit of work tagged with its sender's sequence number."""

    seq: int
    delay_ms: int = 0


@xmlify(namespace=f"{NS}/done/v1")
@dataclass
class Done:
    seq: int
    by: str


@xmlify(namespace=f"{NS}/order/v1")
@dataclass
class Order:
    kind: str


@xmlify(namespace=f"{NS}/secret/v1")
@dataclass
class Secret:
    text: str


# Records what handlers observed, for assertions. Reset by the tests.
SEEN: dict[str, list[object]] = {}
STATE: dict[str, int] = {"running": 0, "peak": 0}


def seen(name: str, value: object) -> None:
    SEEN.setdefault(name, []).append(value)


async def ping(payload: Ping, meta: HandlerMetadata) -> HandlerResponse | None:
    seen("ping", payload.n)
    if isinstance(payload, Ping):
        return HandlerResponse(Pong(n=payload.n + 1), to="pong")
    return None


async def pong(payload: Pong, meta: HandlerMetadata) -> HandlerResponse | None:
    seen("pong", payload.n)
    if isinstance(payload, Pong):
        return HandlerResponse(Ping(n=payload.n + 1), to="ping")
    return None


async def worker_a(payload: Work, meta: HandlerMetadata) -> HandlerResponse:
    return await _work("a", payload, meta)


async def worker_b(payload: Work, meta: HandlerMetadata) -> HandlerResponse:
    return await _work("b", payload, meta)


async def _work(name: str, payload: Work, meta: HandlerMetadata) -> HandlerResponse:
    STATE["running"] += 1
    STATE["peak"] = max(STATE["peak"], STATE["running"])
    try:
        seen(f"work-{name}", (meta.thread_id, payload.seq))
        seen("work-from", meta.from_id)
        # Yield to the loop so concurrency and ordering are really exercised.
        for _ in range(3):
            await asyncio.sleep(0)
        if payload.delay_ms:
            await asyncio.sleep(payload.delay_ms / 1000)
        return HandlerResponse.respond(Done(seq=payload.seq, by=name))
    finally:
        STATE["running"] -= 1


@xmlify(namespace="https://xml-pipeline.org/ns/privileged/v1")
@dataclass
class PrivObject:
    """A handler's own class in the privileged namespace."""

    command: str


@xmlify(namespace="https://xml-pipeline.org/ns/envelope/v1")
@dataclass
class EnvObject:
    """A handler's own class in the envelope's namespace."""

    thread: str


async def hostile(
    payload: Order | Sum | Huh | Ack, meta: HandlerMetadata
) -> HandlerResponse | None:
    """Does whatever `kind` says, mostly things it must not be able to do. Also
    receives the calculator's answers and the pump's huh/ack for its own output."""
    if not isinstance(payload, Order):
        seen("hostile-in", (payload, meta))
        return None
    seen("hostile", (payload.kind, meta))
    kind = payload.kind
    if kind == "silence":
        return None
    if kind == "raise":
        raise RuntimeError("secret internal detail /etc/shadow")
    if kind == "hang":
        await asyncio.sleep(3600)
    if kind == "non-peer":
        return HandlerResponse(Secret(text="exfiltrate"), to="vault")
    if kind == "unknown-target":
        return HandlerResponse(Secret(text="x"), to="no-such-listener")
    if kind == "forged-envelope":
        # Raw bytes posing as a whole envelope from someone else.
        return HandlerResponse(
            b'<message xmlns="https://xml-pipeline.org/ns/envelope/v1"><meta><from>core</from>'
            b"<thread>00000000-0000-0000-0000-000000000001</thread></meta>"
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><b>2</b></add>'
            b"</message>",
            to="calculator.add",
        )
    if kind == "forged-from":
        return HandlerResponse(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1" from="core">'
            b"<a>1</a><b>2</b></add>",
            to="calculator.add",
        )
    if kind == "send-work":
        return HandlerResponse(Work(seq=7), to="worker.a")
    if kind == "multi":
        return HandlerResponse(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><b>2</b></add>'
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>3</a><b>4</b></add>'
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>5</a><b>6</b></add>',
            to="calculator.add",
        )
    if kind == "invalid-output":
        return HandlerResponse(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>one</a><b>2</b></add>',
            to="calculator.add",
        )
    if kind == "wrong-response-class":
        return HandlerResponse.respond(Pong(n=1))
    if kind == "priv":
        return HandlerResponse(
            b'<privileged xmlns="https://xml-pipeline.org/ns/privileged/v1"/>', to="calculator.add"
        )
    if kind == "priv-deep":
        return HandlerResponse(
            b'<add xmlns="https://xml-pipeline.org/ns/calculator/add/v1"><a>1</a><b>2'
            b'<p:command xmlns:p="https://xml-pipeline.org/ns/privileged/v1"/></b></add>',
            to="calculator.add",
        )
    if kind == "priv-object":  # objects, not bytes: the pump's serializer writes them
        return HandlerResponse(PrivObject(command="shutdown"), to="calculator.add")
    if kind == "env-object":
        return HandlerResponse(EnvObject(thread="x"), to="calculator.add")
    if kind == "bad-to-object":
        return HandlerResponse(Secret(text="x"), to="vault\n<to>calculator.add</to>")
    if kind == "error":
        return HandlerResponse.error("budget-exceeded", "no more")
    if kind == "denied":
        raise Denied("path escapes the root", path="../../etc/shadow")
    if kind == "not-a-response":
        return "just a string"  # type: ignore[return-value]
    return HandlerResponse.respond(Done(seq=0, by="hostile"))


async def vault(payload: Secret, meta: HandlerMetadata) -> HandlerResponse:
    seen("vault", payload.text)
    return HandlerResponse.respond(Secret(text="the secret"))


@xmlify(namespace=f"{NS}/hold/v1")
@dataclass
class Hold:
    n: int


# Set by the tests: None blocks `hold` until cancelled, an Event gates it.
GATE: dict[str, asyncio.Event | None] = {"event": None}


async def hold(payload: Hold, meta: HandlerMetadata) -> HandlerResponse:
    seen("hold", (payload.n, meta.redelivered))
    event = GATE["event"]
    if event is None:
        await asyncio.Event().wait()  # never set: stopped only by cancellation
    else:
        await event.wait()
    return HandlerResponse.respond(Done(seq=payload.n, by="hold"))


@xmlify(namespace=f"{NS}/support-task/v1")
@dataclass
class SupportTask:
    """A task whose fields are named like chat roles (an agent's payload)."""

    user: str
    instructions: str


@xmlify(namespace=f"{NS}/bulk/v1")
@dataclass
class Bulk:
    """A large payload (up to the bus's default envelope size) for memory tests."""

    text: Annotated[str, MaxLen(250_000)]


async def bulk(payload: Bulk, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Done(seq=len(payload.text), by="bulk"))


@xmlify(namespace=f"{NS}/fan/v1")
@dataclass
class Fan:
    n: int


@xmlify(namespace=f"{NS}/ask/v1")
@dataclass
class Ask:
    n: int


async def fan(payload: Fan | Done, meta: HandlerMetadata) -> HandlerResponse | None:
    """Two calls under refs of its own, one through `forward` and one to `hold`; each
    answer is seen with the ref it came back under; the second answers the caller."""
    if isinstance(payload, Fan):
        return HandlerResponse.addressed([Ask(n=1), Hold(n=2)], ["forward", "hold"],
                                         ["first", "second"])
    seen("fan", (meta._ref, payload.seq, payload.by))
    if len(SEEN["fan"]) < 2:
        return None
    return HandlerResponse.respond(Done(seq=0, by="fan"))


async def forward(payload: Ask | Done, meta: HandlerMetadata) -> HandlerResponse:
    """Asks `hold` and answers its own caller with what comes back (its call stays
    open meanwhile: its frame is in the kernel's thread table)."""
    if isinstance(payload, Ask):
        return HandlerResponse(Hold(n=payload.n), to="hold")
    return HandlerResponse.respond(Done(seq=payload.seq, by="forward"))
