"""JSON logs carry the request ids: the gateway's own (the one its worker sees) and the client's
x-request-id beside it (echoed to the client, never sent to a worker)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.support.procs import gateway, running, sim


def test_json_logs_with_request_id(tmp_path: Path) -> None:
    w = sim(model="m", tmp=tmp_path)
    cfg = {
        "server": {"log_format": "json", "log_prompts": True},
        "models": [{"name": "m"}],
        "workers": [{"name": "w", "model": "m", "url": w.url}],
    }
    gw = gateway(cfg, tmp_path)
    with running(w), running(gw, ready_path="/ready"):
        r = httpx.post(gw.url + "/v1/completions", headers={"x-request-id": "req-42"},
                       json={"model": "m", "prompt": "hello", "max_tokens": 2})  # fmt: skip
        assert r.headers["x-request-id"] == "req-42"
        seen = httpx.get(w.url + "/sim/stats").json()["request_ids"]
        assert "req-42" not in seen  # the worker sees the gateway's own id, unique
        assert any(len(x) == 32 for x in seen)
        generated = httpx.get(gw.url + "/health").headers["x-request-id"]
        assert len(generated) == 32
        time.sleep(0.2)
        lines = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    mine = [x for x in lines if x.get("client_request_id") == "req-42"]
    assert mine and "hello" in mine[0]["msg"]
    assert mine[0]["request_id"] in seen  # the gateway's id beside the client's
