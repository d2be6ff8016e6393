"""What both upstream clients share: the failure type and which headers pass."""

from __future__ import annotations

# Request headers never forwarded to a worker (hop-by-hop, or ours to decide).
DROP_REQUEST = frozenset(
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
        "x-gpupool-queue-events",
        "cookie",
    }
)
# Response headers passed back to the client: only what a client of an OpenAI-compatible server
# needs. Framing (content-length, transfer-encoding) is the gateway's own, as it re-frames the
# body; cookies, CORS, redirects, auth challenges, HSTS, Alt-Svc, a worker's x-request-id or
# x-gpupool-* never reach a client (the gateway's own headers are the gateway's alone).
KEEP_RESPONSE = frozenset({"content-type", "cache-control"})


class UpstreamFailure(Exception):
    """A worker could not be reached or broke the connection. Safe to show: no address.

    ``sent``: the request may have reached the worker. ``died``: the worker closed the
    connection (it crashed, or the gateway cut it off). A request that was not sent can always
    be retried elsewhere; one that was sent only when its worker is known to be gone, so a slow
    or frozen worker never ends up running it a second time.

    ``limit``: the bound the worker crossed (an ``upstream_*`` config field; ``limits.py``),
    None for a plain transport failure.

    ``cause``: why a request that has begun may continue on another worker (request migration,
    ``pipeline/migrate.py``): ``worker_died`` when the worker closed or reset the connection
    itself, ``worker_out`` when the gateway cut a worker its checks took out, ``timeout`` when
    the worker kept silent past a read deadline, the operator action that cut it (``drain``,
    ``restart``), or ``wake_failed`` when a swap group's wake of the worker holding it paused
    failed. None when it must not continue elsewhere: any other bound crossed (a worker
    that sends what it must not is not trusted with a second try), or the gateway shutting
    down.
    """

    def __init__(
        self,
        message: str,
        *,
        sent: bool,
        died: bool = False,
        limit: str | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.sent = sent
        self.died = died
        self.limit = limit
        self.cause = cause
        self.counted = False  # counted against its worker already (``Dispatcher.broke``)


DROP_REQUEST_HEADERS = frozenset(h.encode() for h in DROP_REQUEST)
"""The same names as bytes, for raw ASGI header lists (whose names are lower case)."""
KEEP_RESPONSE_HEADERS = frozenset(h.encode() for h in KEEP_RESPONSE)
