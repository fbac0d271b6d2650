"""Shared pieces for the bus tests: a real server (TLS WebSocket + ClientAuth + the
real Pump, optionally on a real Kernel whose durable outbox the bus replays) on
127.0.0.1 port 0, a listener gated by an asyncio.Event the test controls, and a
clock the tests move forward (so TOTP steps and lockouts do not need real waiting).
No test lives here."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import pyotp
import yaml

from agentd import HandlerMetadata, HandlerResponse, xmlify
from agentd._daemon import KernelOutbox
from agentd._routing import Routing
from agentd._wiring import pump_options
from agentd.bus import BusServer, ClientAuth, make_self_signed, totp_code
from agentd.client import BusClient
from agentd.config import AuthConfig, BusConfig, MetaConfig, TlsConfig, load_config_text
from agentd.kernel import Kernel
from agentd.pump import Pump

GATE_NS = "https://xml-pipeline.org/ns/test/gate/v1"


@xmlify(namespace=GATE_NS)
@dataclass
class Gate:
    """Waits for the test to open the gate, then answers with n."""

    n: Annotated[int, "a number echoed back"]


@xmlify(namespace="https://xml-pipeline.org/ns/test/gated/v1")
@dataclass
class Gated:
    n: Annotated[int, "the number"]


GATE: dict[str, Any] = {"event": None, "entered": 0, "watch": None}


async def gate(payload: Gate, meta: HandlerMetadata) -> HandlerResponse:
    GATE["entered"] += 1
    GATE.setdefault("times", []).append(asyncio.get_running_loop().time())
    watch = GATE["watch"]
    if watch is not None:
        watch.set()
    event = GATE["event"]
    if event is not None:
        await event.wait()
    return HandlerResponse.respond(Gated(n=payload.n))


ORGANISM = """
organism: {name: bus-test}
state_dir: state
pump: {max_concurrency: 32, handler_timeout_s: 30, max_hops: 16}
profiles:
  public: {listeners: [calculator.add, echo, relay, gate]}
  admin: {listeners: all}
listeners:
  - name: calculator.add
    payload_class: agentd.tools.calculator:Add
    response_class: agentd.tools.calculator:Sum
    handler: agentd.tools.calculator:add
    description: Adds two integers.
  - name: echo
    payload_class: agentd.tools.echo:Echo
    response_class: agentd.tools.echo:EchoReply
    handler: agentd.tools.echo:echo
    description: Echoes text back.
  - name: relay
    payload_class: agentd.tools.relay:Relay
    response_class: agentd.tools.calculator:Sum
    handler: agentd.tools.relay:relay
    description: Asks the calculator and passes the answer back.
    peers: [calculator.add]
  - name: gate
    payload_class: tests.test_bus_support:Gate
    response_class: tests.test_bus_support:Gated
    handler: tests.test_bus_support:gate
    description: Waits for the test.
