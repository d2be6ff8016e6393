"""The request head a worker sees: which of the client's headers pass, and what the gateway sets.

Never passed on:

* hop-by-hop headers (RFC 9110 §7.6.1: ``connection``, ``keep-alive``, ``proxy-connection``,
  ``te``, ``trailer``, ``transfer-encoding``, ``upgrade``, ``proxy-authorization``,
  ``proxy-authenticate``) and every header the client's ``Connection:`` names;
* framing and credentials the gateway re-does or keeps (``host``, ``content-length``,
  ``content-type``, ``expect``, ``accept-encoding``, ``authorization``, ``x-api-key``,
  ``cookie``);
* the gateway's own: every ``x-gpupool-*`` and the forwarding headers (``forwarded``,
  ``x-forwarded-*``, ``x-real-ip``, ``via``, ``x-client-ip``): a client may not claim to be the
  gateway or to come from elsewhere;
* ``x-request-id``: the worker gets the gateway's own id, unique per request (vLLM derives its
  request id, its logs and its aborts from it); the client's stays in the reply and the logs;
* every ``x-vllm-*`` and ``x-data-parallel-rank``: vLLM reads ``X-Vllm-Priority`` before the
  body's ``priority`` (a client would step out of its key's range) and the rank picks an engine;
  both are the gateway's decisions, and unknown ones may become so in a later vLLM.

``traceparent`` passes when it is well-formed W3C trace context (``tracestate`` with it, at most
512 bytes): a client's trace then continues into the worker's OpenTelemetry spans, as a proxy
that does not trace itself should let it; a malformed one is dropped, never repaired.
"""

from __future__ import annotations

import re

from gpupool.gateway.errors import InvalidBody

NEVER = frozenset(
    h.encode()
    for h in (
        "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "proxy-authorization", "proxy-authenticate",
        "host", "content-length", "content-type", "expect", "accept-encoding",
        "authorization", "x-api-key", "cookie",
        "forwarded", "x-real-ip", "via", "x-client-ip", "true-client-ip",
        "x-request-id", "x-data-parallel-rank",
    )
)  # fmt: skip
_PREFIXES = (b"x-gpupool-", b"x-forwarded-", b"x-vllm-")
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")
_MAX_TRACESTATE = 512


def passes(name: bytes) -> bool:
    """Whether a client's header of this (lower-case) name may reach a worker at all."""
    return name not in NEVER and not name.startswith(_PREFIXES)


def worker_head(headers: list[tuple[bytes, bytes]], request_id: bytes) -> bytes:
    """The header lines (``name: value\\r\\n`` each) a worker's request carries.

    Raises :class:`InvalidBody` for a header value with a line break (never forwarded).
    """
    lines: list[bytes] = []
    named = trace = state = False
    for k, v in headers:
        if k in NEVER or k.startswith(_PREFIXES):
            named = named or k == b"connection"
            continue
        if k == b"traceparent":
            if trace or not _TRACEPARENT.match(v.strip()) or v.startswith(b"ff"):
                continue
            trace = True
        elif k == b"tracestate":
            if len(v) > _MAX_TRACESTATE:
                continue
            state = True
        lines.append(b"%b: %b\r\n" % (k, v))
    if named:  # drop what the client's Connection: names (hop-by-hop by its word)
        names = _connection_names(headers)
        lines = [line for line in lines if line.split(b":", 1)[0] not in names]
    if state and not trace:
        lines = [line for line in lines if not line.startswith(b"tracestate:")]
    lines.append(b"content-type: application/json\r\nx-request-id: %b\r\n" % request_id)
    head = b"".join(lines)
    n = len(lines) + 1  # the last entry holds two lines
    if head.count(b"\n") != n or head.count(b"\r") != n:
        raise InvalidBody("A request header contains a line break.")
    return head


def _connection_names(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names the client's ``Connection:`` lists (hop-by-hop by its word)."""
    names: set[bytes] = set()
    for k, v in headers:
        if k == b"connection":
            names.update(n.strip().lower() for n in v.split(b","))
    names.discard(b"")
    return frozenset(names)
