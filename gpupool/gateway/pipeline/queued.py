"""A stream that answers 200 at once and waits in the queue visibly (opt-in).

By default a stream waits for its slot before any byte goes back, so a queue timeout is a real
429 with ``Retry-After`` that SDKs retry. A client that sends ``x-gpupool-queue-events: true``
gets ``: queued position=N`` SSE comments while it waits instead (useful behind proxies that
close silent connections); a timeout then arrives as an in-stream error event, since the 200
is already sent.

A stream for a swap group's model that sleeps gets them without asking (unless it sends the
header false): its comments name the model being woken and its place, ``: queued position=2;
waking model `coder` (swap group gpu0, held by `chat`); a switch takes 1.2 s (measured)``, again
every ``KEEPALIVE_S`` while it waits, so that clients and proxies that close a silent connection
wait through the switch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from gpupool.gateway.admission.base import Lease
from gpupool.gateway.errors import GatewayError
from gpupool.gateway.pipeline.exchange import Exchange, ExchangeDeps, Plan
from gpupool.gateway.pipeline.relay import Relay, stream_error
from gpupool.gateway.pipeline.slots import Slots
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import Hold
from gpupool.gateway.security.revoke import KeyRequests

KEEPALIVE_S = 5.0


class QueuedStream:
    def __init__(
        self, plan: Plan, hold: Hold, slots: Slots, deps: ExchangeDeps, relay: Relay,
        principal: Principal | None = None, keys: KeyRequests | None = None,
    ) -> None:  # fmt: skip
        self.plan = plan
        self.principal = principal
        self.keys = keys  # a revoked key's wait ends with an error event
        self.hold = hold
        self.slots = slots
        self.deps = deps
        self.relay = relay
        self.positions: asyncio.Queue[int] = asyncio.Queue()
        self.task: asyncio.Future[Lease] | None = None
        self.ex: Exchange | None = None
        self.closed = False

    async def _on_wait(self, position: int) -> None:
        self.positions.put_nowait(position)

    def _comment(self, position: int | None) -> bytes:
        note = self.slots.swap_note(self.plan.ticket.model)
        text = "queued" if position is None else f"queued position={position}"
        return f": {text}; {note}\n\n".encode() if note else f": {text}\n\n".encode()

    async def events(self) -> AsyncIterator[bytes]:
        yield self._comment(None)
        position: int | None = None
        take = self.slots.take(self.plan.ticket, self._on_wait)
        self.task = task = asyncio.ensure_future(
            take if self.keys is None else self.keys.wait(self.principal, take)
        )
        while not task.done():
            getter: asyncio.Future[int] = asyncio.ensure_future(self.positions.get())
            waiting: set[asyncio.Future[Any]] = {task, getter}
            keepalive = KEEPALIVE_S if self.slots.swap_note(self.plan.ticket.model) else None
            try:
                await asyncio.wait(waiting, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED)
            finally:
                getter.cancel()
            if getter.done() and not getter.cancelled():
                position = getter.result()
                yield self._comment(position)
            elif not task.done():  # a keep-alive while it waits for a switch
                yield self._comment(position)
        try:
            lease = task.result()
        except GatewayError as e:
            yield e.sse_event()
            return
        self.ex = ex = Exchange(self.deps, self.plan, lease, self.hold)
        try:
            data = await self.relay.open(ex)
        except GatewayError as e:
            yield stream_error(ex, e)
            return
        if data is not None:
            assert ex.resp is not None
            ex.status = str(ex.resp.status)
            yield b"data: " + data + b"\n\ndata: [DONE]\n\n"
            return
        async for chunk in self.relay.events(ex):
            yield chunk

    async def aclose(self) -> None:
        """Everything back, however the stream ended (or never started)."""
        if self.closed:
            return
        self.closed = True
        if self.ex is not None:
            await self.ex.aclose()
            return
        try:
            task = self.task
            if task is not None:
                task.cancel()  # still queued: it leaves the queue, never executed
                with contextlib.suppress(BaseException):
                    lease = await task
                    await self.slots.give(lease)  # granted in the same instant: given back
        finally:
            await self.hold.close(0)
