"""What both upstream clients share: the failure type and the headers never passed on."""

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
# Response headers never passed back to the client.
DROP_RESPONSE = frozenset(
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


DROP_REQUEST_HEADERS = frozenset(h.encode() for h in DROP_REQUEST)
"""The same names as bytes, for raw ASGI header lists (whose names are lower case)."""
DROP_RESPONSE_HEADERS = frozenset(h.encode() for h in DROP_RESPONSE)
