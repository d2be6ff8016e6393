"""Which workers may serve a request, best first. Pure: no I/O, no HTTP.

Candidates are the ready workers of the model whose window holds the prompt, whose window is at
least ``max_tokens`` (vLLM rejects larger), and whose media limits admit the request. They are
ranked by load: the share of its capacity a worker holds (the gateway's own requests, counted
the moment they are placed, plus the work vLLM showed beyond them at the last scrape,
``Worker.busy``), so that no worker is filled past its neighbour while the neighbour has room,
and requests placed in the same instant see each other. Equal loads are broken by vLLM's own
waiting queue and KV-cache usage, then by how many new prompt tokens each cache took in lately
(``footprint.py``), then the smallest window. While prompts that only the larger windows hold
have come lately, a request that fits a smaller window stays on a smaller-window worker with a
free slot (``reserve.py``), so that short requests keep long-context capacity free. A worker
that has lately served the gateway's requests at least twice as slowly as the best one
(``pace.py``) counts a quarter of its capacity busier per doubling and, on a tie, ranks after
the others; so does, on a tie, a worker running work that did not come through the gateway.

With KV-cache events (``routing.kv_events``, ``gateway/kvroute``) the request carries, per
worker whose cache is known exactly, the prompt tokens vLLM will find cached there
(``RouteRequest.kv``). The worker holding the most then moves to the front under the same
rules as affinity: it has a free slot and is among the least busy (``kv_events.max_lead``: how
much busier it may be; one holding most of the prompt may also be one request past them, the
request's prefill saved and its prefix not copied into a second cache), its engine queues no
more than another's; when every candidate is full
the request is first in line for its next slot for ``affinity_wait_s``. When no candidate is
known to hold any of it, today's affinity decides: it spreads the openings of conversations it
has seen (the throughput guard's burst after its rounds piled six openings on one worker when
load alone decided there, a slow worker's pace penalty tipping every tie).

Prefix affinity moves a conversation's worker to the front while it has a free slot and is
among the least busy candidates (``affinity_max_lead``, 0 by default: how much busier it may
be), so vLLM's prefix cache is reused without piling a shared prompt onto one worker. When
every candidate is full the request queues on all of them, first in line for its own worker's
next slot for a while (``Decision.prefer_s``); admission still hands it any slot that frees
and nobody else takes, so a preference never leaves a slot empty (work-conserving).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from gpupool.config.models import RoutingConfig
from gpupool.gateway.routing.cached import KvPrediction
from gpupool.gateway.routing.estimate import TokenEstimate
from gpupool.gateway.routing.footprint import Footprint
from gpupool.gateway.routing.pace import Pace
from gpupool.gateway.routing.reserve import WindowReserve
from gpupool.workers.registry import Worker


@dataclass(slots=True, frozen=True)
class RouteRequest:
    model: str
    prompt_tokens: int  # exact count, or an upper bound when ``exact`` is False
    exact: bool
    max_tokens: int | None = None
    image: int = 0
    video: int = 0
    audio: int = 0
    prefix_key: int | None = None
    kv: KvPrediction | None = None  # cached tokens per exactly known worker (KV events)


@dataclass(slots=True)
class Decision:
    candidates: list[Worker]
    # Set when no candidate exists: why (for the error message).
    too_long_for: int | None = None  # the largest window among ready workers
    media_refused: bool = False
    # Seconds a queued request is first in line for candidates[0], a conversation's worker,
    # before plain queue order (0: none). Admission stays work-conserving either way.
    prefer_s: float = 0.0


def fits(worker: Worker, req: RouteRequest) -> bool:
    window = worker.window
    if window is None:
        return not req.exact  # unknown window: only a cheap guess may try it
    return req.prompt_tokens < window


Rank = tuple[float, float, float, int, bool, int, int, str]

PENALTY_LOAD = 0.25  # a slow worker counts this share of its capacity busier per doubling


def _rank_key(w: Worker, penalty: int, cached: int) -> Rank:
    """Least loaded first. On equal load a worker running outside work ranks after one whose
    load is all the gateway's own: what the gateway sent it knows, what came around it it does
    not. Then the one whose cache took in fewer new prompts lately (``footprint.py``), then the
    smaller window."""
    load = min(w.busy, 1.0) + penalty * PENALTY_LOAD
    kv_band = w.kv_usage // 0.25
    return (load, w.vllm_waiting, kv_band, penalty, w.vllm_external > 0, cached, w.window or 0,
            w.name)  # fmt: skip


def _rank(workers: list[Worker], slow: dict[str, int] | None, footprint: Footprint) -> None:
    """Sort best first; ``slow``: each slow worker's penalty (``Pace.slow``)."""
    slow = slow or {}
    workers.sort(key=lambda w: _rank_key(w, slow.get(w.name, 0), footprint.band(w.name)))


