"""Request migration: an answer that broke after it began moves to another worker.

    a worker's connection dies mid-request (``UpstreamFailure.cause``: ``worker_died``, or an
    operator's ``drain``/``restart`` that cut it at its deadline)
        │  ``Migrator.cause``: a cause, migrations left (``routing.migrations``), a route
        │  that can move (chat, completions, messages, responses; never a stored response's
        │  follow-up, pinned to its worker)
        ▼
    ``Migrator.move``: the dead worker's slot given back (the exchange's lease), the worker
        added to the request's ``tried`` (never back to it, so a lying worker is no loop), a
        slot on another candidate taken through admission like any request (its queue, its
        priority, the queue's max wait), the worker's request id ``<id>-m<k>``
        ▼
    the caller sends again: a whole answer, or a stream nothing reached yet, the same body
    (``Dispatcher.send``); a stream that began, its continuation (``transform/
    continuation.py``, by the relay), whose events go on in the client's one stream

The exchange stays the one owner of what is taken: ``move`` swaps its lease, and
``Exchange.aclose`` gives back whichever it holds at the end. Every move is logged with the
request id and both workers (the pool page's recent events) and counted by cause and outcome.
"""

from __future__ import annotations

import logging

from gpupool.gateway.errors import GatewayError
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.candidates import Candidates
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.pipeline.kinds import Shape
from gpupool.gateway.pipeline.slots import Slots
from gpupool.gateway.upstream.common import UpstreamFailure

log = logging.getLogger("gpupool.migrate")

_MOVABLE = (Shape.chat, Shape.messages, Shape.responses)  # and /v1/completions (Shape.none)


class Migrator:
    def __init__(self, limit: int, candidates: Candidates, slots: Slots, metrics: Metrics) -> None:
        self.limit = limit
        self.candidates = candidates
        self.slots = slots
        self.metrics = metrics

    def cause(self, ex: Exchange, e: UpstreamFailure) -> str | None:
        """Why ``ex`` may move after ``e``, or None: it fails as before, or (before the first
        byte) the dispatcher's retry rules apply. Counts nothing: a request that cannot move
        may still be retried, so its ``failed`` is counted where it fails (``gave_up``)."""
        if not self._may_move(ex, e) or ex.plan.migrations >= self.limit:
            return None
        return e.cause

    def gave_up(self, ex: Exchange, e: UpstreamFailure) -> None:
        """``ex`` fails after ``e``: when only its used-up migrations kept it from moving, that
        is counted (outcome ``failed``) and logged. Called where the client gets the error, so
        a request the dispatcher then retries elsewhere is not counted as failed. A request
        pinned to its worker (a stored response's follow-up: only that worker holds its
        conversation) is counted ``refused``."""
        plan = ex.plan
        if plan.pinned and e.cause is not None and self.limit and _movable(ex):
            self.record(ex, e.cause, "refused")
            log.warning("request %s: worker %s failed mid-answer (%s); not continued: "
                        "previous_response_id (only that worker holds the conversation)",
                        plan.ctx.request_id, ex.worker, e.cause)  # fmt: skip
            return
        if not self._may_move(ex, e) or plan.migrations < self.limit:
            return
        assert e.cause is not None
        self.record(ex, e.cause, "failed")
        rid, n = plan.ctx.request_id, plan.migrations
        log.warning("request %s: worker %s failed mid-answer (%s); its %d migrations are "
                    "used up", rid, ex.worker, e.cause, n)  # fmt: skip

    def refuse(self, ex: Exchange, e: UpstreamFailure, why: str) -> None:
        """``ex`` could move after ``e`` but the gateway cannot continue its answer exactly
        (``why``): counted ``refused`` and logged, as the migrating loop's refusals are."""
        if not self._may_move(ex, e) or ex.plan.migrations >= self.limit:
            self.gave_up(ex, e)
            return
        assert e.cause is not None
        self.record(ex, e.cause, "refused")
        log.warning("request %s: worker %s failed mid-answer (%s); not continued: %s",
                    ex.plan.ctx.request_id, ex.worker, e.cause, why)  # fmt: skip

    def _may_move(self, ex: Exchange, e: UpstreamFailure) -> bool:
        """Whether ``e`` is a cause to move and ``ex`` a request that can, migrations aside."""
        return e.cause is not None and bool(self.limit) and not ex.plan.pinned and _movable(ex)

    async def move(self, ex: Exchange, cause: str, what: str) -> bool:
        """Give ``ex``'s slot back and take one on another candidate (True). False when none
        is left or admission refuses (queue full or waited too long): the caller fails the
        request as before. ``what``: how it goes on, for the log line."""
        plan = ex.plan
        old = ex.worker
        ex.prefilled()
        if ex.resp is not None:
            ex.resp.close()
            ex.resp = None
        await self.slots.give(ex.lease)
        plan.tried.add(old)
        plan.migrations += 1
        rid = plan.ctx.request_id
        try:
            ranked = self.candidates.of(plan.route, plan.model.name)
        except GatewayError:
            ranked = []
        remaining = [w.name for w in ranked if w.name not in plan.tried]
        if not remaining:
            self.record(ex, cause, "failed")
            log.warning("request %s: worker %s failed mid-answer (%s); no other worker can "
                        "take it", rid, old, cause)  # fmt: skip
            return False
        plan.ticket.candidates = remaining
        plan.ticket.prefer_s = 0.0
        try:
            ex.lease = await self.slots.take(plan.ticket)
        except GatewayError as err:
            self.record(ex, cause, "failed")
            log.warning("request %s: worker %s failed mid-answer (%s); no worker took it: %s",
                        rid, old, cause, err.message)  # fmt: skip
            return False
        plan.ctx.headers = _renamed(plan.ctx.headers, rid, plan.migrations)
        log.warning("request %s: worker %s failed mid-answer (%s); %s on worker %s",
                    rid, old, cause, what, ex.worker)  # fmt: skip
        return True

    def record(self, ex: Exchange, cause: str, outcome: str, reprefilled: int = 0) -> None:
        """Count one move's outcome; a request's failure is counted once, however many of
        its steps fail (a continuation's send that fails, then its refusal)."""
        if outcome == "failed":
            if ex.plan.migration_failed:
                return
            ex.plan.migration_failed = True
        model = ex.plan.model.name
        self.metrics.migrations.labels(model, cause, outcome).inc()
        if reprefilled:
            self.metrics.reprefilled.labels(model).inc(reprefilled)


def _movable(ex: Exchange) -> bool:
    kind = ex.plan.kind
    if not kind.generates or ex.plan.method != "POST" or ex.plan.target:
        return False
    return kind.shape in _MOVABLE or kind.path == "/v1/completions"


def _renamed(headers: bytes, rid: str, k: int) -> bytes:
    """The worker's head with its request id ``<id>-m<k>``: vLLM's logs and aborts name the
    continuation apart from the first run."""
    line = b"x-request-id: " + rid.encode("latin-1")
    start = headers.rfind(line)
    if start < 0:
        return headers
    end = headers.find(b"\r\n", start)
    return headers[:start] + line + b"-m%d" % k + headers[end:]
