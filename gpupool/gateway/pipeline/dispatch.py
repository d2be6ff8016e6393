"""Sending an exchange to its worker, retrying elsewhere before the first byte goes back.

This is also the one place where the data path's transport failures become the gateway's
errors (:func:`failure_error`): a worker's address or a traceback never reaches a client.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from gpupool.config.models import RoutingConfig
from gpupool.gateway.errors import (
    GatewayError,
    UpstreamError,
    UpstreamUnavailable,
)
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.candidates import Candidates
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.migrate import Migrator
from gpupool.gateway.pipeline.prefill import PrefillGate
from gpupool.gateway.pipeline.slots import Slots
from gpupool.gateway.upstream.client import DataPath, UpstreamFailure
from gpupool.workers.registry import Registry, Worker

log = logging.getLogger("gpupool.upstream")

# vLLM's 400s for a prompt its window cannot hold (too long; or exactly the window, no room left)
_CONTEXT_MARKERS = (b"maximum context length", b"decoder prompt", b"must be at least 1, got 0")


def failure_error(e: UpstreamFailure, phase: str) -> UpstreamError:
    """The client's view of a transport failure ``phase`` (``before answering``, ``mid-stream``)."""
    return UpstreamError(f"The worker failed {phase} ({e}).")


class Dispatcher:
    def __init__(
        self,
        routing: RoutingConfig,
        registry: Registry,
        candidates: Candidates,
        client: DataPath,
        slots: Slots,
        metrics: Metrics,
        migrator: Migrator | None = None,
    ) -> None:
        self.routing = routing
        self.migrator = migrator
        self.registry = registry
        self.candidates = candidates
        self.client = client
        self.slots = slots
        self.metrics = metrics
        self.gate = PrefillGate(routing.prefill_gate_tokens, routing.prefill_gate_max_wait_s)

    async def send(self, ex: Exchange) -> bytes | None:
        """Open the exchange's request on its worker, moving it to another worker on a
        connection error, a 5xx or a context-length 400 while nothing went back yet.

        Sets ``ex.resp``; returns the body when it had to be read (an error passed on).
        Raises a :class:`GatewayError`; whatever the exchange holds, ``ex.aclose()`` frees.
        """
        plan = ex.plan
        while True:
            worker = self.registry.get(ex.worker)
            if plan.gated and ex.turn is None and worker is not None:
                ex.turn = await self.gate.enter(worker.name)
            try:
                if worker is None or worker.url is None:
                    raise UpstreamFailure("worker went away", sent=False)
                url = worker.url + (plan.target or plan.kind.path)
                resp = await self.client.open(plan.method, url, plan.body or None,
                                              plan.ctx.headers, plan.stream)  # fmt: skip
                ex.resp = resp
                if resp.status < 400:
                    ex.answered = True
                    await self._answered(ex)
                    return None
                if ex.turn is not None:
                    ex.prefilled()  # an error: nothing is prefilling
                data = await resp.read()
            except UpstreamFailure as e:
                await self._after(ex, e, worker)  # on another worker, or raises
                continue
            reason = self._retryable(resp.status, data, worker, ex)
            if reason is None or len(plan.tried) >= self.routing.retries:
                return data
            if reason == "context_length" and not self._larger_window(ex):
                return data  # no window holds it: the worker's own 400, in its route's shape
            await self._retry(ex, reason, worker, failure=reason != "context_length")

    async def _after(self, ex: Exchange, e: UpstreamFailure, worker: Worker | None) -> None:
        """After a transport failure before the first byte: a request whose worker died
        starts again elsewhere (a migration); one that was not sent, or whose worker closed
        the connection while still routable, is retried; any other fails (it may have run,
        and may still)."""
        if e.sent and await self._restart(ex, e):
            return
        try:
            if e.sent and not (e.died and worker is not None and worker.routable):
                self.broke(ex, e)
                ex.status = "upstream_error"
                raise failure_error(e, "while handling the request") from None
            await self._retry(ex, e.args[0], worker)
        except GatewayError:
            if e.sent and self.migrator is not None:
                self.migrator.gave_up(ex, e)  # its migrations used up, and no retry took it
            raise

    async def _restart(self, ex: Exchange, e: UpstreamFailure) -> bool:
        """A request sent to a worker that died before anything went back starts again on
        another worker when it may move (a migration: ``migrate.py``): True. False when it may
        not (the caller's rules apply); raises when it may but no worker takes it."""
        m = self.migrator
        cause = m.cause(ex, e) if m is not None else None
        if m is None or cause is None:
            return False
        if cause == "worker_died" or e.limit is not None:
            self.broke(ex, e)
        if not await m.move(ex, cause, "sent again"):
            ex.status = "upstream_error"
            raise failure_error(e, "while handling the request") from None
        m.record(ex, cause, "restarted")
        return True

    @staticmethod
    async def _answered(ex: Exchange) -> None:
        """The worker took it: what must know so learns it before any byte goes back (where a
        stored response lives, ``stored.py``)."""
        if ex.plan.answered is not None:
            await ex.plan.answered(ex.worker)

    def _retryable(self, status: int, data: bytes, worker: Worker, ex: Exchange) -> str | None:
        if status >= 500:
            return f"status {status}"
        if status == 400 and any(m in data for m in _CONTEXT_MARKERS):
            r = ex.plan.route
            at_least = (worker.window or 0) + 1 - (r.max_tokens or 1)  # what the 400 proves
            self.candidates.router.tokens.learn(r.model, len(ex.plan.body), at_least)
            ex.plan.route = replace(r, prompt_tokens=max(r.prompt_tokens, worker.window or 0),
                                    exact=True)  # fmt: skip
            return "context_length"
        return None

    def _larger_window(self, ex: Exchange) -> bool:
        """Whether a worker not tried yet may hold the prompt a context-length 400 measured.
        None may: that 400 is vLLM's answer (not a failure, never a 503: SDKs retry those)."""
        tried = ex.plan.tried | {ex.worker}
        try:
            ranked = self.candidates.of(ex.plan.route, ex.plan.model.name)
        except GatewayError:  # no window holds it, or no worker is left at all
            return False
        return any(w.name not in tried for w in ranked)

    async def _retry(
        self, ex: Exchange, reason: str, worker: Worker | None, failure: bool = True
    ) -> None:
        """Give the slot back and take one on another candidate (the exchange follows)."""
        plan = ex.plan
        ex.prefilled()
        if ex.resp is not None:
            ex.resp.close()
            ex.resp = None
        await self.slots.give(ex.lease)
        plan.tried.add(ex.worker)
        if worker is not None:
            if failure:
                self._failed(worker.name, reason)
            self.metrics.retries.labels(worker.model, worker.name, reason.split()[0]).inc()
        # the reason is the gateway's own words ("status 503", "worker unreachable"), never
        # the worker's address or text: what an operator reads first when a client reports it
        what = "its window is too small" if reason == "context_length" else reason
        if len(plan.tried) > self.routing.retries:
            raise UpstreamError(f"The worker failed ({what}) and retries are exhausted.")
        try:
            ranked = self.candidates.of(plan.route, plan.model.name)
        except GatewayError:
            ranked = []
        remaining = [w.name for w in ranked if w.name not in plan.tried and not plan.pinned]
        if not remaining:
            raise UpstreamUnavailable(
                f"The worker failed ({what}) and no other worker can take it."
            )
        plan.ticket.candidates = remaining
        plan.ticket.prefer_s = 0.0  # the failed worker may have been the one preferred
        ex.lease = await self.slots.take(plan.ticket)

    def broke(self, ex: Exchange, e: UpstreamFailure) -> None:
        """Count a request's failure against its worker; one past a bound on what a worker
        may send (``e.limit``) is logged with the worker's name and the bound."""
        if e.counted:
            return
        e.counted = True
        if e.limit is None:
            self._failed(ex.worker, str(e))
            return
        rid = ex.plan.ctx.request_id
        log.warning("worker %s crossed %s: %s (request %s)", ex.worker, e.limit, e, rid)
        self._failed(ex.worker, f"{e.limit}: {e}")

    def _failed(self, name: str, reason: str) -> None:
        w = self.registry.failed(name, reason, self.routing.fail_threshold)
        if w is not None:
            self.metrics.errors.labels(w.model, w.name, "upstream").inc()
