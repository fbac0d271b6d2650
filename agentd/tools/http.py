"""The `http-fetch` tool: one HTTP request to an allowed host, never into private space.

For every hop (the first request and each redirect) the URL is checked as text
(scheme, no credentials, host in `allow_hosts`), the host is resolved ONCE, every
address it resolves to is checked (`address_refusal`), and the request is sent to
the checked address itself: the URL's host is replaced by the address, while the
`Host` header and the TLS server name (SNI, and so certificate verification) keep
the name. Nothing resolves the name a second time, so DNS rebinding (a public
answer for the check, a private one for the connect) has nothing to swap.

Numeric spellings of IPv4 (`2130706433`, `0177.0.0.1`, `0x7f.1`) are read the way
`inet_aton` reads them before any check, IPv4-mapped and NAT64 IPv6 addresses are
checked as the IPv4 address they carry, and proxies from the environment are never
used. The response is read up to `max_bytes` (`truncated` says so); the whole call,
redirects included, ends at `timeout_s`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

import httpx

from agentd._errors import Denied
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import MaxLen, XmlName, xmlify
from agentd.tools.beneath import shown
from agentd.tools.content import Encoding, as_base64, as_xml_text, xml_safe
from agentd.tools.kinds import Handler, LoadedTool

NS = "https://xml-pipeline.org/ns/tools/http-fetch/v1"
_URL_CHARS = 8192
_BODY_CHARS = 64 * 1024 * 1024

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# (host, port) -> the addresses it resolves to; injected by tests.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

# Cloud metadata services: refused with their own cause, whatever else they are.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254",
))
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_6TO4 = ipaddress.ip_network("2002::/16")  # carries an IPv4 address in bits 16-48
# Not global, whatever this Python's `ipaddress` tables say (they changed in 3.11.10,
# 3.12.4 and 3.13): IETF protocol assignments, the 6to4 relay anycast, site-local.
_NOT_GLOBAL = (ipaddress.ip_network("192.0.0.0/24"), ipaddress.ip_network("192.88.99.0/24"),
               ipaddress.ip_network("fec0::/10"))
_NUMERIC_V4 = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}", re.I)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_TEXTUAL = re.compile(r"text/.*|application/(json|xml|javascript|x-www-form-urlencoded)"
                      r"|application/[^;]*\+(json|xml)", re.I)


class Method(Enum):
    GET = "GET"
    POST = "POST"


@xmlify(namespace=NS, tag="fetch")
@dataclass
class Fetch:
    """Fetches a URL from one of the hosts this tool allows."""

    url: Annotated[str, MaxLen(_URL_CHARS), "an http(s) URL"]
    method: Annotated[Method, "GET (default) or POST"] | None = None
    body: Annotated[str, MaxLen(_BODY_CHARS), "the request body for POST (UTF-8)"] | None = None


@xmlify(namespace=NS, tag="fetched")
@dataclass
class Fetched:
    """The response: status, content type, and the body (text, or base64)."""

    status: int
    content_type: Annotated[str, MaxLen(1024), XmlName("content-type")]
    encoding: Encoding
    body: Annotated[str, MaxLen(_BODY_CHARS)]
    truncated: Annotated[bool, "true when the body was cut at the tool's max_bytes"]


# --- pure decisions ----------------------------------------------------------------


def literal_address(host: str) -> Address | None:
    """The address a host names by itself (an IP literal in any spelling the C
    library would accept), or None for a name that needs resolving."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_V4.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            raise Denied("malformed numeric host", host=shown(host)) from None
    return None


def address_refusal(address: Address, allow_private: Sequence[Network] = ()) -> str | None:
    """Why the tool must not connect to `address`, or None if it may."""
    if any(address in net for net in allow_private if net.version == address.version):
        return None
    if isinstance(address, ipaddress.IPv6Address):
        carried = address.ipv4_mapped or (
            ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else
            ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF) if address in _6TO4
            else None)
        if carried is not None:
            return address_refusal(carried, allow_private)
    if address in METADATA:
        return "cloud metadata address"
    if address.is_unspecified:
        return "unspecified address"
    if address.is_loopback:
        return "loopback address"
    if address.is_link_local:
        return "link-local address"
    if address.is_multicast:
        return "multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address in _CGNAT:
        return "shared (CGNAT) address"
    if address.is_reserved or any(address in net for net in _NOT_GLOBAL
                                  if net.version == address.version):
        return "reserved address"
    if address.is_private:
        return "private address"
    if not address.is_global:
        return "reserved address"
    return None


def host_allowed(host: str, patterns: Sequence[str]) -> bool:
    """Exact names, or `*.suffix` for any name below the suffix (not the suffix
    itself), or IPv6 literals (any spelling: compared compressed). Case and a trailing
    dot do not matter."""
    host = host.lower().rstrip(".")
    if ":" in host:
        try:
            host = ipaddress.IPv6Address(host).compressed
        except ValueError:
            return False
    for pattern in patterns:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern.rstrip("."):
            return True
    return False


@dataclass(frozen=True)
class Hop:
    """One request the tool will send: to `address`, naming `host`."""

    url: httpx.URL  # as the caller (or the redirect) wrote it
    host: str
    address: Address

    @property
    def pinned(self) -> httpx.URL:
        """The same URL with the checked address in place of the name."""
        text = str(self.address)
        return self.url.copy_with(host=text)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        port = self.url.port
        return host if port is None else f"{host}:{port}"


# --- the tool ----------------------------------------------------------------------


