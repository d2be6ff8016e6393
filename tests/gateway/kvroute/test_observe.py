"""What vLLM's answer says of a prediction: the outcome per worker, and the error histogram only
where the prompt sent was the one predicted (a migrated request's continuation is another)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from gpupool.gateway.kvroute.predict import KvRouting, observe
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.routing.cached import KvPrediction
from gpupool.gateway.routing.policy import RouteRequest


def _seen(m: Metrics, name: str, labels: dict[str, str]) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def _observe(m: Metrics, prompt: int, reported: int, moved: bool = False) -> None:
    kv = cast(KvRouting, SimpleNamespace(metrics=m))
    pred = KvPrediction(tokens=300, cached={"a": 256, "b": 0})
    observe(kv, RouteRequest("tiny", 300, True, kv=pred), "a", prompt, reported, moved)


def test_outcomes_and_the_error_histogram() -> None:
    m = Metrics()
    outcome: Any = {"model": "tiny", "worker": "a"}
    _observe(m, 300, 256)  # exact
    _observe(m, 300, 128)  # over by 128
    _observe(m, 420, 0)  # a continuation: another prompt
    # a continuation from token ids: its usage counts the client's prompt (300), but the
    # worker read that and what was generated before the move (seen on the H100: 48 such
    # continuations counted "under" before)
    _observe(m, 300, 288, moved=True)
    for name, want in (("exact", 1), ("over", 1), ("under", 0), ("tokens_differ", 2)):
        got = _seen(m, "gpupool_kv_predictions_total", {**outcome, "outcome": name})
        assert got == want, name
    count = _seen(m, "gpupool_kv_prediction_error_tokens_count", {"model": "tiny"})
    total = _seen(m, "gpupool_kv_prediction_error_tokens_sum", {"model": "tiny"})
    assert (count, total) == (2, 128)  # the continuation's 256 is not a prediction's error


def test_a_miss_is_logged_with_what_was_only_placed(caplog: pytest.LogCaptureFixture) -> None:
    """An ``over`` whose predicted blocks were partly placed by the request just before (not
    stored yet: vLLM may not have computed them) says so, to tell it from an eviction."""
    kv = cast(KvRouting, SimpleNamespace(metrics=Metrics()))
    pred = KvPrediction(tokens=300, cached={"a": 256}, placed={"a": 128})
    with caplog.at_level(logging.INFO, logger="gpupool.kvroute"):
        observe(kv, RouteRequest("tiny", 300, True, kv=pred), "a", 300, 128)
        observe(kv, RouteRequest("tiny", 300, True, kv=pred), "a", 300, 256)  # exact: quiet
    assert [r.getMessage() for r in caplog.records] == [
        "kv prediction for tiny on a missed: 256 cached tokens predicted (128 of them placed by "
        "a request just before, not stored yet), 128 reported, of 300"
    ]
