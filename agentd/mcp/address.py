"""Which Streamable HTTP MCP servers the daemon may connect to, and connecting only there.

The one place the `url` of an MCP server is checked. The address rules (loopback,
private, link-local, CGNAT, metadata... refused unless `allow_private` lists them)
are `http-fetch`'s, imported from `agentd.tools.http`.

The host is resolved ONCE per session, when it starts (`check_url`), and every
request of that session is sent to the checked address (`PinnedTransport`): the
SDK keeps the URL as written, so the `Host` header names the host, and the TLS
server name (SNI, and so certificate verification) is the host too; only the
socket goes to the address. Nothing resolves the name a second time, so a DNS
answer that changes between the check and the connect (rebinding) is never used.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import httpx

from agentd._errors import Denied
from agentd.tools.http import (
    Address,
    Resolver,
    address_refusal,
    literal_address,
    system_resolver,
)


class CheckedHost:
    """The host a session was checked for, and the address it must connect to."""

    def __init__(self, scheme: str, host: str, port: int, address: Address) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port
        self.address = address


async def check_url(url: str, allow_private: Sequence[str] = (),
                    resolver: Resolver = system_resolver) -> CheckedHost:
    """Resolve `url`'s host once; `Denied` if any of its addresses is refused, else the
    first address, to which the session's every request goes."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise Denied("mcp server url is malformed", url=url) from None
    host = parsed.host.lower().rstrip(".")
    if parsed.scheme not in ("https", "http") or not host:
        raise Denied("mcp server url is not http(s) with a host", url=url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    networks = [ipaddress.ip_network(n, strict=False) for n in allow_private]
    literal = literal_address(host)
    if literal is not None:
        addresses: list[Address] = [literal]
    else:
        try:
            answers = await resolver(host, port)
        except OSError:
            raise Denied("mcp server host does not resolve", host=host) from None
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in answers]
        if not addresses:
            raise Denied("mcp server host does not resolve", host=host)
    for address in addresses:
        why = address_refusal(address, networks)
        if why is not None:
            raise Denied(f"mcp server address refused: {why}", host=host,
                         address=str(address))
    return CheckedHost(parsed.scheme, host, port, addresses[0])


class PinnedTransport(httpx.AsyncBaseTransport):
    """Sends every request to the checked address, keeping the name for `Host` and
    TLS; a request for any other origin (the SDK does not follow redirects, and a
    server-given endpoint elsewhere is not followed either) is refused."""

    def __init__(self, checked: CheckedHost, inner: httpx.AsyncBaseTransport) -> None:
        self.checked = checked
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        c = self.checked
        url = request.url
        port = url.port or (443 if url.scheme == "https" else 80)
        if (url.scheme, url.host.lower().rstrip("."), port) != (c.scheme, c.host, c.port):
            raise httpx.ConnectError("mcp: a request outside the checked origin", request=request)
        request.url = url.copy_with(host=str(c.address))
        request.extensions = {**request.extensions, "sni_hostname": c.host}
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()
