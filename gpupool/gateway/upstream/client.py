"""The one pooled HTTP client to workers, and the one place transport errors are mapped.

``open()`` sends a request and returns an :class:`UpstreamResponse` once the status and headers
are in; the caller decides (before any byte reaches the client) whether to retry elsewhere, then
either reads the whole body or iterates raw chunks. Every aiohttp/OS error becomes
:class:`UpstreamFailure`, whose message never contains the worker's address.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp

# Request headers never forwarded to a worker (hop-by-hop, or ours to decide).
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "authorization",
        "x-api-key",
        "accept-encoding",
        "expect",
        "content-type",
        "x-request-id",
        "x-gpupool-priority",
        "x-gpupool-max-wait",
        "x-gpupool-tenant",
        "cookie",
    }
)
# Response headers never passed back to the client.
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "server", "date"}
)


class UpstreamFailure(Exception):
    """A worker could not be reached or broke the connection. Safe to show: no address."""

    def __init__(self, message: str, *, connect: bool) -> None:
        super().__init__(message)
        self.connect = connect  # True: nothing reached the worker (always safe to retry)


def map_error(e: BaseException, *, connect: bool) -> UpstreamFailure:
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamFailure("worker timed out", connect=connect)
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamFailure("worker unreachable", connect=True)
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return UpstreamFailure("worker closed the connection", connect=connect)
    return UpstreamFailure(f"worker connection failed ({type(e).__name__})", connect=connect)


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_REQUEST}


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[str, str]]
    _resp: aiohttp.ClientResponse

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise map_error(e, connect=False) from None
        finally:
            self._resp.release()

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """Chunks as they arrive, untouched."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise map_error(e, connect=False) from None

    def close(self) -> None:
        """Drop the connection (a client went away: vLLM sees the disconnect and aborts)."""
        if not self._resp.closed:
            self._resp.close()


class UpstreamClient:
    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> UpstreamResponse:
        try:
            resp = await self.session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise map_error(e, connect=True) from None
        out = [(k, v) for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE]
        return UpstreamResponse(resp.status, out, resp)
