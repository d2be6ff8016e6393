"""Who asks, and how: the request's context from its headers, every value validated.

``x-gpupool-priority`` (an integer; the body's ``priority`` otherwise), clamped to the key's
range; ``x-gpupool-max-wait`` (seconds, finite, ≥ 0); ``x-gpupool-queue-events`` (a queued
stream gets ``: queued position=N`` comments instead of waiting silently). A bad value is a
400 naming the header, never a 500.
"""

from __future__ import annotations

import math

from gpupool.gateway.errors import InvalidBody
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.parse import PRIORITY_BOUND, Parsed
from gpupool.gateway.pipeline.exchange import Context
from gpupool.gateway.upstream.common import DROP_REQUEST_HEADERS

PRIORITY = b"x-gpupool-priority"
MAX_WAIT = b"x-gpupool-max-wait"
QUEUE_EVENTS = b"x-gpupool-queue-events"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def build_context(incoming: Incoming, req: Parsed) -> Context:
    # One pass over the client's headers: ours to read, the rest a worker may see (hop-by-hop
    # and gateway ones dropped), as the lines of the worker's request head (no decoding).
    ours: dict[bytes, str] = {}
    lines: list[bytes] = []
    for k, v in incoming.headers:
        if k.startswith(b"x-gpupool-"):
            ours[k] = v.decode("latin-1")
        if k not in DROP_REQUEST_HEADERS:
            lines.append(b"%b: %b\r\n" % (k, v))
    lines.append(b"content-type: application/json\r\nx-request-id: %b\r\n"
                 % incoming.request_id.encode("latin-1"))  # fmt: skip
    headers = b"".join(lines)
    n = len(lines) + 1  # lines in the block: one per header
    if headers.count(b"\n") != n or headers.count(b"\r") != n:
        raise InvalidBody("A request header contains a line break.")
    priority, max_wait, events = (
        (_priority_header(ours), _max_wait(ours), _flag(ours, QUEUE_EVENTS))
        if ours
        else (None, None, False)
    )
    if priority is None:
        priority = req.priority or 0
    allowed = incoming.priority_range()
    if allowed is not None:
        priority = min(max(priority, allowed[0]), allowed[1])
    return Context(incoming.request_id, incoming.tenant(), priority, max_wait, headers, events)


def _number(ours: dict[bytes, str], name: bytes) -> float | None:
    value = ours.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise InvalidBody(f"Header `{name.decode()}` must be a finite number.")
    return number


def _priority_header(ours: dict[bytes, str]) -> int | None:
    number = _number(ours, PRIORITY)
    if number is None:
        return None
    if number != int(number) or abs(number) > PRIORITY_BOUND:
        raise InvalidBody(
            f"Header `{PRIORITY.decode()}` must be an integer between "
            f"{-PRIORITY_BOUND} and {PRIORITY_BOUND}."
        )
    return int(number)


def _max_wait(ours: dict[bytes, str]) -> float | None:
    number = _number(ours, MAX_WAIT)
    if number is not None and number < 0:
        raise InvalidBody(f"Header `{MAX_WAIT.decode()}` must be 0 or more seconds.")
    return number


def _flag(ours: dict[bytes, str], name: bytes) -> bool:
    value = ours.get(name)
    if value is None:
        return False
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise InvalidBody(f"Header `{name.decode()}` must be true or false.")
