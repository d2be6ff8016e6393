"""New prompts spread over the workers' caches on equal load (``routing/footprint.py``)."""

from __future__ import annotations

from gpupool.gateway.routing.footprint import BAND_TOKENS, Footprint
from gpupool.gateway.routing.policy import Router, RouteRequest
from gpupool.workers.registry import Worker
from tests.gateway.routing.test_pace import Clock
from tests.gateway.routing.test_policy import first, req, worker


def _place(router: Router, r: RouteRequest, workers: list[Worker]) -> str:
    """Decide and take the slot, as the pipeline does with no await between."""
    w = router.decide(r, workers).candidates[0]
    w.inflight += 1
    return w.name


def test_conversations_opening_together_alternate_instead_of_piling_on_the_small_window() -> None:
    """Twelve conversations of 1,100-token openings placed in the same instant on an idle
    pool: six on each worker (each placement counts on its worker before the next decision),
    so that neither cache evicts its own while the other's sits empty."""
    router = Router()
    long_w, short_w = worker("long", 8192, 8), worker("short", 2048, 8)
    placed = [_place(router, req(1100, key=i), [long_w, short_w]) for i in range(12)]
    assert placed.count("short") == 6 and placed.count("long") == 6
    assert placed[0] == "short"  # the smaller window first, as before


def test_openings_that_end_before_the_next_spread_by_what_each_cache_took_in() -> None:
    """One after the other on an idle pool (each served before the next comes): the cache
    that took in the last opening ranks after the other on the next tie."""
    router = Router()
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    placed = []
    for i in range(6):
        r = req(1100, key=i)
        name = first(router, r, [long_w, short_w])
        router.served(r, name)
        placed.append(name)
    assert placed.count("short") == 3 and placed.count("long") == 3


def test_a_known_conversation_adds_nothing_and_short_prompts_keep_to_the_small_window() -> None:
    router = Router()
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    router.served(req(1100, key=1), "long")  # its opening went into long's cache
    assert router.footprint.band("long") == 1
    for _ in range(3):
        r = req(1100, key=1)
        assert first(router, r, [long_w, short_w]) == "long"  # its history
        router.served(r, "long")
    assert router.footprint.band("long") == 1  # later turns add nothing
    assert {first(router, req(100, key=k), [long_w, short_w]) for k in range(2, 6)} == {"short"}


def test_the_footprint_halves_every_half_life() -> None:
    clock = Clock()
    fp = Footprint(half_life_s=60, clock=clock)
    fp.add("a", 4 * BAND_TOKENS)
    assert fp.band("a") == 4 and fp.band("b") == 0
    clock.now += 60
    assert fp.band("a") == 2
    fp.add("a", BAND_TOKENS)
    assert fp.band("a") == 3


def test_intake_a_minute_old_does_not_decide_where_conversations_open() -> None:
    """The seventh pass's collapse: a flood kept on the small window put it 40 bands ahead;
    a minute later twelve conversations opened, and with a 60-s half-life all twelve went to
    the other worker. Now the old intake has faded and they split evenly."""
    clock = Clock()
    router = Router()
    router.footprint = Footprint(clock=clock)
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    router.footprint.add("short", 40 * BAND_TOKENS)
    clock.now += 60
    placed = []
    for i in range(12):
        r = req(1100, key=i)
        placed.append(first(router, r, [long_w, short_w]))
        router.served(r, placed[-1])
    assert placed.count("short") == 6 and placed.count("long") == 6
