"""A key removed by a reload stops working at once: new requests, queued ones, and (if the
config says so) running streams.

New requests are refused at the door (401) because the authenticator's keys are swapped. A
request that passed the door before the reload is refused where it would wait: ``wait`` runs
its wait for a worker slot and, when its key is revoked, cancels that wait (admission removes
the ticket, as for a client that leaves) and raises :class:`~gpupool.gateway.errors.Unauthorized`
instead, which the route renders in its own error shape. With ``auth.revoked_streams: cut`` a
running stream of the key ends at its next event with an error event (``cut_when_revoked``);
with ``finish`` (the default) it runs to its end. Whole (non-streamed) answers always finish.

Only this replica's requests are known here: with several replicas, reload each of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

from gpupool.config.models import ApiKey
from gpupool.gateway.errors import GatewayError, Unauthorized
from gpupool.gateway.security.keys import Principal

T = TypeVar("T")

REVOKED_QUEUED = "The API key was revoked while this request waited for a worker."
REVOKED_RUNNING = "The API key was revoked; the stream is cut."


class KeyRequests:
    """The queued requests of each key, by the key's hash, so that a revocation finds them."""

    def __init__(self, valid: Callable[[ApiKey], bool]) -> None:
        self._valid = valid  # whether a key is still configured (the authenticator's keys)
        self._waiting: dict[str, set[asyncio.Task[object]]] = {}
        self._revoked: set[asyncio.Task[object]] = set()

    def waiting(self, digest: str) -> int:
        """How many requests of the key with hash ``digest`` wait for a slot now."""
        return len(self._waiting.get(digest, ()))

    async def wait(self, principal: Principal | None, waiter: Awaitable[T]) -> T:
        """``await waiter`` (a wait for a worker slot) as ``principal``'s request: a revocation
        of its key ends the wait with ``Unauthorized``."""
        key = principal.key if principal is not None else None
        if key is None:
            return await waiter
        if not self._valid(key):  # revoked between the door and here
            if asyncio.iscoroutine(waiter):
                waiter.close()
            raise Unauthorized(REVOKED_QUEUED)
        task = asyncio.current_task()
        assert task is not None
        digest = key.sha256.lower()
        tasks = self._waiting.setdefault(digest, set())
        tasks.add(task)
        try:
            return await waiter
        except asyncio.CancelledError:
            if task not in self._revoked:
                raise
            task.uncancel()
            raise Unauthorized(REVOKED_QUEUED) from None
        finally:
            self._revoked.discard(task)
            tasks.discard(task)
            if not tasks and self._waiting.get(digest) is tasks:
                del self._waiting[digest]

    def revoke(self, digests: Iterable[str]) -> int:
        """Refuse the queued requests of the keys with these hashes; returns how many."""
        n = 0
        for digest in digests:
            for task in self._waiting.get(digest.lower(), ()):
                if task not in self._revoked:
                    self._revoked.add(task)
                    task.cancel()
                    n += 1
        return n

    async def cut_when_revoked(
        self,
        key: ApiKey,
        stream: AsyncIterator[bytes],
        last_words: Callable[[GatewayError], bytes],
    ) -> AsyncIterator[bytes]:
        """``stream`` until ``key`` is revoked; then ``last_words`` (the route's error event)."""
        try:
            async for chunk in stream:
                if not self._valid(key):
                    yield last_words(Unauthorized(REVOKED_RUNNING))
                    return
                yield chunk
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
