"""The routing policy, pure: workers are registry dataclasses, no HTTP, a fake clock."""

from __future__ import annotations

from gpupool.gateway.routing.policy import Router, RouteRequest
from gpupool.workers.registry import MediaCaps, Worker, WorkerState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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


def test_new_conversations_on_an_idle_pool_spread_over_the_workers() -> None:
    router, pool = Router(), [worker("a"), worker("b")]
    chosen = [first(router, req(key=i), pool) for i in range(6)]
    assert chosen.count("a") == chosen.count("b") == 3


def test_a_conversation_returns_to_its_worker_while_it_is_not_overloaded() -> None:
    router, a, b = Router(), worker("a"), worker("b")
    router.served(req(key=7), "a")
    a.inflight = 2  # half busy; b idle: a miss would cost the whole history's prefill
    assert first(router, req(key=7), [a, b]) == "a"


def test_a_conversation_leaves_an_overloaded_worker_for_a_less_busy_one() -> None:
    router, a, b = Router(), worker("a", inflight=3), worker("b", inflight=1)
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "b"


def test_a_conversation_stays_when_the_other_worker_is_only_slightly_less_busy() -> None:
    router, a, b = Router(), worker("a", inflight=3), worker("b", inflight=2)
    router.served(req(key=7), "a")
    assert first(router, req(key=7), [a, b]) == "a"


def test_an_overloaded_worker_keeps_its_conversation_when_everyone_is_as_busy() -> None:
    router, a, b = Router(), worker("a", inflight=3), worker("b", inflight=3)
    router.served(req(key=7), "b")
    assert first(router, req(key=7), [a, b]) == "b"


def test_work_the_gateway_did_not_send_counts_as_load() -> None:
    router = Router()
    slowed = worker("a", vllm_running=3)  # e.g. long requests from another replica
    idle = worker("b")
    assert [first(router, req(key=i), [slowed, idle]) for i in range(4)] == ["b"] * 4


def test_between_equally_busy_workers_the_one_busy_with_the_gateways_own_requests_wins() -> None:
    router = Router()
    strangers = worker("a", 2048, vllm_running=3)  # requests the gateway cannot size
    own = worker("b", 8192, inflight=3, vllm_running=3)  # smaller window loses this tie
    assert first(router, req(), [strangers, own]) == "b"


def test_vllm_waiting_queue_ranks_a_worker_after_one_without() -> None:
    router = Router()
    waiting, free = worker("a", vllm_waiting=1), worker("b", vllm_waiting=0)
    assert first(router, req(), [waiting, free]) == "b"


def test_short_requests_keep_the_long_window_free_while_long_ones_are_about() -> None:
    clock = Clock()
    router = Router(clock=clock)
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    assert first(router, req(3000), [long_w, short_w]) == "long"
    short_w.inflight = 1  # one band busier than the long worker: still the short one
    assert first(router, req(300), [long_w, short_w]) == "short"
    short_w.inflight = 2  # two bands busier: spill over
    assert first(router, req(300), [long_w, short_w]) == "long"


def test_on_an_idle_pool_a_short_request_takes_the_smallest_window() -> None:
    long_w, short_w = worker("long", 8192), worker("short", 2048)
    assert {first(Router(), req(300), [long_w, short_w]) for _ in range(4)} == {"short"}


def test_without_long_requests_the_long_window_takes_short_ones_at_once() -> None:
    clock = Clock()
    router = Router(reserve_s=60, clock=clock)
    long_w, short_w = worker("long", 8192), worker("short", 2048, inflight=1)
    router.decide(req(3000), [long_w, short_w])
    assert first(router, req(300), [long_w, short_w]) == "short"  # keeping `long` free
    clock.now += 61  # the long request is a minute old: nothing to keep free any more
    assert first(router, req(300), [long_w, short_w]) == "long"


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
