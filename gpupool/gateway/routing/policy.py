"""Which workers may serve a request, best first. Pure: no I/O, no HTTP.

Candidates are the ready workers of the model whose window holds the prompt, whose window is at
least ``max_tokens`` (vLLM rejects larger), and whose media limits admit the request. They are
ranked by ``rank_key``:

1. **Load band**: quarters of capacity taken by the gateway's own requests in flight. (vLLM's
   scraped running count is a second old, as long as a request here; using it moved traffic off
   a slowed worker but measured a worse p99 in the routing bench.) While requests that only a
   larger window holds were seen lately (``reserve_s``), a worker larger than the smallest window
   that fits pays one band and loses ties: short requests keep the long-context worker free until
   the small one is two bands busier.
2. vLLM's own waiting queue, then its KV-cache usage (quarters).
3. The in-flight count itself (bands are coarse when capacity is large), then the smallest
   window.
4. Workers equal on all of these take turns, so that new conversations arriving at an idle pool
   of equal workers spread instead of piling onto the first by name.

A prefix-affinity hit moves its worker to the front unless that worker is over
``affinity_max_load`` busy *and* another candidate is at least half its capacity less busy: a
miss costs vLLM the whole history's prefill again, and vLLM batches one more short turn on a
busy worker cheaply, so a conversation only moves to escape real overload.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gpupool.workers.registry import Worker

RankKey = tuple[float, float, float, int, float, int]


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


@dataclass(slots=True)
class Decision:
    candidates: list[Worker]
    # Set when no candidate exists: why (for the error message).
    too_long_for: int | None = None  # the largest window among ready workers
    media_refused: bool = False


def fits(worker: Worker, req: RouteRequest) -> bool:
    window = worker.window
    if window is None:
        return not req.exact  # unknown window: only a cheap guess may try it
    return req.prompt_tokens < window


def busy(w: Worker) -> float:
    """The gateway's own requests in flight on the worker."""
    return float(w.inflight)


def busy_fraction(w: Worker) -> float:
    return busy(w) / w.capacity if w.capacity else 1.0


def rank_key(w: Worker, reserve: bool) -> RankKey:
    """Lower is better. ``reserve``: this worker's window is larger than the request needs while
    long requests are about, so it counts one band busier (and loses ties)."""
    band = min(busy_fraction(w), 1.0) // 0.25 + (1 if reserve else 0)
    kv_band = w.kv_usage // 0.25
    return (band, w.vllm_waiting, kv_band, int(reserve), busy(w), w.window or 0)


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
        affinity_max_load: float = 0.75,
        prefix_affinity: bool = True,
        *,
        reserve_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.affinity = AffinityTable()
        self._affinity_max_load = affinity_max_load
        self._use_affinity = prefix_affinity
        self._reserve_s = reserve_s
        self._clock = clock
        self._long_seen: float | None = None
        self._turn = 0

    def decide(self, req: RouteRequest, ready: list[Worker]) -> Decision:
        media_ok = [w for w in ready if w.media.admits(req.image, req.video, req.audio)]
        if ready and not media_ok:
            return Decision([], media_refused=True)
        fitting = [w for w in media_ok if fits(w, req)]
        if not fitting:
            windows = [w.window for w in media_ok if w.window is not None]
            return Decision([], too_long_for=max(windows) if windows else None)
        if req.max_tokens is not None:
            roomy = [w for w in fitting if w.window is None or req.max_tokens <= w.window]
            fitting = roomy or sorted(fitting, key=lambda w: -(w.window or 0))[:1]
        if len(fitting) < len(media_ok):
            self._long_seen = self._clock()  # only the larger windows hold this one
        return Decision(self._apply_affinity(req, self._rank(fitting)))

    def _reserving(self) -> bool:
        seen = self._long_seen
        return seen is not None and self._clock() - seen <= self._reserve_s

    def _rank(self, fitting: list[Worker]) -> list[Worker]:
        smallest = min((w.window for w in fitting if w.window is not None), default=None)
        reserving = smallest is not None and self._reserving()

        def key(w: Worker) -> RankKey:
            larger = w.window is not None and smallest is not None and w.window > smallest
            return rank_key(w, reserving and larger)

        keyed = sorted(((key(w), w.name, w) for w in fitting), key=lambda t: (t[0], t[1]))
        ranked = [w for _, _, w in keyed]
        tied = sum(1 for k, _, _ in keyed if k == keyed[0][0])
        if tied > 1:  # rotate equals so that a burst on an idle pool spreads
            self._turn += 1
            i = self._turn % tied
            ranked[:tied] = ranked[i:tied] + ranked[:i]
        return ranked

    def _apply_affinity(self, req: RouteRequest, ranked: list[Worker]) -> list[Worker]:
        if not self._use_affinity or req.prefix_key is None:
            return ranked
        name = self.affinity.get(req.prefix_key)
        if name is None:
            return ranked
        for i, w in enumerate(ranked):
            if w.name == name and not self._overloaded(w, ranked):
                return [w, *ranked[:i], *ranked[i + 1 :]]
        return ranked

    def _overloaded(self, w: Worker, ranked: list[Worker]) -> bool:
        """Too busy to keep its conversation: over the limit, and another candidate is at least
        two bands (half its capacity) less busy, enough to pay for the history's prefill."""
        if busy_fraction(w) < self._affinity_max_load:
            return False
        margin = w.capacity / 2
        return any(busy(o) <= busy(w) - margin for o in ranked if o is not w)

    def served(self, req: RouteRequest, worker: str) -> None:
        if self._use_affinity and req.prefix_key is not None:
            self.affinity.put(req.prefix_key, worker)