"""


async def gate_entered(n: int, timeout: float = 5.0) -> None:
    """Wait until the gate handler has been entered `n` times."""
    async with asyncio.timeout(timeout):
        while GATE["entered"] < n:
            watch = GATE["watch"] = asyncio.Event()
            await watch.wait()


class Clock:
    """Wall-clock seconds that only move when the test says so."""

    def __init__(self, start: float | None = None) -> None:
        import time

        self.now = float(start if start is not None else time.time())

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Rig:
    bus: BusServer
    auth: ClientAuth
    pump: Pump
    secrets: dict[str, str]
    clock: Clock
    home: Path
    auth_cfg: AuthConfig
    submitted: list[tuple[str, bytes]]
    kernel: Kernel | None = None

    @property
    def url(self) -> str:
        return f"wss://127.0.0.1:{self.bus.port}/bus"

    @property
    def cafile(self) -> Path:
        return self.home / "tls" / "cert.pem"

    def code(self, client: str, offset: int = 0) -> str:
        """The TOTP code the server expects now (its clock), `offset` steps away."""
        return totp_code(self.secrets[client], int(self.clock() // 30) + offset)

    def next_step(self) -> None:
        self.clock.advance(30)

    def client(self, client: str = "alice", **kw: Any) -> BusClient:
        if "session" not in kw and "totp" not in kw:
            kw["totp"] = self.code(client)
        kw.setdefault("cafile", self.cafile)
        return BusClient(self.url, client, secret=self.secrets.get(client), **kw)

    async def login(self, client: str = "alice", **kw: Any) -> BusClient:
        """A connected client; moves the clock one TOTP step on so codes never repeat."""
        c = self.client(client, **kw)
        await c.connect()
        if "session" not in kw:
            self.next_step()
        return c


def write_clients(path: Path, secrets: dict[str, str], profile: str = "public") -> None:
    body = {"clients": {c: {"totp_secret": s, "profile": profile} for c, s in secrets.items()}}
    path.write_text(yaml.safe_dump(body))
    os.chmod(path, 0o600)


async def start_rig(
    home: Path,
    *,
    clients: tuple[str, ...] = ("alice", "bob"),
    bus: dict[str, Any] | None = None,
    auth: dict[str, Any] | None = None,
    kernel: bool = False,
    submit_hook: Callable[[Callable[[str, bytes], Awaitable[object]]], Any] | None = None,
    server_kw: dict[str, Any] | None = None,
    meta: MetaConfig | None = None,
) -> Rig:
    home.mkdir(parents=True, exist_ok=True)
    config = load_config_text(ORGANISM, base_dir=home)
    tls = home / "tls"
    if not (tls / "cert.pem").exists():
        make_self_signed(tls / "cert.pem", tls / "key.pem")
    secrets = {c: pyotp.random_base32() for c in clients}
    write_clients(home / "clients.yaml", secrets)
    auth_cfg = replace(AuthConfig(clients_file=home / "clients.yaml"), **(auth or {}))
    bus_cfg = replace(
        BusConfig(host="127.0.0.1", port=0, tls=TlsConfig(tls / "cert.pem", tls / "key.pem")),
        **(bus or {}),
    )
    clock = Clock()
    client_auth = ClientAuth.load(home / "clients.yaml", config.state_dir, auth_cfg, clock=clock)
    holder: dict[str, Any] = {}
    submitted: list[tuple[str, bytes]] = []

    def deliver(client: str, thread: str, data: bytes, outbox_id: int | None = None) -> None:
        holder["bus"].deliver(client, thread, data, outbox_id)

    store = await Kernel.open(config.state_dir) if kernel else None
    options = pump_options(config)
    if meta is not None:
        options = replace(options, meta=meta)
    pump = Pump(Routing.build(config), client_auth.profiles(), deliver, options, store)
    await pump.start()

    async def submit(client: str, data: bytes) -> object:
        submitted.append((client, data))
        return await pump.submit(client, data)

    def submit_nowait(client: str, data: bytes) -> object | None:
        result = pump.submit_nowait(client, data)
        if result is not None:
            submitted.append((client, data))
        return result

    # As the daemon wires it: the task-free path first. A test that hooks `submit`
    # (to hold envelopes back) gets every envelope through its hook instead.
    server = BusServer(
        bus_cfg, client_auth, submit_hook(submit) if submit_hook else submit,
        KernelOutbox(store) if store is not None else None,
        **{"submit_nowait": None if submit_hook else submit_nowait, **(server_kw or {})},
    )
    holder["bus"] = server
    await server.start()
    rig = Rig(server, client_auth, pump, secrets, clock, home, auth_cfg, submitted, store)
    holder["rig"] = rig
    return rig


async def stop_rig(rig: Rig) -> None:
    await rig.bus.close()
    await rig.pump.stop()
    if rig.kernel is not None:
        await rig.kernel.close()
