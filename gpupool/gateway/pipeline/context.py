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
from gpupool.gateway.pipeline.worker_head import worker_head

PRIORITY = b"x-gpupool-priority"
MAX_WAIT = b"x-gpupool-max-wait"
QUEUE_EVENTS = b"x-gpupool-queue-events"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def build_context(incoming: Incoming, req: Parsed) -> Context:
    # The gateway's headers read from the client's; the worker's head built from the rest
    # (``worker_head.py``: hop-by-hop, forwarding and gateway headers dropped, our request id).
    ours: dict[bytes, str] = {}
    for k, v in incoming.headers:
        if k.startswith(b"x-gpupool-"):
            ours[k] = v.decode("latin-1")
    headers = worker_head(incoming.headers, incoming.request_id.encode("latin-1"))
    priority, max_wait, events = (
        (_priority_header(ours), _max_wait(ours), _flag(ours, QUEUE_EVENTS))
        if ours
        else (None, None, None)
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


def _flag(ours: dict[bytes, str], name: bytes) -> bool | None:
    """True or false as the header says; None when it is not sent."""
    value = ours.get(name)
    if value is None:
        return None
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise InvalidBody(f"Header `{name.decode()}` must be true or false.")
