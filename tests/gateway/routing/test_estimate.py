"""The learned bytes-per-token figure routing estimates an uncounted prompt with; pure."""

from __future__ import annotations

from gpupool.gateway.routing.estimate import TokenEstimate


def test_an_unknown_model_is_estimated_at_three_bytes_a_token() -> None:
    assert TokenEstimate().tokens("m", 9000) == 3000


def test_a_denser_prompt_lowers_the_figure_for_its_model_only() -> None:
    est = TokenEstimate()
    est.learn("m", 4440, 2600)  # 1.7 bytes a token: the next 4,440 bytes are 2,600 tokens
    assert est.tokens("m", 4440) == 2600
    assert est.tokens("other", 4440) == 1480


def test_the_figure_only_goes_down_and_never_below_one_byte() -> None:
    est = TokenEstimate()
    est.learn("m", 8000, 2000)  # English-like, 4 bytes a token: the safer 3 stays
    assert est.bytes_per_token("m") == 3.0
    est.learn("m", 100, 400)  # a bogus count: a token is at least a byte
    assert est.bytes_per_token("m") == 1.0
    est.learn("m", 100, 0)
    assert est.bytes_per_token("m") == 1.0
