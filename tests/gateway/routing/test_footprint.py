"""New prompts spread over the workers' caches on equal load (``routing/footprint.py``)."""

from __future__ import annotations

from gpupool.gateway.routing.footprint import BAND_TOKENS, Footprint
from gpupool.gateway.routing.policy import Router
from tests.gateway.routing.test_pace import Clock
from tests.gateway.routing.test_policy import first, req, worker


def test_conversations_opening_together_alternate_instead_of_piling_on_the_small_window() -> None:
    """Twelve conversations of 1,100-token openings on an idle pool: six on each worker, so
    that neither cache evicts its own while the other's sits empty."""
    router = Router()
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    placed = [first(router, req(1100, key=i), [long_w, short_w]) for i in range(12)]
    assert placed.count("short") == 6 and placed.count("long") == 6
    assert placed[0] == "short"  # the smaller window first, as before


def test_a_known_conversation_adds_nothing_and_short_prompts_keep_to_the_small_window() -> None:
    router = Router()
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    router.served(req(1100, key=1), "long")
    for _ in range(3):
        assert first(router, req(1100, key=1), [long_w, short_w]) == "long"  # its history
    assert router.footprint.band("long") == 0
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
    placed = [first(router, req(1100, key=i), [long_w, short_w]) for i in range(12)]
    assert placed.count("short") == 6 and placed.count("long") == 6
