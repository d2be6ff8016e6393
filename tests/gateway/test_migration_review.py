"""Adversarial checks of request migration (issue 36): paths a user takes through `gpupool
serve` that the main migration tests do not walk.

* A ``/v1/responses`` or ``/v1/messages`` stream whose model's reasoning the gateway splits
  (a worker without vLLM's parser) is never continued; when its worker dies mid-answer the
  client gets the error event, and the refusal is counted and logged as every other one is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running

pytestmark = [pytest.mark.timeout(60)]

DIE_AFTER = 7


def _worker(tmp: Path, die_after: int = DIE_AFTER) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.template_worker", "--port", str(port),
            "--model", MODEL, "--die-after", str(die_after)]  # fmt: skip
    return Proc(argv, f"http://127.0.0.1:{port}", tmp / f"template-{port}.log")


def _metric(gw: Proc, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


SPLIT_ROUTES = [
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 40}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}),
]


@pytest.mark.parametrize(("path", "extra"), SPLIT_ROUTES, ids=["responses", "messages"])
def test_split_reasoning_stream_whose_worker_dies_is_counted_refused(
    tmp_path: Path, path: str, extra: dict[str, Any]
) -> None:
    a, b = _worker(tmp_path), _worker(tmp_path)
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    cfg["models"] = [{"name": MODEL, "reasoning": "qwen3"}]  # the gateway splits <think>
    gw = gateway(cfg, tmp_path)
    body = {"model": MODEL, "stream": True, **extra}
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = _metric(gw, "gpupool_migrations_total", outcome="refused")
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    assert events and events[-1]["type"] == "error"  # the client's stream ends as before
    assert refused == 1  # counted, as a chat stream's refusal is
    assert "not continued: reasoning" in log
