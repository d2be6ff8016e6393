"""The shared queue arithmetic: order keys, fair tags, drain rate, Retry-After."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpupool.gateway.admission.fairness import (
    PRIORITY_LIMIT,
    DrainRate,
    FairClock,
    Presence,
    clamp_priority,
    encode_key,
    retry_after,
    tenant_limit,
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


def test_a_tenant_may_fill_all_but_the_reserved_slots_and_always_one() -> None:
    assert [tenant_limit(4, r) for r in (0, 1, 3, 9)] == [4, 3, 1, 1]
    assert tenant_limit(1, 1) == 1


def test_presence_sees_other_tenants_within_the_window_only() -> None:
    now = [0.0]
    seen = Presence(window_s=30.0, clock=lambda: now[0])
    seen.saw("batch")
    assert not seen.others("batch")  # alone
    seen.saw("chat")
    assert seen.others("batch") and seen.others("chat") and seen.others("third")
    now[0] = 20.0
    seen.saw("batch")
    now[0] = 31.0  # chat's last request is now 31 s old
    assert not seen.others("batch") and seen.others("chat")


def test_others_waiting_ignores_the_tenant_itself() -> None:
    clock = FairClock()
    assert not clock.others_waiting("A")
    clock.arrive(0, "A")
    assert not clock.others_waiting("A") and clock.others_waiting("B")
