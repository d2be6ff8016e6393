"""Long-window capacity kept free while long prompts come (``routing/reserve.py``)."""

from __future__ import annotations

from gpupool.gateway.routing.pace import Pace
from gpupool.gateway.routing.policy import Router
from gpupool.gateway.routing.reserve import WindowReserve
from tests.gateway.routing.test_pace import Clock
from tests.gateway.routing.test_policy import first, req, scraped, worker


def router(clock: Clock, hold_s: float = 60.0) -> Router:
    r = Router(window_reserve_s=hold_s)
    r.reserve = WindowReserve(hold_s, clock=clock)
    r.pace = Pace(clock=clock)
    return r


def test_without_long_prompts_a_short_request_spills_to_the_idle_long_window() -> None:
    r, long_w, short_w = router(Clock()), worker("long", 8192), worker("short", 2048, inflight=1)
    assert first(r, req(300), [long_w, short_w]) == "long"


def test_after_a_long_prompt_short_requests_fill_the_small_window_first() -> None:
    clock = Clock()
    r, long_w, short_w = router(clock), worker("long", 8192), worker("short", 2048)
    assert first(r, req(3000), [long_w, short_w]) == "long"  # only `long` holds it
    for inflight in range(4):  # three busy slots of four: `short` still has one
        short_w.inflight = inflight
        assert first(r, req(300), [long_w, short_w]) == "short"
    short_w.inflight = 4  # full: the long window takes it rather than a queue
    assert first(r, req(300), [long_w, short_w]) == "long"


def test_the_reserve_ends_when_no_long_prompt_came_for_its_hold() -> None:
    clock = Clock()
    r, long_w, short_w = router(clock), worker("long", 8192), worker("short", 2048, inflight=2)
    first(r, req(3000), [long_w, short_w])
    clock.now += 59
    assert first(r, req(300), [long_w, short_w]) == "short"
    clock.now += 2
    assert first(r, req(300), [long_w, short_w]) == "long"


def test_a_hold_of_zero_keeps_nothing() -> None:
    clock = Clock()
    r, long_w, short_w = router(clock, 0), worker("long", 8192), worker("short", 2048, inflight=1)
    first(r, req(3000), [long_w, short_w])
    assert first(r, req(300), [long_w, short_w]) == "long"


def test_a_small_window_that_is_queueing_or_runs_outside_work_is_not_kept_busier() -> None:
    clock = Clock()
    long_w = worker("long", 8192)
    r = router(clock)
    first(r, req(3000), [long_w, worker("short", 2048)])
    waiting = worker("short", 2048, inflight=1, vllm_waiting=2)
    assert first(r, req(300), [long_w, waiting]) == "long"
    outside = scraped(worker("short", 2048), running=1)
    assert first(r, req(300), [long_w, outside]) == "long"


def test_a_slow_small_window_is_not_kept_busier() -> None:
    clock = Clock()
    r, long_w, short_w = router(clock), worker("long", 8192), worker("short", 2048, inflight=1)
    r.served(req(300, max_tokens=16), "long", 0.1)
    r.served(req(300, max_tokens=16), "short", 0.4)  # four times slower
    first(r, req(3000), [long_w, short_w])
    assert first(r, req(300), [long_w, short_w]) == "long"


def test_the_reserve_covers_every_window_a_long_prompt_needed() -> None:
    """2K, 4K and 8K workers: a 3K prompt keeps 4K and 8K for long prompts, so a short request
    goes to 2K with a free slot; a 2.5K prompt, which 4K holds, still goes to the idle 4K."""
    clock = Clock()
    r = router(clock)
    small, mid, big = worker("a", 2048, inflight=2), worker("b", 4096), worker("c", 8192)
    assert first(r, req(3000), [small, mid, big]) == "b"
    assert first(r, req(300), [small, mid, big]) == "a"
    assert first(r, req(2500), [small, mid, big]) in {"b", "c"}


def test_a_conversation_on_the_long_window_stays_there() -> None:
    """Moving it would re-read its whole history: affinity still wins over the reserve."""
    clock = Clock()
    r, long_w, short_w = router(clock), worker("long", 8192), worker("short", 2048)
    r.served(req(key=7), "long")
    first(r, req(3000), [long_w, short_w])
    assert first(r, req(300, key=7), [long_w, short_w]) == "long"
    assert first(r, req(300, key=8), [long_w, short_w]) == "short"
