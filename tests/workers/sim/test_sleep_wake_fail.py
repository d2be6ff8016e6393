"""The simulator's ``wake_fail: "kv_cache"`` knob: a level-2 wake that fails half-way, as vLLM's
can. ``tags=weights`` takes the GPU share, the ``kv_cache`` wake answers 500, and
``/is_sleeping`` still says true (vLLM's says true while any tag sleeps) though the weights
hold the GPU; a plain /wake_up once the knob is cleared wakes the rest, and /sleep frees it."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from gpupool.workers.sim.app import create_sim_app
from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.sleep import SleepSettings


def _holds(tmp: Path) -> bool:
    ledger = json.loads((tmp / "ledger.json").read_text())
    return bool(ledger["members"]["sim"]["awake"])


async def test_a_failed_kv_cache_wake_leaves_the_weights_on_the_gpu(tmp_path: Path) -> None:
    settings = SleepSettings(sleep_s=0, wake_s=0, reload_s=0, ledger=str(tmp_path / "ledger.json"))
    app = create_sim_app(SimConfig(model="m", mode="lorem"), settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        assert (await client.post("/sleep?level=2")).status_code == 200
        knob = await client.post("/sim/sleep", json={"wake_fail": "kv_cache"})
        assert knob.status_code == 200
        assert (await client.post("/wake_up?tags=weights")).status_code == 200
        rpc = await client.post("/collective_rpc", json={"method": "reload_weights"})
        assert rpc.status_code == 200
        failed = await client.post("/wake_up?tags=kv_cache")
        assert failed.status_code == 500 and "KV cache" in failed.json()["error"]["message"]
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert _holds(tmp_path)  # the weights hold the GPU
        assert (await client.post("/wake_up")).status_code == 500  # the knob stays until changed
        await client.post("/sim/sleep", json={"wake_fail": None})
        assert (await client.post("/wake_up")).status_code == 200
        assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
        assert (await client.post("/sleep?level=2")).status_code == 200
        assert not _holds(tmp_path)
        bad = await client.post("/sim/sleep", json={"wake_fail": "weights"})
        assert bad.status_code == 400 and "kv_cache" in bad.json()["detail"]
