"""Per-key limits in one process: exact sliding-window logs in dicts, no I/O.

Entries are kept in admission order (dicts keep insertion order and the clock is monotonic), so
the expired ones are always at the front.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gpupool.gateway.security.limits.base import (
    WINDOW_S,
    Limit,
    Policy,
    Refusal,
    Usage,
    tokens_of,
)


@dataclass(slots=True)
class _Entry:
    at: float
    tokens: int


@dataclass(slots=True)
class _Key:
    requests: deque[float] = field(default_factory=deque)
    tokens: dict[str, _Entry] = field(default_factory=dict)  # hold id -> its charge
    token_sum: int = 0
    holds: dict[str, int] = field(default_factory=dict)  # open hold id -> its reservation


class MemoryLimits:
    """The ``LimitStore`` of one process."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._keys: dict[str, _Key] = {}

    async def take(self, name: str, policy: Policy, hold_id: str, charge: int) -> Refusal | None:
        charge = tokens_of(charge)
        key = self._keys.setdefault(name, _Key())
        if hold_id in key.holds:
            return None
        now = self._clock()
        self._expire(key, now)
        refusal = self._refusal(key, policy, charge, now)
        if refusal is not None:
            return refusal
        if policy.rpm:
            key.requests.append(now)
        if policy.tpm:
            key.tokens[hold_id] = _Entry(now, charge)
            key.token_sum += charge
        key.holds[hold_id] = charge
        return None

    async def give(
        self, name: str, policy: Policy, hold_id: str, charge: int, used: int | None
    ) -> None:
        key = self._keys.get(name)
        if key is None:
            return
        key.holds.pop(hold_id, None)
        if used is None or not policy.tpm:
            return
        charge, used = tokens_of(charge), tokens_of(used)
        now = self._clock()
        self._expire(key, now)
        entry = key.tokens.get(hold_id)
        extra = f"{hold_id}+"
        if entry is not None:
            key.token_sum += used - entry.tokens
            entry.tokens = used
        elif used > charge and extra not in key.tokens:  # its reservation left the window
            key.tokens[extra] = _Entry(now, used - charge)
            key.token_sum += used - charge

    def holders(self) -> set[str]:
        """The key names with a request holding a slot here now."""
        return {name for name, key in self._keys.items() if key.holds}

    async def usage(self, name: str) -> Usage:
        key = self._keys.get(name)
        if key is None:
            return Usage(0, 0, 0, 0)
        self._expire(key, self._clock())
        reserved = sum(key.holds.values())
        return Usage(len(key.holds), reserved, key.token_sum, len(key.requests))

    def _expire(self, key: _Key, now: float) -> None:
        since = now - WINDOW_S
        while key.requests and key.requests[0] <= since:
            key.requests.popleft()
        while key.tokens:
            hold_id, entry = next(iter(key.tokens.items()))
            if entry.at > since:
                break
            del key.tokens[hold_id]
            key.token_sum -= entry.tokens

    def _refusal(self, key: _Key, policy: Policy, charge: int, now: float) -> Refusal | None:
        if policy.rpm and len(key.requests) >= policy.rpm:
            return Refusal(Limit.rpm, key.requests[0] + WINDOW_S - now)
        if policy.tpm and key.token_sum + max(charge, 1) > policy.tpm:
            excess = key.token_sum + max(charge, 1) - policy.tpm
            return Refusal(Limit.tpm, self._token_wait(key, excess, now))
        if policy.max_concurrent and len(key.holds) >= policy.max_concurrent:
            return Refusal(Limit.concurrent, 1.0, in_flight=len(key.holds))
        return None

    def _token_wait(self, key: _Key, excess: int, now: float) -> float:
        """Seconds until entries worth ``excess`` tokens have left the window."""
        freed = 0
        for entry in key.tokens.values():
            freed += entry.tokens
            if freed >= excess:
                return entry.at + WINDOW_S - now
        return WINDOW_S
