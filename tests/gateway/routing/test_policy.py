"""The routing policy, pure: workers are registry dataclasses, no HTTP."""

from __future__ import annotations

from gpupool.config.models import RoutingConfig
from gpupool.gateway.routing.policy import Router, RouteRequest
from gpupool.workers.registry import MediaCaps, Registry, Worker, WorkerState


def worker(name: str, window: int = 4096, capacity: int = 4, **load: float) -> Worker:
    w = Worker(name, "m", url=f"http://{name}", state=WorkerState.ready, max_model_len=window,
               capacity=capacity)  # fmt: skip
    w.inflight = int(load.pop("inflight", 0))
    for k, v in load.items():
        setattr(w, k, v)
    return w


def req(tokens: int = 100, key: int | None = None, **kw: int) -> RouteRequest:
    return RouteRequest("m", tokens, True, prefix_key=key, **kw)


def first(router: Router, r: RouteRequest, workers: list[Worker]) -> str:
    return router.decide(r, workers).candidates[0].name


def test_a_conversation_returns_to_its_worker_while_it_is_among_the_least_busy() -> None:
    router, a, b = Router(), worker("a", inflight=1), worker("b", inflight=1)
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "a"  # a tie: its cache decides
    b.inflight = 0
    assert first(router, req(key=7), [a, b]) == "b"  # busier than b: it moves


def test_a_wider_lead_keeps_a_conversation_on_a_busier_worker() -> None:
    router, a, b = Router(affinity_max_lead=0.25), worker("a", inflight=1), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "a"  # a quarter busier: within the lead


def test_a_conversation_leaves_a_worker_busier_than_the_lead_while_another_idles() -> None:
    """Affinity never fills one worker while another has room to spare: with every client
    sending the same prompt it would pile them all on one worker (issue 25's lane skew)."""
    router, a, b = Router(), worker("a", inflight=3), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"
    assert first(Router(affinity_max_lead=0.75), req(key=7), [a, b]) == "b"  # no entry there
    wide = Router(affinity_max_lead=0.75)
    wide.served(req(key=7), "a")
    assert first(wide, req(key=7), [a, b]) == "a"


def test_a_conversation_leaves_a_worker_whose_engine_queues_while_another_does_not() -> None:
    router, a, b = Router(), worker("a", inflight=1, vllm_waiting=2), worker("b", inflight=1)
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"


def test_with_every_worker_full_a_conversation_queues_first_in_line_for_its_own() -> None:
    """No slot anywhere: the request queues on every candidate, first in line for `a`'s next
    slot for a while (admission still gives it `b`'s if nobody else takes that one)."""
    router, a, b = Router(affinity_wait_s=1.5), worker("a", inflight=4), worker("b", inflight=4)
    router.served(req(key=7), "a")
    d = router.decide(req(key=7), [a, b])
    assert [w.name for w in d.candidates] == ["a", "b"] and d.prefer_s == 1.5
    b.inflight = 3  # a slot free elsewhere: taken at once, no preference, no wait
    d = router.decide(req(key=7), [a, b])
    assert [w.name for w in d.candidates] == ["b", "a"] and d.prefer_s == 0.0


def test_a_conversation_leaves_a_full_worker_at_once_without_the_wait() -> None:
    router, a, b = Router(affinity_wait_s=0), worker("a", inflight=4), worker("b", inflight=1)
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"


def test_a_worker_full_of_outside_work_is_left_without_waiting() -> None:
    """Admission cannot see a slot free up there: another replica's or a client's work."""
    router, a, b = Router(), worker("a", inflight=1, vllm_external=3), worker("b", inflight=1)
    a.vllm_external_steady = 3
    router.served(req(key=7), "a")
    d = router.decide(req(key=7), [a, b])
    assert d.candidates[0].name == "b" and d.prefer_s == 0.0


def test_a_lower_affinity_limit_moves_a_conversation_sooner() -> None:
    router, a, b = Router(affinity_max_load=0.75), worker("a", inflight=3), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"


def test_vllm_waiting_queue_ranks_a_worker_after_one_without() -> None:
    router = Router()
    waiting, free = worker("a", vllm_waiting=1), worker("b", vllm_waiting=0)
    assert first(router, req(), [waiting, free]) == "b"


def test_on_an_idle_pool_a_short_request_takes_the_smallest_window() -> None:
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    assert {first(Router(), req(300), [long_w, short_w]) for _ in range(4)} == {"short"}


def test_a_short_request_spills_to_the_long_window_once_the_small_one_is_busier() -> None:
    long_w, short_w = worker("long", 8192), worker("short", 2048, inflight=1)
    assert first(Router(), req(300), [long_w, short_w]) == "long"


def test_a_conversation_on_a_full_worker_is_placed_like_a_new_one_without_the_wait() -> None:
    router, a, b = Router(affinity_wait_s=0), worker("a", inflight=4), worker("b", inflight=4)
    router.served(req(key=7), "b")
    assert first(router, req(key=7), [a, b]) == "a"  # equal load: by name, not by affinity


