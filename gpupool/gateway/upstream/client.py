"""The gateway's HTTP clients to workers: the lean data path and the control session.

Two paths, two tools. Requests that carry tokens go through :class:`Http1Pool` (``http1.py``), a
lean keep-alive HTTP/1.1 client on asyncio protocols and httptools: ``open()`` returns an
:class:`UpstreamResponse` once the status and headers are in; the caller decides (before any
byte reaches the client) whether to retry elsewhere, then reads the whole body or iterates raw
chunks. Control traffic (health checks, metrics scrapes, warm-up) uses an aiohttp session,
``UpstreamClient.session``: it runs a few times a second, not per request.

Every data-path failure is an :class:`UpstreamFailure`, whose message never contains the worker's
address.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp

from gpupool.gateway.upstream.common import UpstreamFailure
from gpupool.gateway.upstream.http1 import Held, Http1Pool, Http1Response
from gpupool.gateway.upstream.limits import WorkerLimits

UpstreamResponse = Http1Response

__all__ = ["DataPath", "Response", "UpstreamClient", "UpstreamFailure", "UpstreamResponse"]


class Response(Protocol):
    """A worker's answer once its status and headers are in (``Http1Response``, or a fake)."""

    status: int
    headers: list[tuple[str, str]]
    content_type: str

    async def read(self) -> bytes: ...

    def read_now(self) -> bytes | None:
        """The whole body if it is in already (no wait), else None (then ``read``)."""
        ...

    def iter_raw(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...


class DataPath(Protocol):
    """The seam the request pipeline sends through: one method, so a fake worker pool is one
    class (as httpx's transports)."""

    async def open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | bytes,
        stream: bool = False,
    ) -> Response:
        """``headers`` as a mapping, or as the head's header lines already checked for line
        breaks (``name: value\\r\\n`` each). ``stream``: the answer is read as it comes (an idle
        deadline), not whole (a total deadline)."""
        ...


class UpstreamClient:
    """Keep-alive connections pooled per worker origin (so a worker taken out can be cut off at
    once), and one aiohttp session for control traffic."""

    def __init__(
        self,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        limits: WorkerLimits | None = None,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._pool = Http1Pool(connect_timeout_s, read_timeout_s, limits=limits)
        self._session: aiohttp.ClientSession | None = None
        # The data path's one method is the pool's own (no wrapper coroutine per request).
        self.open = self._pool.open

    @property
    def session(self) -> aiohttp.ClientSession:
        """The control session (probes, scrapes and warm-up)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=4),
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    def abort(self, url: str, cause: str | None = None) -> None:
        """Cut every open connection to a worker's origin: its in-flight requests fail at once
        (with a ``cause``, an operator action, they continue on another worker: migration)."""
        self._pool.abort(url, cause)

    def hold_by(self, held_since: Held) -> None:
        """Hold streams' idle deadlines while their worker's requests are paused (swap groups'
        ``/sleep?mode=keep``): ``held_since(origin)``, see :meth:`Http1Pool.hold_by`."""
        self._pool.hold_by(held_since)

    async def close(self) -> None:
        await self._pool.close()
        if self._session is not None:
            await self._session.close()
