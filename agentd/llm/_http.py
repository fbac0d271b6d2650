"""The HTTP client of the LLM backends and embeddings: one aiohttp pool per router.

Agents wait on models that answer in seconds, so hundreds of requests are open at
once. httpcore's pool (under httpx) walks every connection for every waiting
request each time a request is queued or answered: its cost grows with the square
of the calls in flight. aiohttp's connector hands a free connection out in
constant time; docs/llm-platform.md has the measurements.

`post_bounded` is the one exchange the backends make (`post_streamed` the same,
the body handed on as it arrives): `timeout_s` bounds the whole
exchange, not each read (a server dripping a byte at a time is cut off), and the
body is read up to `max_bytes`. Failures come out as `TimeoutError`,
`ResponseTooLarge` or `ConnectionFailed`, so callers never see aiohttp's types.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import urllib.request
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import aiohttp
import certifi

MAX_RESPONSE_BYTES = 8 * 1024 * 1024  # a completion is text; more is a hostile server
# Below the 5 s idle timeout of common servers (uvicorn, nginx's proxies), so a
# connection is not reused just as the server closes it (a POST is not resent).
KEEPALIVE_S = 4.0
_CHUNK = 64 * 1024


class ResponseTooLarge(Exception):
    """A backend's reply went past the bytes the caller takes."""


class ConnectionFailed(Exception):
    """The exchange failed below HTTP (refused, reset, closed early, bad framing)."""


def env_proxy(url: str) -> str | None:
    """The proxy `HTTP(S)_PROXY` names for `url`, unless `NO_PROXY` exempts its host,
    as httpx honoured them. aiohttp's own `trust_env` also reads ~/.netrc on every
    request (in a thread); a backend's key comes from `api_key_env`, never netrc."""
    parts = urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def tls_context() -> ssl.SSLContext:
    """The CAs httpx trusted for these backends: `SSL_CERT_FILE` / `SSL_CERT_DIR`
    when set, certifi's bundle otherwise."""
    cafile, capath = os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")
    if cafile or capath:
        return ssl.create_default_context(cafile=cafile or None, capath=capath or None)
    return ssl.create_default_context(cafile=certifi.where())


class HttpPool:
    """Connections to the backends, at most `limit` open at once. The session is
    made on first use, inside the event loop that uses it."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._session: aiohttp.ClientSession | None = None
        self._proxies: dict[str, str | None] = {}  # per origin, read from the environment once

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.limit, keepalive_timeout=KEEPALIVE_S, ssl=tls_context())
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def post(self, url: str, content: bytes, headers: Mapping[str, str],
                   timeout_s: float, max_bytes: int = MAX_RESPONSE_BYTES,
                   on_chunk: Callable[[bytes], None] | None = None,
                   ) -> tuple[int, Mapping[str, str], bytes]:
        """(status, headers, body); see the module docstring for the failures. With
        `on_chunk`, a 2xx body goes to it as it arrives (the body returned is empty)."""
        session = self._open()
        origin = url[:url.find("/", url.find("//") + 2)] if url.count("/") > 2 else url
        if origin not in self._proxies:
            self._proxies[origin] = env_proxy(url)
        try:
            async with asyncio.timeout(timeout_s), session.post(
                    url, data=content, headers=dict(headers), allow_redirects=False,
                    proxy=self._proxies[origin]) as reply:
                sink = on_chunk if 200 <= reply.status < 300 else None
                chunks: list[bytes] = []
                size = 0
                async for chunk in reply.content.iter_chunked(_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise ResponseTooLarge(f"response over {max_bytes} bytes")
                    if sink is not None:
                        sink(chunk)
                    else:
                        chunks.append(chunk)
                return reply.status, reply.headers, b"".join(chunks)
        except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
            raise
        except aiohttp.ClientError as exc:
            raise ConnectionFailed(type(exc).__name__) from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def post_bounded(pool: HttpPool, url: str, content: bytes,
                       headers: Mapping[str, str], timeout_s: float,
                       max_bytes: int = MAX_RESPONSE_BYTES
                       ) -> tuple[int, Mapping[str, str], bytes]:
    """POST to a backend through `pool`: (status, headers, body)."""
    return await pool.post(url, content, headers, timeout_s, max_bytes)


async def post_streamed(pool: HttpPool, url: str, content: bytes,
                        headers: Mapping[str, str], timeout_s: float,
                        on_chunk: Callable[[bytes], None],
                        max_bytes: int = MAX_RESPONSE_BYTES
                        ) -> tuple[int, Mapping[str, str], bytes]:
    """`post_bounded` for a streamed reply: a 2xx body goes to `on_chunk` as it
    arrives (the body returned is empty); any other status returns its body."""
    return await pool.post(url, content, headers, timeout_s, max_bytes, on_chunk)