def test_a_prompt_longer_than_every_window_names_the_largest() -> None:
    d = Router().decide(req(5000), [worker("a", 4096), worker("b", 2048)])
    assert d.candidates == [] and d.too_long_for == 4096


def test_a_worker_whose_window_is_below_max_tokens_is_skipped() -> None:
    d = Router().decide(req(100, max_tokens=3000), [worker("a", 4096), worker("b", 2048)])
    assert [w.name for w in d.candidates] == ["a"]


def test_images_only_go_to_workers_that_admit_them() -> None:
    text_only = worker("a")
    text_only.media = MediaCaps(image=0)
    d = Router().decide(req(100, image=1), [text_only])
    assert d.candidates == [] and d.media_refused


def scraped(w: Worker, running: float, before: tuple[int, int] | None = None) -> Worker:
    """``w`` after a scrape showing ``running`` requests; ``before``: its (inflight,
    requests_total) when the scrape was sent (default: as now)."""
    reg = Registry()
    reg.add(w)
    reg.scraped(w.name, 0.0, running, 0.0, before or (w.inflight, w.requests_total))
    return w


def test_work_that_went_around_the_gateway_ranks_its_worker_after_an_idle_one() -> None:
    """Three requests sent straight to `short` (another replica, a client going around the
    gateway): the short request goes to `long`, though `short` has the smaller window."""
    long_w, short_w = worker("long", 8192), scraped(worker("short", 2048), running=3)
    assert first(Router(), req(300), [long_w, short_w]) == "long"


def test_the_gateways_own_requests_in_a_scrape_are_not_someone_elses() -> None:
    own = scraped(worker("short", 2048, inflight=1), running=1)
    assert own.vllm_external == 0
    assert first(Router(), req(300), [worker("long", 8192, inflight=1), own]) == "short"


def test_a_scrape_taken_before_the_gateways_requests_ended_shows_no_outside_work() -> None:
    """The scrape was sent while two of the gateway's requests ran; both ended before routing
    reads it. Against the in-flight count now they would look like outside work."""
    short_w = scraped(worker("short", 2048), running=2, before=(2, 0))
    assert short_w.vllm_external == 0
    assert first(Router(), req(300), [worker("long", 8192), short_w]) == "short"


def test_requests_the_gateway_started_while_the_scrape_ran_are_its_own() -> None:
    w = worker("short", 2048, inflight=1)
    w.requests_total = 1  # started after the scrape was sent, shown by it
    assert scraped(w, running=1, before=(0, 0)).vllm_external == 0


def test_a_conversation_leaves_a_worker_full_of_outside_work() -> None:
    router, a, b = Router(), scraped(scraped(worker("a"), running=4), running=4), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"


def test_a_conversation_stays_for_outside_work_one_scrape_showed() -> None:
    """vLLM may list a request of the gateway's a step after it ended: one scrape showing the
    worker full must not make a conversation re-read its history elsewhere."""
    router, a, b = Router(), scraped(worker("a"), running=6), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "a"
    scraped(a, running=6)  # and the next one too: the worker is full
    assert first(router, req(key=7), [a, b]) == "b"


def test_on_equal_load_a_worker_without_outside_work_wins_over_the_smaller_window() -> None:
    """`long` runs one of the gateway's requests; `short` one that came around the gateway
    (a scrape shows it): both are a band busy, and the gateway knows what its own one costs."""
    long_w = worker("long", 8192, inflight=1)
    short_w = scraped(worker("short", 2048), running=1)
    assert first(Router(), req(300), [long_w, short_w]) == "long"


def test_outside_work_missed_by_one_scrape_still_counts_until_the_next() -> None:
    """vLLM counts a request only once it is tokenized: a scrape between two of a hog's
    requests shows fewer than are there."""
    w = scraped(worker("short", 2048), running=3)
    assert scraped(w, running=1).vllm_external == 3
    assert scraped(w, running=2).vllm_external == 2


def test_a_queue_of_outside_work_is_forgotten_one_scrape_after_it_emptied() -> None:
    """Another router's flood left 40 requests queued on the worker; once a scrape shows them
    gone, the next one clears them (a slow decay kept the worker looking busy for 40 s)."""
    w = worker("long", 8192)
    reg = Registry()
    reg.add(w)
    reg.scraped("long", 36.0, 4.0, 0.5, (0, 0))
    assert w.vllm_external == 40
    reg.scraped("long", 0.0, 0.0, 0.0, (0, 0))
    assert w.vllm_external == 40
    reg.scraped("long", 0.0, 0.0, 0.0, (0, 0))
    assert w.vllm_external == 0


def test_a_reload_changes_how_the_router_places_at_once() -> None:
    """``Router.configure``: the new settings decide the next request; what was learned
    (the conversation's worker) stays."""
    router, a, b = Router(), worker("a", inflight=1), worker("b")
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"
    wider = RoutingConfig(affinity_max_lead=0.5)
    router.configure(wider)
    assert first(router, req(key=7), [a, b]) == "a"
    router.configure(RoutingConfig(prefix_affinity=False, affinity_max_lead=0.5))
    assert first(router, req(key=7), [a, b]) == "b"
