"""The shared queue arithmetic: order keys, fair tags, drain rate, Retry-After."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupool.gateway.admission.fairness import (
    PRIORITY_LIMIT,
    DrainRate,
    FairClock,
    clamp_priority,
    encode_key,
    retry_after,
)

_keys = st.tuples(
    st.integers(-PRIORITY_LIMIT, PRIORITY_LIMIT),
    st.integers(0, 10**15),
    st.integers(0, 10**15),
)


@given(_keys, _keys)
def test_encoded_keys_sort_like_the_tuples(
    a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    # Redis orders equal-score members by bytes; the encoding must agree with the tuple order
    assert (encode_key(a, "x|1") < encode_key(b, "y|2")) == (a < b) or a == b


def test_priorities_are_clamped_to_the_encodable_range() -> None:
    assert clamp_priority(10**12) == PRIORITY_LIMIT
    assert clamp_priority(-(10**12)) == -PRIORITY_LIMIT


def test_a_backlog_does_not_push_a_new_tenant_back() -> None:
    clock = FairClock()
    backlog = [clock.arrive(0, "A") for _ in range(500)]
    newcomer = clock.arrive(0, "B")
    assert sorted([*backlog, newcomer]).index(newcomer) == 1  # right after A's first


def test_priority_beats_fairness() -> None:
    clock = FairClock()
    low = clock.arrive(5, "B")
    for _ in range(10):
        clock.arrive(0, "A")
    assert clock.arrive(0, "A") < low  # A's 11th request at priority 0 still goes first


def test_cancelled_requests_leave_no_debt() -> None:
    clock = FairClock()
    keys = [clock.arrive(0, "A") for _ in range(5)]
    for key in keys:
        clock.leave(key, "A", granted=False)
    assert clock.arrive(0, "A")[1] == 0  # starts at the clock again, not after 5 phantom units
    assert clock.tenants() == {"A": 1}


def test_drain_rate_converges_to_the_grant_rate() -> None:
    now = [0.0]
    rate = DrainRate(tau_s=10.0, clock=lambda: now[0])
    for _ in range(600):  # 10 grants per second for a minute
        now[0] += 0.1
        rate.tick()
    assert 9.0 < rate.per_second() < 11.0
    now[0] += 30.0  # then nothing for 30 s: the estimate fades
    assert rate.per_second() < 0.6


def test_retry_after_is_position_over_rate_clamped() -> None:
    assert retry_after(10, 5.0, 60.0) == 2.0
    assert retry_after(1, 100.0, 60.0) == 1.0
    assert retry_after(10_000, 1.0, 60.0) == 60.0
    assert retry_after(3, 0.0, 60.0) == 60.0
