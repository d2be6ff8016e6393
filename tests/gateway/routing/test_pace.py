"""How fast each worker served the gateway's requests, and what that does to the ranking."""

from __future__ import annotations

from gpupool.gateway.routing.pace import Pace
from gpupool.gateway.routing.policy import Router, RouteRequest
from tests.gateway.routing.test_policy import first, worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def short_req(tokens: int = 300) -> RouteRequest:
    return RouteRequest("m", tokens, False, max_tokens=16)


def router_with(clock: Clock) -> Router:
    r = Router()
    r.pace = Pace(clock=clock)
    return r


def short_slowed(clock: Clock) -> Router:
    """A router that saw `short` serve a request three times slower than `long`."""
    r = router_with(clock)
    r.served(short_req(), "short", 0.5)
    r.served(short_req(), "long", 0.16)
    return r


def test_a_worker_serving_three_times_slower_loses_the_smaller_windows_tie() -> None:
    """Work the gateway never sees (a client going around it) slows `short`: its requests take
    three times as long. On equal load the request goes to `long`, not to the smaller window."""
    clock = Clock()
    router = router_with(clock)
    for _ in range(3):
        router.served(short_req(), "short", 0.5)
        router.served(short_req(), "long", 0.16)
    assert first(router, short_req(), [worker("long", 8192), worker("short", 2048)]) == "long"


def test_a_slow_worker_still_takes_a_request_when_the_other_is_a_band_busier_still() -> None:
    router = short_slowed(Clock())
    long_w, short_w = worker("long", 8192, inflight=2), worker("short", 2048)
    assert first(router, short_req(), [long_w, short_w]) == "short"  # band 2 against 0 + 1


def test_long_prompts_do_not_make_their_worker_look_slow() -> None:
    """`long` served 2,600-token prompts, `short` 300-token ones, each at the same pace per
    unit of work: nobody is slow, and a short request keeps to the smaller window."""
    clock = Clock()
    router = router_with(clock)
    router.served(short_req(2600), "long", 0.55)
    router.served(short_req(300), "short", 0.2)
    assert router.pace.slow([worker("long", 8192), worker("short", 2048)]) is None
    assert first(router, short_req(), [worker("long", 8192), worker("short", 2048)]) == "short"


def test_a_slow_figure_stops_counting_once_it_is_stale() -> None:
    """A worker that got nothing because it was slow is tried again after `stale_s`."""
    clock = Clock()
    router = short_slowed(clock)
    workers = [worker("long", 8192), worker("short", 2048)]
    assert first(router, short_req(), workers) == "long"
    clock.now += 5
    router.served(short_req(), "long", 0.16)  # only `long` keeps serving
    clock.now += 6  # `short`'s figure is 11 s old now
    assert first(router, short_req(), workers) == "short"


def test_a_fresh_sample_replaces_a_stale_figure_instead_of_averaging_with_it() -> None:
    clock = Clock()
    pace = Pace(clock=clock)
    pace.observe("a", 1.0, 100, 0)  # 10 ms a unit
    pace.observe("b", 0.1, 100, 0)
    clock.now += 11
    pace.observe("a", 0.1, 100, 0)
    pace.observe("b", 0.1, 100, 0)
    assert pace.slow([worker("a"), worker("b")]) is None


def test_one_slow_request_moves_the_figure_a_third_of_the_way() -> None:
    clock = Clock()
    pace = Pace(clock=clock)
    for _ in range(5):
        pace.observe("a", 0.1, 100, 0)
        pace.observe("b", 0.1, 100, 0)
    pace.observe("a", 0.4, 100, 0)  # 4x once: 1 + 0.3 * 3 = 1.9x, under 2x
    assert pace.slow([worker("a"), worker("b")]) is None
    pace.observe("a", 0.4, 100, 0)  # twice in a row: 2.3x
    assert pace.slow([worker("a"), worker("b")]) == {"a": 1}


def test_the_penalty_grows_by_a_band_per_doubling_up_to_three() -> None:
    clock = Clock()
    pace = Pace(alpha=1.0, clock=clock)
    pace.observe("fast", 0.1, 100, 0)
    for ratio, bands in ((3, 1), (5, 2), (9, 3), (40, 3)):
        pace.observe("slow", 0.1 * ratio, 100, 0)
        assert pace.slow([worker("fast"), worker("slow")]) == {"slow": bands}


def test_a_request_without_a_known_length_or_time_teaches_nothing() -> None:
    router = Router()
    router.served(RouteRequest("m", 300, False), "a", 0.5)  # no max_tokens, no usage seen
    router.served(short_req(), "a", 0.0)  # a retried request
    assert router.pace.slow([worker("a"), worker("b")]) is None
    router.served(RouteRequest("m", 300, False), "a", 0.5, output_tokens=16)  # usage seen
    router.served(RouteRequest("m", 300, False), "b", 0.1, output_tokens=16)
    assert router.pace.slow([worker("a"), worker("b")]) == {"a": 2}


def test_a_short_request_worker_is_not_slow_beside_one_serving_long_prompts_on_a_gpu() -> None:
    """On a GPU a prompt token is far cheaper than a decode step's 64 units: `long` served
    3,000-token prompts with 16 output tokens in 0.3 s, `short` 300-token ones with 64 in 1 s,
    four times its pace per unit. They share no size class, so neither is slow, and the short
    request keeps to the smaller window."""
    clock = Clock()
    router = router_with(clock)
    for _ in range(3):
        router.served(RouteRequest("m", 3000, False, max_tokens=16), "long", 0.3)
        router.served(RouteRequest("m", 300, False, max_tokens=64), "short", 1.0)
    workers = [worker("long", 8192), worker("short", 2048)]
    assert router.pace.slow(workers) is None
    assert first(router, short_req(), workers) == "short"


def test_workers_are_compared_on_the_sizes_they_both_served() -> None:
    """`long` also served short requests, and there `short` took three times as long: slow."""
    clock = Clock()
    router = router_with(clock)
    router.served(RouteRequest("m", 3000, False, max_tokens=16), "long", 0.3)
    router.served(short_req(), "long", 0.16)
    router.served(short_req(), "short", 0.5)
    assert router.pace.slow([worker("long", 8192), worker("short", 2048)]) == {"short": 1}


def test_a_worker_slow_at_one_size_but_not_at_another_is_not_slow() -> None:
    """Slow means slow at every size it shares: one class's outlier is not enough."""
    pace = Pace(alpha=1.0, clock=Clock())
    pace.observe("a", 0.5, 300, 16)
    pace.observe("b", 0.1, 300, 16)
    pace.observe("a", 0.3, 3000, 16)
    pace.observe("b", 0.3, 3000, 16)
    assert pace.slow([worker("a"), worker("b")]) is None
    pace.observe("a", 1.0, 3000, 16)
    assert pace.slow([worker("a"), worker("b")]) == {"a": 1}
