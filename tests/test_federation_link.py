"""Federation links over real TLS WebSockets on loopback: two organisms in one
process, each a `Federation` with its own certificate and identity. Attacks: an
undeclared key, a wrong key, a handshake replayed on a new connection, a relay
(a man in the middle terminating TLS with its own certificate), a wrong path."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agentd.bus import client_context, make_self_signed
from agentd.config import FederationConfig, GatewayConfig, TlsConfig
from agentd.federation import (
    HANDSHAKE_FAILED,
    Federation,
    Handshake,
    Identity,
    Role,
    tls_exporter,
)
from agentd.federation._gateway import LinkState


@dataclass
class Events:
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, kind: str, fields: Mapping[str, str]) -> None:
        self.seen.append((kind, dict(fields)))
        self.changed.set()

    async def wait_for(self, kind: str) -> dict[str, str]:
        async with asyncio.timeout(10):
            while True:
                for k, f in self.seen:
                    if k == kind:
                        return f
                self.changed.clear()
                await self.changed.wait()


@dataclass
class Side:
    identity: Identity
    tls: TlsConfig
    events: Events = field(default_factory=Events)


def side(tmp: Path, name: str) -> Side:
    folder = tmp / name
    make_self_signed(folder / "cert.pem", folder / "key.pem")
    return Side(Identity(name, Ed25519PrivateKey.generate()),
                TlsConfig(cert=folder / "cert.pem", key=folder / "key.pem"))


def gateway(peer: Side, url: str | None = None, key: Identity | None = None) -> GatewayConfig:
    return GatewayConfig(name=peer.identity.name, url=url,
                         public_key=(key or peer.identity).public_line)


def federation(me: Side, *gateways: GatewayConfig) -> Federation:
    config = FederationConfig(listen="127.0.0.1:0", tls=me.tls, handshake_timeout_s=5.0,
                              backoff_initial_s=0.05, backoff_max_s=0.2)
    return Federation(me.identity, config, gateways, me.events)


async def wait_state(fed: Federation, name: str, state: LinkState) -> None:
    link = fed.links[name]
    async with asyncio.timeout(10):
        while link.state is not state:
            link.changed.clear()
            await link.changed.wait()


async def wait_failed_dials(fed: Federation, name: str, count: int) -> None:
    link = fed.links[name]
    async with asyncio.timeout(10):
        while link.attempts < count:
            link.changed.clear()
            await link.changed.wait()


@contextlib.asynccontextmanager
async def running(*feds: Federation) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for fed in feds:
            await fed.close()


def url(fed: Federation, port: int | None = None) -> str:
    return f"wss://127.0.0.1:{port or fed.port}/federation"


async def test_two_organisms_link_up_both_ways(tmp_path: Path) -> None:
    alpha, beta = side(tmp_path, "alpha"), side(tmp_path, "beta")
    b = federation(beta, gateway(alpha))
    await b.start()
    a = federation(alpha, gateway(beta, url(b)))
    await a.start()
    async with running(a, b):
        await wait_state(a, "beta", LinkState.UP)
        await wait_state(b, "alpha", LinkState.UP)
        assert a.status()[0]["direction"] == "out" and b.status()[0]["direction"] == "in"
        assert not alpha.events.seen and not beta.events.seen


async def test_reconnects_after_the_peer_restarts(tmp_path: Path) -> None:
    alpha, beta = side(tmp_path, "alpha"), side(tmp_path, "beta")
    b = federation(beta, gateway(alpha))
    await b.start()
    port = b.port
    a = federation(alpha, gateway(beta, url(b)))
    await a.start()
    async with running(a):
        await wait_state(a, "beta", LinkState.UP)
        await b.close()
        await wait_state(a, "beta", LinkState.DOWN)
        b2 = federation(beta, gateway(alpha))
        b2.config = FederationConfig(listen=f"127.0.0.1:{port}", tls=beta.tls)
        await b2.start()
        async with running(b2):
            await wait_state(a, "beta", LinkState.UP)
            assert a.links["beta"].up_count == 2


async def test_undeclared_key_is_refused(tmp_path: Path) -> None:
    alpha, beta, gamma = side(tmp_path, "alpha"), side(tmp_path, "beta"), side(tmp_path, "gamma")
    b = federation(beta, gateway(alpha))  # beta knows alpha only
    await b.start()
    g = federation(gamma, gateway(beta, url(b)))
    await g.start()
    async with running(g, b):
        event = await beta.events.wait_for("federation-handshake-failed")
        assert "undeclared" in event["cause"] and event["peer"] == "gamma"
        await wait_failed_dials(g, "beta", 1)
        assert g.links["beta"].state is not LinkState.UP


async def test_wrong_key_is_refused(tmp_path: Path) -> None:
    alpha, beta = side(tmp_path, "alpha"), side(tmp_path, "beta")
    other = Identity("alpha", Ed25519PrivateKey.generate())
    b = federation(beta, gateway(alpha, key=other))  # beta declared another key for alpha
    await b.start()
    a = federation(alpha, gateway(beta, url(b)))
    await a.start()
    async with running(a, b):
        event = await beta.events.wait_for("federation-handshake-failed")
        assert "bad signature" in event["cause"]
        await wait_failed_dials(a, "beta", 2)  # and it keeps being refused
        assert b.links["alpha"].state is LinkState.DOWN


async def test_the_peer_is_told_only_the_generic_reason(tmp_path: Path) -> None:
    alpha, beta = side(tmp_path, "alpha"), side(tmp_path, "beta")
    b = federation(beta)  # declares nobody
    await b.start()
    async with running(b):
        ctx = client_context(verify=False)
        async with connect(url(b), ssl=ctx, proxy=None) as ws:
            binding = tls_exporter(ws.transport.get_extra_info("ssl_object"))
            hs = Handshake(Role.DIALER, alpha.identity, binding,
                           {"beta": beta.identity.key.public_key()}, expect="beta")
            for frame in hs.start():
                await ws.send(frame)
            for _ in range(2):
                for frame in hs.receive(await ws.recv(decode=False)):
                    await ws.send(frame)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1008, HANDSHAKE_FAILED)


async def test_replayed_handshake_on_a_new_connection_fails(tmp_path: Path) -> None:
    """A recording of alpha's frames from a successful handshake, replayed by an
    attacker over a fresh TLS connection, does not authenticate."""
    alpha, beta = side(tmp_path, "alpha"), side(tmp_path, "beta")
    b = federation(beta, gateway(alpha))
    await b.start()
    async with running(b):
        ctx = client_context(verify=False)
        recorded: list[bytes] = []
        async with connect(url(b), ssl=ctx, proxy=None) as ws:
            binding = tls_exporter(ws.transport.get_extra_info("ssl_object"))
            hs = Handshake(Role.DIALER, alpha.identity, binding,
                           {"beta": beta.identity.key.public_key()}, expect="beta")
            recorded += hs.start()
            await ws.send(recorded[0])
            while not hs.done:
                for frame in hs.receive(await ws.recv(decode=False)):
                    recorded.append(frame)
                    await ws.send(frame)
        await wait_state(b, "alpha", LinkState.DOWN)
        async with connect(url(b), ssl=ctx, proxy=None) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                for frame in recorded:
                    await ws.send(frame)
                while True:
                    await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.reason == HANDSHAKE_FAILED
        event = await beta.events.wait_for("federation-handshake-failed")
        assert "bad signature" in event["cause"]
        assert b.links["alpha"].up_count == 1


async def relay(listen_ctx: ssl.SSLContext, target_port: int) -> asyncio.Server:
    """A man in the middle: terminates TLS with its own certificate and opens its
    own TLS connection to the target, copying the bytes in between."""
    upstream_ctx = client_context(verify=False)

    async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", target_port, ssl=upstream_ctx)
        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    return await asyncio.start_server(handle, "127.0.0.1", 0, ssl=listen_ctx)


async def test_relayed_handshake_fails(tmp_path: Path) -> None:
    alpha, beta, mallory = side(tmp_path, "alpha"), side(tmp_path, "beta"), side(tmp_path, "m")
    b = federation(beta, gateway(alpha))
    await b.start()
    mitm_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    mitm_ctx.load_cert_chain(mallory.tls.cert, mallory.tls.key)
    proxy = await relay(mitm_ctx, b.port)
    a = federation(alpha, gateway(beta, url(b, proxy.sockets[0].getsockname()[1])))
    await a.start()
    try:
        async with running(a, b):
            event = await alpha.events.wait_for("federation-handshake-failed")
            assert "another TLS channel" in event["cause"]  # alpha rejects beta's proof
            await wait_failed_dials(a, "beta", 2)
            assert a.links["beta"].up_count == 0 and b.links["alpha"].up_count == 0
    finally:
        proxy.close()


async def test_other_paths_are_not_found(tmp_path: Path) -> None:
    beta = side(tmp_path, "beta")
    b = federation(beta)
    await b.start()
    async with running(b):
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"wss://127.0.0.1:{b.port}/bus",
                               ssl=client_context(verify=False), proxy=None):
                pass
        assert refused.value.response.status_code == 404


async def test_a_silent_peer_times_out(tmp_path: Path) -> None:
    beta = side(tmp_path, "beta")
    config = FederationConfig(listen="127.0.0.1:0", tls=beta.tls, handshake_timeout_s=0.2)
    b = Federation(beta.identity, config, (), beta.events)
    await b.start()
    async with running(b):
        async with connect(url(b), ssl=client_context(verify=False), proxy=None) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.reason == HANDSHAKE_FAILED
        assert (await beta.events.wait_for("federation-handshake-failed"))["cause"] == "timed out"
