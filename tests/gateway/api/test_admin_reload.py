"""Admin control of `url:` workers through a real gateway: drain, undrain, and config reload
that adds, removes and replaces workers while an unchanged worker keeps serving its stream."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.procs import gateway, running, sim

MODEL = "m"


def _cfg(workers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": workers,
        "routing": {"health_interval_s": 0.3, "prefix_affinity": False},
    }


def _names(url: str) -> dict[str, str]:
    data = httpx.get(url + "/admin/workers").json()["data"]
    return {w["name"]: w["state"] for w in data}


def test_drain_undrain_and_reload(tmp_path: Path) -> None:
    a, b, c = (sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, itl_ms=30) for _ in range(3))
    first = _cfg([{"name": "a", "model": MODEL, "url": a.url},
                  {"name": "b", "model": MODEL, "url": b.url}])  # fmt: skip
    gw = gateway(first, tmp_path)
    with running(a, b, c), running(gw, ready_path="/ready"):
        # drain b: traffic goes to a only; undrain: b is back
        assert httpx.post(gw.url + "/admin/workers/b/drain").json()["state"] == "stopped"
        for _ in range(4):
            r = httpx.post(gw.url + "/v1/completions",
                           json={"model": MODEL, "prompt": "x", "max_tokens": 1})  # fmt: skip
            assert r.headers["x-gpupool-worker"] == "a"
        assert httpx.post(gw.url + "/admin/workers/b/undrain").json()["state"] == "ready"

        # a long stream on `a` must survive a reload that leaves `a` unchanged
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "stream": True}
        events: list[bytes] = []
        served_by: list[str] = []

        def stream_on_a() -> None:
            with httpx.stream("POST", gw.url + "/v1/completions", json=body,
                              headers={"x-request-id": "long"}, timeout=30) as r:  # fmt: skip
                served_by.append(r.headers["x-gpupool-worker"])
                events.extend(e for e in b"".join(r.iter_raw()).split(b"\n\n") if e)

        httpx.post(b.url + "/sim/control", json={"itl_ms": 30})
        t = threading.Thread(target=stream_on_a)
        t.start()
        deadline = time.monotonic() + 30  # routed (its head is back), not a 0.3-s head start
        while not served_by:
            assert t.is_alive() and time.monotonic() < deadline, "the stream never started"
            time.sleep(0.01)
        # new config: a unchanged, b removed, c added, and a's capacity is NOT changed
        path = next(tmp_path.glob("gpupool-*.yaml"))
        second = yaml.safe_load(path.read_text())
        second["workers"] = [second["workers"][0], {"name": "c", "model": MODEL, "url": c.url}]
        path.write_text(yaml.safe_dump(second))
        summary = httpx.post(gw.url + "/admin/reload", timeout=60).json()
        assert summary["workers"] == {"added": ["c"], "removed": ["b"], "changed": [],
                                      "unchanged": ["a"]}  # fmt: skip
        assert _names(gw.url) == {"a": "ready", "c": "ready"}
        t.join(timeout=30)
        assert served_by == ["a"]
        assert events[-1] == b"data: [DONE]" and not any(b'"error"' in e for e in events)

        # change c (a new max_inflight): it is replaced; an invalid file is refused with 400
        second["workers"][1]["max_inflight"] = 3
        path.write_text(yaml.safe_dump(second))
        summary = httpx.post(gw.url + "/admin/reload", timeout=60).json()
        assert summary["workers"]["changed"] == ["c"]
        assert httpx.get(gw.url + "/admin/workers/c").json()["capacity"] == 3
        path.write_text(json.dumps({"models": [], "workers": []}))
        bad = httpx.post(gw.url + "/admin/reload", timeout=60)
        assert bad.status_code == 400 and "invalid" in bad.json()["error"]["message"]
        assert set(_names(gw.url)) == {"a", "c"}
