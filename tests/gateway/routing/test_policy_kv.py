"""Precise prefix routing in the pure policy: the worker holding most of the prompt leads while
the throughput guard's rules allow (a free slot, among the least busy or, holding most of the
prompt, one request past them; no deeper engine queue);
when every worker is full it is first in line; a holder never takes a request from an idler
neighbour beyond ``kv_events.max_lead``."""

from __future__ import annotations

from gpupool.gateway.routing.cached import KvPrediction
from gpupool.gateway.routing.policy import Router, RouteRequest
from tests.gateway.routing.test_policy import first, worker


def req(cached: dict[str, int], key: int | None = None) -> RouteRequest:
    return RouteRequest("m", 1000, True, prefix_key=key, kv=KvPrediction(1000, cached))


def test_the_worker_holding_most_of_the_prompt_leads_on_equal_load() -> None:
    a, b, c = worker("a", inflight=1), worker("b", inflight=1), worker("c", inflight=1)
    assert first(Router(), req({"a": 128, "b": 512, "c": 0}), [a, b, c]) == "b"


def test_a_cached_prefix_never_fills_a_worker_past_an_idler_neighbour() -> None:
    """A holder of a small part of the prompt leads only among the least busy; one of most of
    it by one request at most (a slot of its capacity), more only within ``max_lead``."""
    a, b = worker("a", inflight=2), worker("b", inflight=1)
    assert first(Router(), req({"a": 384, "b": 0}), [a, b]) == "b"
    assert first(Router(kv_max_lead=0.25), req({"a": 384, "b": 0}), [a, b]) == "a"
    assert first(Router(), req({"a": 896, "b": 0}), [a, b]) == "a"  # one request ahead
    a.inflight = 3  # two ahead: load decides, unless max_lead allows it
    assert first(Router(), req({"a": 896, "b": 0}), [a, b]) == "b"
    assert first(Router(kv_max_lead=0.5), req({"a": 896, "b": 0}), [a, b]) == "a"


def test_the_one_request_lead_is_a_slot_of_the_holders_capacity() -> None:
    """On a worker of 16 slots one request is 1/16 of it: two ahead is past it."""
    a, b = worker("a", capacity=16, inflight=9), worker("b", capacity=16, inflight=8)
    assert first(Router(), req({"a": 896}), [a, b]) == "a"
    a.inflight = 10
    assert first(Router(), req({"a": 896}), [a, b]) == "b"


def test_a_holder_whose_engine_queues_more_does_not_lead() -> None:
    a, b = worker("a", vllm_waiting=2), worker("b")
    assert first(Router(), req({"a": 896}), [a, b]) == "b"


def test_all_full_the_holder_is_first_in_line_for_a_while() -> None:
    a, b = worker("a", inflight=4), worker("b", inflight=4)
    d = Router().decide(req({"b": 256}), [a, b])
    assert [w.name for w in d.candidates] == ["b", "a"]  # queued on both: work-conserving
    assert d.prefer_s > 0


def test_nothing_cached_anywhere_leaves_it_to_load_and_affinity() -> None:
    router, a, b = Router(), worker("a", inflight=1), worker("b", inflight=1)
    router.served(RouteRequest("m", 1000, True, prefix_key=7), "b")
    assert first(router, req({"a": 0, "b": 0}, key=7), [a, b]) == "b"  # affinity decides
    assert first(router, req({}), [a, b]) == "a"  # load, then name


def test_decisions_in_one_instant_see_each_other() -> None:
    """The first request's placement counts as load: the next ones, same prefix, go to the
    holder only while it is at most one request ahead."""
    a, b = worker("a"), worker("b")
    router = Router()
    assert first(router, req({"a": 512}), [a, b]) == "a"
    a.inflight += 1  # admission counts it the moment it is placed
    assert first(router, req({"a": 512}), [a, b]) == "a"
    a.inflight += 1
    assert first(router, req({"a": 512}), [a, b]) == "b"
