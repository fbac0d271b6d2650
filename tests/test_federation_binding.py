"""The `tls-exporter` channel binding read from live stdlib TLS connections, and
the organism identity files."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from agentd.bus import make_self_signed
from agentd.federation import (
    ChannelBindingUnavailable,
    IdentityError,
    load_identity,
    parse_public_line,
    tls_exporter,
    write_identity,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    make_self_signed(d / "cert.pem", d / "key.pem")
    return d / "cert.pem", d / "key.pem"


def contexts(pair: tuple[Path, Path], version: ssl.TLSVersion) -> tuple[ssl.SSLContext, ...]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(*pair)
    server.maximum_version = version
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(pair[0])
    return server, client


async def exporters(pair: tuple[Path, Path], version: ssl.TLSVersion) -> tuple[bytes, bytes]:
    server_ctx, client_ctx = contexts(pair, version)
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    got.add_done_callback(lambda f: f.exception())  # read even when the client failed first

    async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            got.set_result(tls_exporter(w.get_extra_info("ssl_object")))
        except Exception as exc:  # the test reads it from the future
            got.set_exception(exc)
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    _r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                          server_hostname="localhost")
    try:
        mine = tls_exporter(w.get_extra_info("ssl_object"))
        return mine, await got
    finally:
        w.close()
        server.close()
        await server.wait_closed()


async def test_both_ends_of_one_connection_agree(pair: tuple[Path, Path]) -> None:
    client, server = await exporters(pair, ssl.TLSVersion.TLSv1_3)
    assert client == server and len(client) == 32


async def test_two_connections_have_different_bindings(pair: tuple[Path, Path]) -> None:
    first, _ = await exporters(pair, ssl.TLSVersion.TLSv1_3)
    second, _ = await exporters(pair, ssl.TLSVersion.TLSv1_3)
    assert first != second


async def test_tls_1_2_is_refused(pair: tuple[Path, Path]) -> None:
    with pytest.raises(ChannelBindingUnavailable, match=r"TLS 1\.3"):
        await exporters(pair, ssl.TLSVersion.TLSv1_2)


def test_identity_round_trip(tmp_path: Path) -> None:
    made = write_identity(tmp_path / "identity.key", "alpha")
    assert (tmp_path / "identity.key").stat().st_mode & 0o777 == 0o600
    loaded = load_identity(tmp_path / "identity.key", "alpha")
    line = loaded.public_line
    assert line.startswith("ssh-ed25519 ") and line.endswith(" alpha")
    assert parse_public_line(line).public_bytes_raw() == made.key.public_key().public_bytes_raw()
    with pytest.raises(IdentityError, match="never overwritten"):
        write_identity(tmp_path / "identity.key", "alpha")


@pytest.mark.parametrize("line", [
    "", "ssh-rsa AAAAB3NzaC1yc2E= x", "ssh-ed25519 !!! x", "ssh-ed25519",
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA== x",
])
def test_bad_public_lines_are_refused(line: str) -> None:
    with pytest.raises(IdentityError):
        parse_public_line(line)


def test_a_readable_identity_key_is_refused(tmp_path: Path) -> None:
    write_identity(tmp_path / "identity.key", "alpha")
    (tmp_path / "identity.key").chmod(0o644)
    with pytest.raises(IdentityError):
        load_identity(tmp_path / "identity.key", "alpha")
