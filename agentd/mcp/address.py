"""Which Streamable HTTP MCP servers the daemon may connect to: `http-fetch`'s rules.

The one place the `url` of an MCP server is checked. The address rules (loopback,
private, link-local, CGNAT, metadata... refused unless `allow_private` lists them)
are `http-fetch`'s, imported from `agentd.tools.http`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from agentd._errors import Denied
from agentd.tools.http import address_refusal


def check_url(url: str, allow_private: Sequence[str] = ()) -> None:
    """Resolve `url`'s host and raise `Denied` if any of its addresses is refused."""
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise Denied("mcp server url is not http(s) with a host", url=url)
    networks = [ipaddress.ip_network(n, strict=False) for n in allow_private]
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except OSError:
        raise Denied("mcp server host does not resolve", host=parts.hostname) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        why = address_refusal(address, networks)
        if why is not None:
            raise Denied(f"mcp server address refused: {why}", host=parts.hostname,
                         address=str(address))