def _keep_long_free(ranked: list[Worker], reserved: int, slow: dict[str, int] | None) -> None:
    """Move the best worker whose window is below ``reserved`` to the front when a worker of a
    reserved window leads and that one has a free slot and is neither slow, queueing, nor
    running work the gateway did not send."""
    top = ranked[0].window
    if top is None or top < reserved:
        return
    for i, w in enumerate(ranked):
        window = w.window
        if (
            window is not None
            and window < reserved
            and w.busy < 1.0
            and not w.vllm_waiting
            and not w.vllm_external
            and not (slow and slow.get(w.name))
        ):
            ranked.insert(0, ranked.pop(i))
            return


class AffinityTable:
    """Bounded LRU map from a conversation prefix to the worker that served it last."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._map: OrderedDict[int, str] = OrderedDict()

    def get(self, key: int) -> str | None:
        name = self._map.get(key)
        if name is not None:
            self._map.move_to_end(key)
        return name

    def put(self, key: int, worker: str) -> None:
        self._map[key] = worker
        self._map.move_to_end(key)
        if len(self._map) > self._size:
            self._map.popitem(last=False)


class Router:
    def __init__(
        self,
        affinity_max_load: float = 1.0,
        prefix_affinity: bool = True,
        window_reserve_s: float = 60.0,
        affinity_wait_s: float = 2.0,
        affinity_max_lead: float = 0.0,
        kv_max_lead: float = 0.0,
    ) -> None:
        self.affinity = AffinityTable()
        self.tokens = TokenEstimate()  # a prompt's tokens from its bytes, learned per model
        self.pace = Pace()  # how fast each worker served the gateway's requests lately
        self.reserve = WindowReserve(window_reserve_s)  # long windows kept for long prompts
        self.footprint = Footprint()  # new prompt tokens each worker's cache took in lately
        self._affinity_max_load = affinity_max_load
        self._affinity_max_lead = affinity_max_lead
        self._kv_max_lead = kv_max_lead
        self._use_affinity = prefix_affinity
        self._affinity_wait_s = affinity_wait_s

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> Router:
        router = cls()
        router.configure(routing)
        return router

    def configure(self, routing: RoutingConfig) -> None:
        """The routing settings (at start, and a reload's at once); what was learned stays."""
        self._affinity_max_load = routing.affinity_max_load
        self._affinity_max_lead = routing.affinity_max_lead
        self._kv_max_lead = routing.kv_events.max_lead
        self._use_affinity = routing.prefix_affinity
        self._affinity_wait_s = routing.affinity_wait_s
        self.reserve.hold_s = routing.window_reserve_s

    def decide(self, req: RouteRequest, ready: list[Worker]) -> Decision:
        if req.image or req.video or req.audio:
            media_ok = [w for w in ready if w.media.admits(req.image, req.video, req.audio)]
            if ready and not media_ok:
                return Decision([], media_refused=True)
        else:
            media_ok = ready
        fitting = [w for w in media_ok if fits(w, req)]
        if not fitting:
            windows = [w.window for w in media_ok if w.window is not None]
            return Decision([], too_long_for=max(windows) if windows else None)
        if len(fitting) < len(media_ok):
            self._note_long(req, media_ok, fitting)
        if req.max_tokens is not None:
            roomy = [w for w in fitting if w.window is None or req.max_tokens <= w.window]
            fitting = roomy or sorted(fitting, key=lambda w: -(w.window or 0))[:1]
        if len(fitting) == 1:
            return Decision(fitting)  # nothing to rank, and affinity can only name it
        slow = self.pace.slow(fitting)
        _rank(fitting, slow, self.footprint)
        reserved = self.reserve.window(req.model)
        if reserved is not None:
            _keep_long_free(fitting, reserved, slow)
        return self._apply_affinity(req, fitting)

    def _note_long(self, req: RouteRequest, media_ok: list[Worker], fitting: list[Worker]) -> None:
        """A known window too small for the prompt makes it a long one (``reserve.py``)."""
        if any(w.window is not None and not fits(w, req) for w in media_ok):
            need = min((w.window for w in fitting if w.window is not None), default=None)
            if need is not None:
                self.reserve.saw_long(req.model, need)

    def _apply_cached(self, kv: KvPrediction, ranked: list[Worker]) -> Decision | None:
        """The ranking with the worker that holds most of the prompt first, when it may take
        it (see the module's docstring); None when no candidate is known to hold any."""
        cached = kv.cached
        holders = [w for w in ranked if cached.get(w.name, 0) > 0]
        if not holders:
            return None
        if self._affinity_wait_s > 0 and all(x.inflight >= x.capacity for x in ranked):
            best = max(holders, key=lambda w: cached[w.name])  # the first of the most: by rank
            ranked.remove(best)
            return Decision([best, *ranked], prefer_s=self._affinity_wait_s)
        least = min(min(w.busy, 1.0) for w in ranked)
        least_waiting = min(x.vllm_waiting for x in ranked)
        eligible = [
            w
            for w in holders
            if w.busy_steady < self._affinity_max_load
            and w.busy_steady - least <= self._kv_lead(w, cached[w.name], kv.tokens)
            and w.vllm_waiting <= least_waiting
        ]
        if not eligible:
            return Decision(ranked)  # no piling on a holder that is busier: load decides
        best = max(eligible, key=lambda w: cached[w.name])
        ranked.remove(best)
        return Decision([best, *ranked])

    def _kv_lead(self, w: Worker, cached: int, tokens: int) -> float:
        """How much busier than the least busy candidate a holder may be and still lead:
        ``kv_events.max_lead``, and at least one request (a slot of its capacity) when it holds
        most of the prompt. Sent elsewhere, such a request costs its whole prefill there and
        copies its prefix into a second cache, evicting other prefixes; on the holder it is
        one more decode in the batch. One request, never more: a worker of many slots (a GPU's)
        is barely uneven, one of few is one request ahead at most (the throughput guard)."""
        if cached * 2 < tokens or w.capacity <= 0:
            return self._kv_max_lead
        return max(self._kv_max_lead, 1 / w.capacity + 1e-9)

    def _apply_affinity(self, req: RouteRequest, ranked: list[Worker]) -> Decision:
        if req.kv is not None:
            decided = self._apply_cached(req.kv, ranked)
            if decided is not None:
                return decided
        if not self._use_affinity or req.prefix_key is None:
            return Decision(ranked)
        name = self.affinity.get(req.prefix_key)
        if name is None:
            return Decision(ranked)
        least = min(min(w.busy, 1.0) for w in ranked)
        for i, w in enumerate(ranked):
            if w.name != name:
                continue
            if self._affinity_wait_s > 0 and all(x.inflight >= x.capacity for x in ranked):
                # every candidate full: queue on all, first in line for this one's next slot
                first = [w, *ranked[:i], *ranked[i + 1 :]]
                return Decision(first, prefer_s=self._affinity_wait_s)
            # Steady: moving a conversation for a phantom request would re-read its history.
            # A busier worker keeps it only within the lead, and not while its engine queues
            # and another's does not: a shared prompt must not fill one worker while another
            # has room.
            if (
                w.busy_steady < self._affinity_max_load
                and w.busy_steady - least <= self._affinity_max_lead
                and w.vllm_waiting <= min(x.vllm_waiting for x in ranked)
            ):
                return Decision([w, *ranked[:i], *ranked[i + 1 :]])
            break
        return Decision(ranked)

    def served(
        self, req: RouteRequest, worker: str, seconds: float = 0.0, output_tokens: int = 0
    ) -> None:
        """``worker`` answered ``req`` in ``seconds`` (0: unknown), ``output_tokens`` long (0:
        unknown; then its ``max_tokens`` if it had one)."""
        if self._use_affinity and req.prefix_key is not None:
            if self.affinity.get(req.prefix_key) is None:  # a new prompt went into its cache
                self.footprint.add(worker, req.prompt_tokens)
            self.affinity.put(req.prefix_key, worker)
        out = output_tokens or req.max_tokens
        if seconds > 0 and out:
            self.pace.observe(worker, seconds, req.prompt_tokens, out)
