"""What is not continued when a worker dies mid-answer (issue 36, docs/migration.md).

A raw-socket fake vLLM (``support/hostile_worker.py``) streams a chat answer's first deltas and
then closes the connection mid-body, as a worker killed mid-answer: half a tool call (vLLM's
tool parser state cannot be rebuilt from text), or reasoning deltas (a worker-side reasoning
parser: the partial reasoning cannot be handed back as the assistant message). Neither moves:
the client keeps what it read, then gets the stream's error event and one ``[DONE]``; the
migration is counted ``refused`` and logged with the reason. Nothing is held afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.test_hostile_worker import hostile_worker
from tests.support.fault_tools import MODEL
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running

pytestmark = pytest.mark.timeout(120)


def _events(url: str, mode: str) -> list[dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": mode}], "stream": True,
            "max_tokens": 50}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1, lines
    return [json.loads(ln) for ln in lines[:-1]]


def _deltas(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["delta"] for e in events for c in e.get("choices", []) if c.get("delta")]


@pytest.mark.parametrize(
    ("mode", "why", "kept"),
    [
        ("tool_call_dies", "tool_call", "tool_calls"),
        ("reasoning_dies", "reasoning", "reasoning"),
    ],
)
def test_a_stream_that_cannot_be_continued_ends_with_its_error(
    tmp_path: Path, mode: str, why: str, kept: str
) -> None:
    w = hostile_worker(tmp_path)
    cfg = {
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": w.url, "max_inflight": 4}],
        "routing": {"health_interval_s": 0.5, "fail_threshold": 1_000_000},
    }
    gw = gateway(cfg, tmp_path)
    with running(w), running(gw, ready_path="/ready"):
        events = _events(gw.url, mode)
        assert_nothing_held(gw.url)
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        log = Path(gw.log_path).read_text()
    assert any(kept in d for d in _deltas(events)), events  # what it read stays read
    assert "error" in events[-1], events[-1]
    assert 'cause="worker_died",model="m",outcome="refused"} 1.0' in metrics
    assert f"worker w failed mid-answer (worker_died); not continued: {why}" in log
