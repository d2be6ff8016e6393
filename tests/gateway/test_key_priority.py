"""A key's priority range, end to end (`gpupool serve`, one simulated worker of one slot, the
openai SDK): lower is sooner, as vLLM's; a key without a configured range may not ask for
anything sooner than the default priority (0), so its `priority: -1000` is clamped to 0 and
does not pass another tenant's queued request; a key given `priority_min: -10` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.procs import gateway, running, sim

MODEL = "m"
ADMIN = "sk-admin-prio"
KEYS = {"chat": "sk-chat-prio", "batch": "sk-batch-prio", "ops": "sk-ops-prio"}


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def test_an_ordinary_keys_urgent_priority_does_not_pass_other_tenants(tmp_path: Path) -> None:
    w = sim(model=MODEL, tmp=tmp_path, max_num_seqs=8, mode="echo")
    keys: list[dict[str, Any]] = [
        {"name": n, "sha256": _sha(s), "tenant": n} for n, s in KEYS.items()
    ]
    keys[2]["priority_min"] = -10  # ops may go first
    cfg = {
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": w.url, "max_inflight": 1}],
        "routing": {"metrics_interval_s": 3600, "prefix_affinity": False},
        "queue": {"reserved_slots": 0},
        "auth": {"enabled": True, "admin_key_sha256": _sha(ADMIN), "keys": keys},
    }
    gw = gateway(cfg, tmp_path)
    admin = {"authorization": f"Bearer {ADMIN}"}

    def held() -> dict[str, Any]:
        r = httpx.get(gw.url + "/admin/held", headers=admin, timeout=10)
        return dict(r.json())

    async def until(count: str, n: int) -> None:
        deadline = time.monotonic() + 20
        while sum((await asyncio.to_thread(held))[count].values()) != n:
            assert time.monotonic() < deadline, f"{count} never reached {n}"
            await asyncio.sleep(0.02)

    async def scenario() -> list[str]:
        done: list[str] = []
        clients = {n: openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=s, max_retries=0)
                   for n, s in KEYS.items()}  # fmt: skip

        async def send(key: str, name: str, **kw: Any) -> None:
            await clients[key].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": name}], max_tokens=1, **kw
            )
            done.append(name)

        tasks = [asyncio.create_task(send("chat", "holder",
                                          extra_headers={"x-sim-hold-ms": "3000"}))]  # fmt: skip
        await until("inflight", 1)
        tasks.append(asyncio.create_task(send("chat", "chat-next")))
        await until("queued", 1)
        tasks.append(asyncio.create_task(send("batch", "batch-urgent",
                                              extra_body={"priority": -1000})))  # fmt: skip
        await until("queued", 2)
        tasks.append(asyncio.create_task(send("ops", "ops-urgent",
                                              extra_body={"priority": -5})))  # fmt: skip
        await until("queued", 3)
        await asyncio.gather(*tasks)
        for c in clients.values():
            await c.close()
        return done

    with running(w), running(gw, ready_path="/health"):
        deadline = time.monotonic() + 20
        while httpx.get(gw.url + "/ready", headers=admin).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        done = asyncio.run(scenario())
        # the order they started on the worker (its own record), not the order the replies
        # came back in: with one slot, a reply can reach its client before the one before it
        prompts = httpx.get(w.url + "/sim/stats", timeout=10).json()["prompts"]
        order = [n for p in prompts for n in done if n in p]
        assert order == ["holder", "ops-urgent", "chat-next", "batch-urgent"], (prompts, done)
        assert not any(held()["slots"].values())
