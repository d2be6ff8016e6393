"""What a per-key limit store does, shared by the memory and the Redis one.

A store keeps, per key name, three things over a sliding window of one minute:

* **requests**: one entry per admitted request (``rpm``);
* **tokens**: one entry per admitted request, its *charge*: the reservation when admitted,
  replaced by the real usage when the request ends (``tpm``); an entry counts for a minute from
  its admission. A request whose usage exceeds a reservation already out of the window is
  charged the excess as a new entry;
* **holds**: the requests running now, each with its reservation (``max_concurrent``).

``take`` checks all three and records all three, or records nothing and says why (a
:class:`Refusal`): a refused request costs no budget. Windows are exact logs (no approximation),
so a budget is never overrun by more than the requests admitted before their usage was known
to exceed their reservation.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpupool.config.models import ApiKey

WINDOW_S = 60.0
MAX_TOKENS = 1 << 40  # the most tokens one charge may hold: a store's arithmetic stays exact


def tokens_of(n: object) -> int:
    """A token count as a store keeps it, whatever it was given: an integer in
    ``[0, MAX_TOKENS]`` (a negative, a non-number or NaN is 0; a float is truncated)."""
    if isinstance(n, bool) or not isinstance(n, int | float) or n != n or n <= 0:
        return 0
    return int(min(n, MAX_TOKENS))


@dataclass(frozen=True, slots=True)
class Policy:
    """A key's limits; 0 means "no limit"."""

    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0

    @classmethod
    def of(cls, key: ApiKey) -> Policy:
        return cls(key.rpm or 0, key.tpm or 0, key.max_concurrent or 0)

    @property
    def active(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)

    def charge(self, reserve_tokens: int) -> int:
        """Tokens a request reserves: its worst case, at most the whole budget (0 without tpm).

        A reservation above ``tpm`` is clamped to it, so such a request waits for an empty
        budget instead of being refused for ever; its real usage is charged when it ends.
        """
        return min(tokens_of(reserve_tokens), self.tpm)


class Limit(StrEnum):
    rpm = "rpm"
    tpm = "tpm"
    concurrent = "concurrent"


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: Limit
    retry_after_s: float
    in_flight: int = 0  # for ``concurrent``: holds running now


class LimitStore(Protocol):
    async def take(self, name: str, policy: Policy, hold_id: str, charge: int) -> Refusal | None:
        """Admit one request under ``name`` (recording it) or say which limit refuses it.

        Needs room for ``max(charge, 1)`` tokens when the key has a ``tpm``. Idempotent: taking a
        ``hold_id`` already held admits it again without recording anything twice.
        """
        ...

    async def give(
        self, name: str, policy: Policy, hold_id: str, charge: int, used: int | None
    ) -> None:
        """The request ended: free its hold; settle its charge to ``used`` (None: it stands).

        Idempotent.
        """
        ...

    async def usage(self, name: str) -> Usage:
        """What ``name`` holds now, for tests and the admin view."""
        ...


@dataclass(frozen=True, slots=True)
class Usage:
    in_use: int  # requests holding a slot now (all replicas, for Redis)
    reserved: int  # tokens reserved by those requests, not yet settled
    tokens: int  # tokens counted in the last minute
    requests: int  # requests counted in the last minute
