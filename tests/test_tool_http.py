"""http-fetch attacked: private, metadata and odd spellings of loopback are refused,
DNS rebinding finds nothing to swap, redirects are re-checked. No test here can
reach a real private or metadata address: the attack tests go through a recording
transport that answers itself, and the one real connection is to a TLS server on
loopback that the test allows explicitly."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from agentd.bus import make_self_signed
from agentd.config.tools import HttpFetchTool
from agentd.tools import Denied
from agentd.tools.content import Encoding
from agentd.tools.http import (
    Fetch,
    HttpFetcher,
    Method,
    address_refusal,
    host_allowed,
    literal_address,
)

PUBLIC = "93.184.215.14"


def config(**kw: object) -> HttpFetchTool:
    base: dict[str, object] = {"kind": "http-fetch", "allow_hosts": ("*.example", "ok.test"),
                               "allow_schemes": ("https", "http")}
    return HttpFetchTool(**{**base, **kw})  # type: ignore[arg-type]


Answer = tuple[int, dict[str, str], bytes]


@dataclass
class Recorder:
    """A transport that answers every request itself and records where it was
    sent: the stand-in for the network."""

    answers: dict[str, Answer] = field(default_factory=dict)
    seen: list[httpx.Request] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        status, headers, body = self.answers.get(
            request.url.path, (200, {"content-type": "text/plain"}, b"hello"))
        # A stream, as the network gives: not a response read in advance.
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(body))

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


class StubResolver:
    """Answers from a table; a list of answers per name is used one per call."""

    def __init__(self, table: dict[str, list[list[str]]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        answers = self.table[host]
        return answers.pop(0) if len(answers) > 1 else answers[0]


def fetcher(recorder: Recorder, resolver: StubResolver | None = None,
            **kw: object) -> HttpFetcher:
    resolver = resolver or StubResolver({"a.example": [[PUBLIC]], "ok.test": [[PUBLIC]]})
    return HttpFetcher(config(**kw), resolver=resolver, transport=recorder.transport)


async def denied(tool: HttpFetcher, url: str) -> Denied:
    with pytest.raises(Denied) as info:
        await tool.fetch(Fetch(url=url))
    return info.value


# --- pure rules --------------------------------------------------------------------


@pytest.mark.parametrize(("address", "cause"), [
    ("169.254.169.254", "cloud metadata address"),
    ("100.100.100.200", "cloud metadata address"),
    ("fd00:ec2::254", "cloud metadata address"),
    ("127.0.0.1", "loopback address"),
    ("::1", "loopback address"),
    ("::ffff:127.0.0.1", "loopback address"),
    ("::ffff:169.254.169.254", "cloud metadata address"),
    ("64:ff9b::a00:1", "private address"),
    ("0.0.0.0", "unspecified address"),
    ("::", "unspecified address"),
    ("10.1.2.3", "private address"),
    ("172.16.0.1", "private address"),
    ("192.168.1.1", "private address"),
    ("fc00::1", "private address"),
    ("169.254.1.1", "link-local address"),
    ("fe80::1", "link-local address"),
    ("100.64.0.1", "shared (CGNAT) address"),
    ("224.0.0.1", "multicast address"),
    ("ff02::1", "multicast address"),
    ("240.0.0.1", "reserved address"),
    ("2002:a00:1::1", "private address"),  # 6to4 carrying 10.0.0.1
    ("2002:a9fe:a9fe::1", "cloud metadata address"),  # 6to4 carrying 169.254.169.254
    ("192.0.0.9", "reserved address"),  # IETF protocol assignments
    ("192.88.99.1", "reserved address"),  # the 6to4 relay anycast
    ("fec0::1", "reserved address"),  # site-local
])
def test_non_public_addresses_are_refused(address: str, cause: str) -> None:
    assert address_refusal(ipaddress.ip_address(address)) == cause


def test_public_addresses_pass_and_allow_private_opens_a_range() -> None:
    assert address_refusal(ipaddress.ip_address(PUBLIC)) is None
    assert address_refusal(ipaddress.ip_address("2606:4700::1")) is None
    nets = (ipaddress.ip_network("10.0.0.0/8"),)
    assert address_refusal(ipaddress.ip_address("10.1.2.3"), nets) is None
    assert address_refusal(ipaddress.ip_address("::ffff:10.1.2.3"), nets) is None
    assert address_refusal(ipaddress.ip_address("11.0.0.1"), nets) is None


@pytest.mark.parametrize(("host", "address"), [
    ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
    ("127.1", "127.0.0.1"), ("[::ffff:127.0.0.1]", "::ffff:7f00:1"),
    ("a.example", None),
])
def test_numeric_host_spellings_are_read_as_addresses(host: str, address: str | None) -> None:
    got = literal_address(host)
    assert (None if got is None else str(got)) == address


@pytest.mark.parametrize(("host", "ok"), [
    ("a.example", True), ("A.Example.", True), ("x.y.example", True), ("example", False),
    ("evilexample", False), ("ok.test", True), ("x.ok.test", False), ("ok.test.evil", False),
])
def test_host_patterns(host: str, ok: bool) -> None:
    assert host_allowed(host, ("*.example", "ok.test")) is ok


# --- the tool against a recording transport -----------------------------------------


async def test_the_request_goes_to_the_checked_address_naming_the_host() -> None:
    rec = Recorder()
    fetched = await fetcher(rec).fetch(Fetch(url="https://a.example/page?q=1"))
    assert fetched.status == 200 and fetched.body == "hello"
    assert fetched.encoding is Encoding.UTF8 and not fetched.truncated
    sent = rec.seen[0]
    assert str(sent.url) == f"https://{PUBLIC}/page?q=1"
    assert sent.headers["host"] == "a.example"
    assert sent.extensions["sni_hostname"] == "a.example"


@pytest.mark.parametrize(("url", "cause"), [
    ("https://169.254.169.254/latest/meta-data/", "cloud metadata address"),
    ("https://100.100.100.200/", "cloud metadata address"),
    ("https://0.0.0.0/", "unspecified address"),
    ("https://2130706433/", "loopback address"),
    ("https://0x7f.1/", "loopback address"),
    ("https://0177.0.0.1/", "malformed URL"),
])
async def test_addresses_listed_in_allow_hosts_are_still_refused(url: str, cause: str) -> None:
    rec = Recorder()
    tool = fetcher(rec, allow_hosts=("169.254.169.254", "100.100.100.200", "0.0.0.0",
                                     "2130706433", "0x7f.1", "0177.0.0.1"))
    assert (await denied(tool, url)).cause == cause
    assert rec.seen == []


PUBLIC_V6 = "2606:4700:4700::1111"


@pytest.mark.parametrize("listed", [PUBLIC_V6, f"[{PUBLIC_V6}]", "2606:4700:4700:0:0:0:0:1111",
                                    "[2606:4700:4700::1111]".upper()])
async def test_an_ipv6_literal_in_allow_hosts_is_fetched(listed: str) -> None:
    rec = Recorder()
    tool = fetcher(rec, allow_hosts=(listed,))
    fetched = await tool.fetch(Fetch(url="https://[2606:4700:4700:0::1111]:8443/x"))
    assert fetched.status == 200
    sent = rec.seen[0]
    assert str(sent.url) == f"https://[{PUBLIC_V6}]:8443/x"
    assert sent.headers["host"] == f"[{PUBLIC_V6}]:8443"
    assert (await denied(tool, "https://[2606:4700:4700::1112]/")).cause == "host not allowed"


@pytest.mark.parametrize(("listed", "url", "cause"), [
    ("::1", "http://[::1]/", "loopback address"),
    ("[fd00::7]", "http://[fd00::7]/", "private address"),
    ("::ffff:169.254.169.254", "http://[::ffff:169.254.169.254]/", "cloud metadata address"),
])
async def test_an_ipv6_literal_in_allow_hosts_still_obeys_the_address_rules(
        listed: str, url: str, cause: str) -> None:
    rec = Recorder()
    assert (await denied(fetcher(rec, allow_hosts=(listed,)), url)).cause == cause
    assert rec.seen == []


async def test_ipv4_mapped_loopback_literal_is_refused() -> None:
    rec = Recorder()
    assert (await denied(fetcher(rec), "https://[::ffff:127.0.0.1]/")).cause == \
        "host not allowed"
    resolver = StubResolver({"a.example": [["::ffff:127.0.0.1"]]})
    assert (await denied(fetcher(rec, resolver), "https://a.example/")).cause == \
        "loopback address"
    assert rec.seen == []


async def test_a_name_resolving_to_loopback_is_refused() -> None:
    rec = Recorder()
    resolver = StubResolver({"a.example": [["127.0.0.1"]]})
    assert (await denied(fetcher(rec, resolver), "https://a.example/")).fields["address"] \
        == "127.0.0.1"
    assert rec.seen == []


async def test_one_private_answer_among_public_ones_refuses_the_name() -> None:
    rec = Recorder()
    resolver = StubResolver({"a.example": [[PUBLIC, "10.0.0.7"]]})
    assert (await denied(fetcher(rec, resolver), "https://a.example/")).cause == \
        "private address"


async def test_dns_rebinding_public_then_loopback_resolves_once_and_connects_to_the_public(
) -> None:
    rec = Recorder()
    resolver = StubResolver({"a.example": [[PUBLIC], ["127.0.0.1"]]})
    await fetcher(rec, resolver).fetch(Fetch(url="https://a.example/"))
    assert resolver.calls == ["a.example"]
    assert [r.url.host for r in rec.seen] == [PUBLIC]


async def test_redirect_into_private_space_is_refused() -> None:
    rec = Recorder(answers={"/go": (302, {
        "location": "https://b.example/inside"}, b"")})
    resolver = StubResolver({"a.example": [[PUBLIC]], "b.example": [["192.168.0.10"]]})
    assert (await denied(fetcher(rec, resolver), "https://a.example/go")).cause == \
        "private address"
    assert [r.url.path for r in rec.seen] == ["/go"]


@pytest.mark.parametrize(("location", "cause"), [
    ("http://169.254.169.254/latest/", "host not allowed"),
    ("https://evil.test/", "host not allowed"),
    ("file:///etc/passwd", "scheme not allowed"),
])
async def test_redirects_are_checked_like_the_first_request(location: str, cause: str) -> None:
    rec = Recorder(answers={"/go": (301, {"location": location}, b"")})
    assert (await denied(fetcher(rec), "https://a.example/go")).cause == cause


async def test_redirects_stop_at_max_redirects() -> None:
    rec = Recorder(answers={"/loop": (302, {"location": "/loop"}, b"")})
    assert (await denied(fetcher(rec, max_redirects=2), "https://a.example/loop")).cause \
        == "too many redirects"
    assert len(rec.seen) == 3


async def test_a_followed_redirect_turns_post_into_get() -> None:
    rec = Recorder(answers={"/form": (303, {"location": "/done"}, b"")})
    await fetcher(rec).fetch(Fetch(url="https://a.example/form", method=Method.POST,
                                   body="x=1"))
    assert [(r.method, r.url.path, r.content) for r in rec.seen] == [
        ("POST", "/form", b"x=1"), ("GET", "/done", b"")]


@pytest.mark.parametrize(("url", "cause"), [
    ("http://a.example/", "scheme not allowed"),
    ("ftp://a.example/", "scheme not allowed"),
    ("https://user:pw@a.example/", "credentials in URL"),
    ("https://evil.test/", "host not allowed"),
    ("https://a.example.evil.test/", "host not allowed"),
])
async def test_url_rules(url: str, cause: str) -> None:
    rec = Recorder()
    assert (await denied(fetcher(rec, allow_schemes=("https",)), url)).cause == cause
    assert rec.seen == []


async def test_the_body_is_cut_at_max_bytes() -> None:
    rec = Recorder(answers={"/big": (200, {"content-type": "image/png"}, b"\x00" * 5000)})
    fetched = await fetcher(rec, max_bytes=100).fetch(Fetch(url="https://a.example/big"))
    assert fetched.truncated and fetched.encoding is Encoding.BASE64
    assert len(fetched.body) == 136  # base64 of 100 bytes


# --- one real connection: TLS on loopback, allowed explicitly -------------------------


@dataclass
class Seen:
    sni: list[str | None] = field(default_factory=list)
    heads: list[bytes] = field(default_factory=list)


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[int, Path, Seen]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    make_self_signed(cert, key, ["fetch.test"])
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    seen = Seen()
    ctx.sni_callback = lambda sock, name, _ctx: seen.sni.append(name)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.heads.append(head)
        body = b"served over TLS"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield port, cert, seen


async def test_real_tls_keeps_the_server_name_and_host_while_connecting_to_the_address(
    tls_server: tuple[int, Path, Seen],
) -> None:
    port, cert, seen = tls_server
    resolver = StubResolver({"fetch.test": [["127.0.0.1"]]})
    tool = HttpFetcher(config(allow_hosts=("fetch.test",), allow_private=("127.0.0.1/32",)),
                       resolver=resolver, ssl_context=ssl.create_default_context(cafile=cert))
    fetched = await tool.fetch(Fetch(url=f"https://fetch.test:{port}/x"))
    assert (fetched.status, fetched.body) == (200, "served over TLS")
    assert seen.sni == ["fetch.test"]
    assert f"host: fetch.test:{port}".encode() in seen.heads[0].lower()


async def test_real_tls_loopback_without_allow_private_is_refused_before_connecting(
    tls_server: tuple[int, Path, Seen],
) -> None:
    port, cert, seen = tls_server
    resolver = StubResolver({"fetch.test": [["127.0.0.1"]]})
    tool = HttpFetcher(config(allow_hosts=("fetch.test",)), resolver=resolver,
                       ssl_context=ssl.create_default_context(cafile=cert))
    assert (await denied(tool, f"https://fetch.test:{port}/x")).cause == "loopback address"
    assert seen.heads == [] and seen.sni == []