async def system_resolver(host: str, port: int) -> Sequence[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


class HttpFetcher:
    """The handler of one `http-fetch` listener.

    `resolver`, `transport` and `ssl_context` are for tests: a stub resolver, a
    recording transport that never reaches a real address, a context trusting a
    test certificate. By default: the system resolver, a fresh connection pool per
    call (a connection made for one name is never reused for another), the system's
    certificate store.
    """

    def __init__(self, config: Any, *, resolver: Resolver = system_resolver,
                 transport: httpx.AsyncBaseTransport | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.allow_hosts: tuple[str, ...] = tuple(config.allow_hosts)
        self.allow_schemes = frozenset(config.allow_schemes)
        self.allow_private = tuple(ipaddress.ip_network(c, strict=False)
                                   for c in config.allow_private)
        self.max_bytes: int = config.max_bytes
        self.timeout_s: float = config.timeout_s
        self.max_redirects: int = config.max_redirects
        self.resolver = resolver
        self.transport = transport
        self.ssl_context = ssl_context or ssl.create_default_context()

    async def check(self, url: httpx.URL) -> Hop:
        """The hop for `url` if every rule allows it; `Denied` naming the rule if not."""
        where = shown(str(url))
        if url.scheme not in self.allow_schemes:
            raise Denied("scheme not allowed", url=where)
        if url.userinfo:
            raise Denied("credentials in URL", url=where)
        host = url.raw_host.decode("ascii").lower().rstrip(".")
        if not host:
            raise Denied("no host in URL", url=where)
        if not host_allowed(host, self.allow_hosts):
            raise Denied("host not allowed", url=where, host=shown(host))
        literal = literal_address(host)
        if literal is not None:
            addresses = [literal]
            if literal.version == 6:
                host = literal.compressed  # one spelling in the Host header
        else:
            try:
                answers = await self.resolver(host, url.port or _default_port(url))
            except OSError:
                raise _Unresolved from None
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in answers]
            if not addresses:
                raise _Unresolved
        for address in addresses:
            cause = address_refusal(address, self.allow_private)
            if cause is not None:
                raise Denied(cause, url=where, host=shown(host), address=str(address))
        return Hop(url, host, addresses[0])

    async def fetch(self, request: Fetch) -> Fetched:
        try:
            url = httpx.URL(request.url)
        except (httpx.InvalidURL, ValueError):
            # Refused, not merely invalid: some of these are numeric host spellings
            # (`0177.0.0.1`) the URL parser rejects but a C library would resolve.
            raise Denied("malformed URL", url=shown(request.url)) from None
        method = (request.method or Method.GET).value
        body = None if request.body is None else request.body.encode("utf-8")
        transport = self.transport or httpx.AsyncHTTPTransport(
            verify=self.ssl_context, trust_env=False, retries=0)
        async with httpx.AsyncClient(transport=transport, trust_env=False,
                                     follow_redirects=False,
                                     timeout=self.timeout_s) as client:
            for _ in range(self.max_redirects + 1):
                hop = await self.check(url)
                sent = client.build_request(
                    method, hop.pinned, content=body,
                    headers={"Host": hop.host_header, "Accept-Encoding": "identity",
                             "User-Agent": "agentd-http-fetch"},
                    extensions={"sni_hostname": hop.host})
                response = await client.send(sent, stream=True)
                try:
                    location = response.headers.get("location")
                    if response.status_code in _REDIRECTS and location:
                        try:
                            url = url.join(location)
                        except (httpx.InvalidURL, ValueError):
                            raise Denied("malformed redirect", url=shown(location)) from None
                        if response.status_code not in (307, 308):
                            method, body = "GET", None
                        continue
                    return await self._read(response)
                finally:
                    await response.aclose()
        raise Denied("too many redirects", url=shown(request.url))

    async def _read(self, response: httpx.Response) -> Fetched:
        chunks: list[bytes] = []
        got = 0
        truncated = False
        async for chunk in response.aiter_raw():
            if got + len(chunk) > self.max_bytes:
                chunks.append(chunk[:self.max_bytes - got])
                truncated = True
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
        content_type = response.headers.get("content-type", "")
        textual = _TEXTUAL.match(content_type.split(";")[0].strip())
        encoding, text = as_xml_text(data) if textual else as_base64(data)
        return Fetched(status=response.status_code,
                       content_type=xml_safe(content_type)[:1024],
                       encoding=encoding, body=text, truncated=truncated)

    async def __call__(self, payload: Fetch, meta: HandlerMetadata) -> HandlerResponse:
        try:
            async with asyncio.timeout(self.timeout_s):
                fetched = await self.fetch(payload)
        except TimeoutError:
            return HandlerResponse.error("timeout", "the fetch did not finish in time")
        except _Unresolved:
            return HandlerResponse.error("invalid-payload", "the host does not resolve")
        except httpx.TimeoutException:
            return HandlerResponse.error("timeout", "the server did not answer in time")
        except (httpx.HTTPError, OSError, ssl.SSLError):
            return HandlerResponse.error("internal", "the request failed")
        return HandlerResponse.respond(fetched)


class _Unresolved(Exception):
    pass


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


def describe(config: Any, listener: str) -> list[LoadedTool]:
    """The tool as loaded: its `tool:` block is all its handler needs."""
    return [LoadedTool("http-fetch", listener, (Fetch,), (Fetched,), Fetch.__doc__ or "",
                     config)]


def handlers(specs: Sequence[LoadedTool]) -> list[Handler]:
    return [HttpFetcher(spec.runs) for spec in specs]
