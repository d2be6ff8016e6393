"""Bounds on what a worker may send back: a worker is only semi-trusted.

A proxy in between, a crashed process, a port reused by something else or a buggy build can
answer anything. Every read from a worker is bounded, like nginx's ``proxy_buffer_size`` and
Envoy's ``max_response_headers_kb``: the response head (bytes and header count, interim ``1xx``
heads included), a body the gateway buffers whole, an SSE event a transform buffers, and time (a
total deadline for a whole answer, never restarted by a byte; an idle deadline for a stream).

A worker past a bound fails its request with an :class:`~gpupool.gateway.upstream.common.
UpstreamFailure` whose ``limit`` names the bound (the configuration field), so the client gets
a 502 and the log line says which worker crossed which limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.config.models import ServerConfig
from gpupool.gateway.upstream.common import UpstreamFailure

BODY_FACTOR = 4  # a buffered answer may be this many times the largest request body
INF = float("inf")


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """What one response from a worker may take; see ``ServerConfig``'s ``upstream_*`` fields."""

    max_head_bytes: int = 64 * 1024
    max_headers: int = 100
    max_interim: int = 8
    max_body_bytes: int = BODY_FACTOR * 32 * 1024 * 1024
    max_event_bytes: int = 32 * 1024 * 1024
    total_s: float = 3600.0  # head and body of a whole answer, from the request's send
    idle_s: float = 600.0  # a stream: its head from the send, then between lines

    @classmethod
    def of(cls, server: ServerConfig) -> WorkerLimits:
        return cls(
            max_head_bytes=server.upstream_max_head_bytes,
            max_headers=server.upstream_max_headers,
            max_interim=server.upstream_max_interim,
            max_body_bytes=server.upstream_max_body_bytes or BODY_FACTOR * server.max_body_bytes,
            max_event_bytes=server.upstream_max_event_bytes or server.max_body_bytes,
            total_s=server.upstream_total_timeout_s,
            idle_s=server.upstream_read_timeout_s,
        )


def over(limit: str, what: str, cause: str | None = None) -> UpstreamFailure:
    """The failure of a worker past ``limit`` (a config field's name): sent, not died, so it is
    never retried on another worker before the first byte (the request may have run) and
    counts as the worker's. ``cause``: a deadline's (``timeout``) lets the request move to
    another worker (migration)."""
    return UpstreamFailure(what, sent=True, limit=limit, cause=cause)
