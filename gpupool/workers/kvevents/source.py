"""Where a worker's KV-cache events come from and how its blocks hash (plain data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KvSource:
    endpoint: str  # vLLM's PUB socket, e.g. tcp://127.0.0.1:5557
    replay: str | None = None  # its ROUTER replay socket
    topic: str = ""
    # the worker's PYTHONHASHSEED (None: unset, so vLLM's fixed default seed for sha256)
    seed: str | None = None
