"""JSON logs carry the request id; the id is forwarded to workers and echoed to clients."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.procs import gateway, running, sim


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
        assert "req-42" in httpx.get(w.url + "/sim/stats").json()["request_ids"]
        generated = httpx.get(gw.url + "/health").headers["x-request-id"]
        assert len(generated) == 32
        time.sleep(0.2)
        lines = [json.loads(x) for x in gw.log_path.read_text().splitlines() if x.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(x) for x in lines)
    mine = [x for x in lines if x.get("request_id") == "req-42"]
    assert mine and "hello" in mine[0]["msg"]
