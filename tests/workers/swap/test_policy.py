"""Whose turn it is on a swap group's GPU (workers/swap/policy.py): pure decisions."""

from __future__ import annotations

import pytest

from gpupool.workers.swap.demand import Demand, ModelDemand
from gpupool.workers.swap.policy import Holder, Turns, next_model

TURNS = Turns(min_awake_s=10.0, priority_weight_s=10.0, policy="turns")
WEIGHED = Turns(min_awake_s=10.0, priority_weight_s=10.0, policy="weighed", max_wait_s=30.0,
                max_switch_share=0.1)  # fmt: skip


def d(count: int, oldest_s: float, priority: int = 0, total: float | None = None) -> ModelDemand:
    return ModelDemand(count, oldest_s, priority, oldest_s * count if total is None else total)


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


# -- weighed: the switch is weighed against what it costs the awake model -------------------


def test_weighed_an_idle_holder_or_a_free_gpu_gives_way() -> None:
    assert next_model(None, {"b": d(1, 0.0)}, WEIGHED, 1.2) == "b"
    assert next_model(Holder("a", 0.1, busy=False), {"b": d(1, 0.0)}, WEIGHED, 1.2) == "b"
    idle = Holder("a", 30.0, busy=False, idle_s=2.0)
    assert next_model(idle, {"b": d(1, 0.0)}, WEIGHED, 1.2) == "b"


def test_weighed_anticipates_an_agents_next_call_for_one_switch_time() -> None:
    """An agent's tool call ends sooner than a switch away and back: the holder waits one
    switch time after its last request, unless what waits elsewhere has waited that long."""
    just_idle = Holder("a", 30.0, busy=False, idle_s=0.4)
    assert next_model(just_idle, {"b": d(1, 0.3)}, WEIGHED, 1.2) is None
    assert next_model(just_idle, {"b": d(1, 1.3)}, WEIGHED, 1.2) == "b"
    assert next_model(Holder("a", 30.0, busy=False, idle_s=1.3), {"b": d(1, 0.3)},
                      WEIGHED, 1.2) == "b"  # fmt: skip
    # queued work for the holder counts as busy: it keeps the GPU
    assert next_model(Holder("a", 0.1, busy=False), {"a": d(1, 0.1), "b": d(1, 5.0)},
                      WEIGHED, 1.2) is None  # fmt: skip


def test_weighed_a_trickle_waits_for_its_batch_while_the_holder_is_busy() -> None:
    busy = Holder("a", 60.0, busy=True, running=8)  # 8 clients: a switch costs each 2.4 s
    # cost = 8 x 2 x 1.2 / 0.1 = 192 request-seconds of waiting to buy back
    assert next_model(busy, {"b": d(1, 9.0)}, WEIGHED, 1.2) is None  # one request, 9 s
    assert next_model(busy, {"b": d(6, 18.0, total=63.0)}, WEIGHED, 1.2) is None
    assert next_model(busy, {"b": d(12, 20.0, total=200.0)}, WEIGHED, 1.2) == "b"
    # a lightly used holder gives way sooner: one running request costs 24 request-seconds
    light = Holder("a", 60.0, busy=True, running=1)
    assert next_model(light, {"b": d(3, 9.0, total=25.0)}, WEIGHED, 1.2) == "b"


def test_weighed_no_request_waits_past_max_wait_however_busy_or_new_the_holder() -> None:
    busy = Holder("a", 2.0, busy=True, running=64)  # just woken, very busy
    assert next_model(busy, {"b": d(1, 27.0)}, WEIGHED, 1.2) is None
    assert next_model(busy, {"b": d(1, 27.6)}, WEIGHED, 1.2) == "b"  # 27.6 + 2 x 1.2 = 30
    assert next_model(busy, {"b": d(1, 10.0)}, WEIGHED, 10.0) == "b"  # a slow switch: sooner


def test_weighed_a_model_mid_job_keeps_the_gpu_for_min_awake() -> None:
    young = Holder("a", 5.0, busy=True, running=1)
    assert next_model(young, {"b": d(40, 25.0, total=900.0)}, WEIGHED, 1.2) is None
    older = Holder("a", 10.0, busy=True, running=1)
    assert next_model(older, {"b": d(40, 25.0, total=900.0)}, WEIGHED, 1.2) == "b"


def test_weighed_priority_counts_as_waiting() -> None:
    busy = Holder("a", 60.0, busy=True, running=1)  # cost 24 request-seconds
    assert next_model(busy, {"b": d(1, 5.0)}, WEIGHED, 1.2) is None
    assert next_model(busy, {"b": d(1, 5.0, priority=-2)}, WEIGHED, 1.2) == "b"  # 5 + 20


def test_an_unknown_policy_name_fails_at_config_load() -> None:
    from gpupool.config import ConfigError, parse_config

    base = {"models": [{"name": "m"}], "workers": [{"name": "w", "model": "m", "url": "http://x"}]}
    assert parse_config(base).swap.policy.value == "weighed"
    with pytest.raises(ConfigError) as e:
        parse_config({**base, "swap": {"policy": "lru"}})
    assert "swap.policy" in str(e.value)
