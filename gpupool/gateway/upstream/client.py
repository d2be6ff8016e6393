"""The one pooled HTTP client to workers, and the one place transport errors are mapped.

``open()`` sends a request and returns an :class:`UpstreamResponse` once the status and headers
are in; the caller decides (before any byte reaches the client) whether to retry elsewhere, then
either reads the whole body or iterates raw chunks. Every aiohttp/OS error becomes
:class:`UpstreamFailure`, whose message never contains the worker's address.
"""

from __future__ import annotations

import asyncio
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
    """A worker could not be reached or broke the connection. Safe to show: no address.

    ``sent``: the request may have reached the worker. ``died``: the worker closed the
    connection (it crashed, or the gateway cut it off). A request that was not sent can always
    be retried elsewhere; one that was sent only when its worker is known to be gone, so a slow
    or frozen worker never ends up running it a second time.
    """

    def __init__(self, message: str, *, sent: bool, died: bool = False) -> None:
        super().__init__(message)
        self.sent = sent
        self.died = died


def map_error(e: BaseException, *, sent: bool) -> UpstreamFailure:
    if isinstance(e, aiohttp.ClientConnectorError):
        return UpstreamFailure("worker unreachable", sent=False)
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return UpstreamFailure("worker timed out", sent=sent)
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return UpstreamFailure("worker closed the connection", sent=sent, died=True)
    return UpstreamFailure(f"worker connection failed ({type(e).__name__})", sent=sent)


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
            raise map_error(e, sent=True) from None
        finally:
            self._resp.release()

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """Chunks as they arrive, untouched."""
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise map_error(e, sent=True) from None

    def close(self) -> None:
        """Drop the connection (a client went away: vLLM sees the disconnect and aborts)."""
        if not self._resp.closed:
            self._resp.close()


class UpstreamClient:
    """One connection pool per worker (so a worker taken out can be cut off at once), and one
    for control traffic (health checks, metrics scrapes, tokenize)."""

    def __init__(self, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=30
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    def _for(self, origin: str) -> aiohttp.ClientSession:
        session = self._sessions.get(origin)
        if session is None or session.closed:
            session = self._sessions[origin] = self._new_session()
        return session

    @property
    def session(self) -> aiohttp.ClientSession:
        """The control session (probes and scrapes)."""
        return self._for("")

    @staticmethod
    def origin(url: str) -> str:
        """``scheme://host:port`` of a URL: the key of its connection pool."""
        cut = url.find("/", url.find("//") + 2)
        return url if cut < 0 else url[:cut]

    def abort(self, url: str) -> None:
        """Cut every open connection to a worker's origin: its in-flight requests fail at once."""
        session = self._sessions.pop(self.origin(url), None)
        if session is not None:
            task = asyncio.ensure_future(session.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str],
    ) -> UpstreamResponse:
        session = self._for(self.origin(url))
        try:
            resp = await session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise map_error(e, sent=True) from None
        out = [(k, v) for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE]
        return UpstreamResponse(resp.status, out, resp)
