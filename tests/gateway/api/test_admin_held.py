"""``GET /admin/held`` counts every key's slots: those in ``auth.keys`` and ``auth.keys_file``."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from pathlib import Path

import httpx
import yaml

from tests.support.hostile_tools import assert_nothing_held, held
from tests.support.procs import gateway, running, sim

ADMIN, INLINE, FILED = "sk-admin-held", "sk-inline-1", "sk-filed-1"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN}"}


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_held_shows_the_keys_file_keys_too(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(
        {"keys": [{"name": "filed", "sha256": _h(FILED), "max_concurrent": 2}]}
    ))  # fmt: skip
    w = sim(model="m", tmp=tmp_path, ttft_ms=2000)  # the request stays held 2 s
    cfg = {
        "models": [{"name": "m"}],
        "workers": [{"name": "w", "model": "m", "url": w.url, "max_inflight": 4}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN), "keys_file": str(keys_file),
                 "keys": [{"name": "inline", "sha256": _h(INLINE), "max_concurrent": 2}]},
    }  # fmt: skip
    g = gateway(cfg, tmp_path)
    with running(w), running(g):
        body = {"model": "m", "prompt": "x", "max_tokens": 5}
        headers = {"authorization": f"Bearer {FILED}"}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, g.url + "/v1/completions", json=body,
                               headers=headers, timeout=10)  # fmt: skip
            seen = []
            deadline = time.monotonic() + 30  # not 40 polls: the request may arrive late
            while time.monotonic() < deadline and not call.done():
                seen.append(held(g.url, ADMIN_HEADERS)["key_slots"])
                if seen[-1] == {"inline": 0, "filed": 1}:
                    break
                time.sleep(0.05)
            assert seen[-1] == {"inline": 0, "filed": 1}, seen
            assert call.result().status_code == 200
        assert_nothing_held(g.url, ADMIN_HEADERS)
