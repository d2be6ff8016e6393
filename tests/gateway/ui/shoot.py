"""Make docs/pool-page.png: the pool page of a small busy pool, in Debian's headless Chromium.

    .venv/bin/python -m tests.gateway.ui.shoot docs/pool-page.png

Three simulated workers behind `gpupool serve`, requests for ~30 s so the tokens/s charts
have points, one worker drained (a state change); then the page at 1280 px.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tests.gateway.ui.browser import chromium, screenshot, wait
from tests.gateway.ui.pool import ADMIN, ADMIN_H, CLIENT, MODEL, OTHER, _h
from tests.support.procs import gateway, running, sim


def _traffic(url: str, model: str, stop: threading.Event) -> None:
    body = {"model": model, "max_tokens": 48, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.Client(headers={"authorization": f"Bearer {CLIENT}"}, timeout=30) as c:
        while not stop.is_set():
            c.post(url + "/v1/chat/completions", json=body)


def main(out: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    workers = [sim(model=MODEL, tmp=tmp, itl_ms=15, output_tokens=48) for _ in range(2)]
    workers.append(sim(model=OTHER, tmp=tmp, max_model_len="32k", itl_ms=25, output_tokens=48))
    cfg = {
        "models": [{"name": MODEL}, {"name": OTHER}],
        "workers": [{"name": "gen-a", "model": MODEL, "url": workers[0].url, "max_inflight": 4},
                    {"name": "gen-b", "model": MODEL, "url": workers[1].url, "max_inflight": 4},
                    {"name": "long-ctx", "model": OTHER, "url": workers[2].url,
                     "max_inflight": 2}],
        "auth": {"enabled": True, "admin_key_sha256": _h(ADMIN),
                 "keys": [{"name": "client", "sha256": _h(CLIENT)}]},
    }  # fmt: skip
    gw = gateway(cfg, tmp)
    stop = threading.Event()
    with running(*workers), running(gw), chromium(tmp / "profile") as driver:
        threads = [threading.Thread(target=_traffic, args=(gw.url, m, stop))
                   for m in (MODEL, MODEL, MODEL, OTHER, OTHER, OTHER)]  # fmt: skip
        for t in threads:
            t.start()
        driver.get(gw.url + "/ui")
        wait(driver, lambda d: d.find_element("id", "key").is_displayed())
        driver.find_element("id", "key").send_keys(ADMIN + "\n")
        time.sleep(20)
        httpx.post(gw.url + "/admin/workers/gen-b/drain", headers=ADMIN_H, timeout=60)
        time.sleep(12)
        screenshot(driver, out, 1280)
        stop.set()
        for t in threads:
            t.join()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
