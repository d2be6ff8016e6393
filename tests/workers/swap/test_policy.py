"""Whose turn it is on a swap group's GPU (workers/swap/policy.py): pure decisions."""

from __future__ import annotations

from gpupool.workers.swap.demand import Demand, ModelDemand
from gpupool.workers.swap.policy import Holder, Turns, next_model

TURNS = Turns(min_awake_s=10.0, priority_weight_s=10.0)


def d(count: int, oldest_s: float, priority: int = 0) -> ModelDemand:
    return ModelDemand(count, oldest_s, priority)


def test_a_free_gpu_goes_to_the_longest_waiting_model() -> None:
    assert next_model(None, {}, TURNS) is None
    assert next_model(None, {"a": d(1, 2.0), "b": d(5, 3.0)}, TURNS) == "b"


def test_an_idle_holder_gives_way_at_once_even_just_woken() -> None:
    holder = Holder("a", awake_s=0.1, busy=False)
    assert next_model(holder, {"b": d(1, 0.01)}, TURNS) == "b"


def test_a_busy_holder_keeps_the_gpu_for_min_awake_s() -> None:
    assert next_model(Holder("a", 5.0, busy=True), {"b": d(3, 60.0)}, TURNS) is None
    assert next_model(Holder("a", 10.0, busy=True), {"b": d(3, 60.0)}, TURNS) == "b"


def test_after_min_awake_the_model_waiting_longest_gets_its_turn() -> None:
    holder = Holder("a", 30.0, busy=True)
    # a's own queue is older: it keeps the GPU (its batch is not starved)
    assert next_model(holder, {"a": d(4, 8.0), "b": d(1, 5.0)}, TURNS) is None
    # b has waited longer: b's turn, however many a has waiting
    assert next_model(holder, {"a": d(40, 5.0), "b": d(1, 8.0)}, TURNS) == "b"


def test_priority_counts_as_waiting_time() -> None:
    holder = Holder("a", 30.0, busy=True)
    demand = {"a": d(1, 8.0, priority=0), "b": d(1, 1.0, priority=-1)}  # -1: 10 s sooner
    assert next_model(holder, demand, TURNS) == "b"


def test_nothing_waiting_elsewhere_keeps_the_holder() -> None:
    assert next_model(Holder("a", 99.0, busy=True), {"a": d(2, 9.0)}, TURNS) is None


def test_demand_counts_waiting_requests_until_they_leave() -> None:
    demand = Demand()
    assert demand.of("a") is None
    with demand.waiting("a", 3), demand.waiting("a", -2):
        seen = demand.of("a")
        assert seen is not None and seen.count == 2 and seen.best_priority == -2
        assert demand.count("a") == 2
    assert demand.of("a") is None and demand.count("a") == 0
