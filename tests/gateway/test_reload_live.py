"""What a reload applies and what needs a restart (``reload.build_live``), and how many
sequences a pooling, score or rerank body is (``parse.pooled_sequences``): no processes."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gpupool.config import parse_config
from gpupool.gateway.errors import InvalidBody
from gpupool.gateway.parse import ReadLimits, parse_model_body, pooled_sequences
from gpupool.gateway.reload import LIVE, build_live
from gpupool.gateway.security.middleware import AuthState

BASE: dict[str, Any] = {
    "models": [{"name": "m"}],
    "workers": [{"name": "w", "model": "m", "url": "http://127.0.0.1:9"}],
}


def _cfg(**sections: dict[str, Any]) -> Any:
    return parse_config({**BASE, **sections})


def test_live_fields_apply_and_the_rest_keep_their_running_values() -> None:
    old = _cfg(server={"port": 8000, "max_sequences": 256}, queue={"max_wait_s": 60})
    new = _cfg(server={"port": 9000, "max_sequences": 8}, queue={"max_wait_s": 5, "max_queued": 3,
               "lease_ttl_s": 4}, routing={"retries": 0, "window_reserve_s": 1,
               "health_interval_s": 9}, auth={"enabled": True, "metrics_open": False})  # fmt: skip
    live = build_live(old, new, AuthState.build(new.auth))
    assert live.applied == ["server.max_sequences", "queue.max_queued", "queue.max_wait_s",
                            "routing.retries", "routing.window_reserve_s", "auth.enabled",
                            "auth.metrics_open"]  # fmt: skip
    assert live.restart == ["server.port", "queue.lease_ttl_s", "routing.health_interval_s"]
    assert live.cfg.server.port == 8000 and live.cfg.server.max_sequences == 8
    assert live.cfg.queue.max_queued == 3 and live.cfg.queue.max_wait_s == 5
    assert live.cfg.queue.lease_ttl_s == 10 and live.cfg.routing.health_interval_s != 9
    assert live.cfg.routing.window_reserve_s == 1 and live.cfg.routing.retries == 0
    assert live.read_limits == ReadLimits(64, 16, 8, 200_000)
    # the running config then compares equal on those fields: reported again, never lost
    again = build_live(live.cfg, new, AuthState.build(new.auth))
    assert again.applied == [] and again.restart == live.restart


def test_every_live_field_exists() -> None:
    cfg = _cfg()
    for section, names in LIVE.items():
        fields = type(getattr(cfg, section)).model_fields
        assert names is None or names <= set(fields), section


@pytest.mark.parametrize(
    ("body", "n"),
    [
        ({"query": "q", "documents": ["d"] * 5000}, 5000),
        ({"query": "q", "documents": "one"}, 1),
        ({"text_1": "q", "text_2": ["a", "b", "c"]}, 3),
        ({"text_1": ["a", "b"], "text_2": ["c", "d"]}, 2),
        ({"queries": ["q"], "documents": ["a", "b"]}, 2),
        ({"queries": "q", "items": ["a", "b", "c", "d"]}, 4),
        ({"data_1": "q", "data_2": [{"content": []}] * 7}, 7),
        ({"input": "one"}, 1),
        ({"input": ["a", "b", "c"]}, 3),
        ({"input": [1, 2, 3]}, 1),  # one token list
        ({"input": [[1, 2], [3]]}, 2),
        ({"input": [{"role": "user", "content": "a"}]}, 1),  # one conversation
        ({"input": [[{"role": "user", "content": "a"}]] * 4}, 4),
        ({"messages": [[{"role": "user", "content": "a"}]] * 3}, 3),
        ({"messages": [{"role": "user", "content": "a"}]}, 1),
        ({"texts": ["a"] * 9}, 9),
        ({"images": ["data:,"] * 2}, 2),
    ],
)
def test_every_item_a_worker_runs_is_a_sequence(body: dict[str, Any], n: int) -> None:
    assert pooled_sequences(body) == n


def test_a_rerank_of_5000_documents_is_over_max_sequences() -> None:
    raw = orjson.dumps({"model": "m", "query": "q", "documents": ["d"] * 5000})
    with pytest.raises(InvalidBody, match="5000 sequences"):
        parse_model_body(raw, ReadLimits())
    assert parse_model_body(raw, ReadLimits(max_sequences=5000)).sequences == 5000
