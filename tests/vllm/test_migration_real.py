"""Request migration on real vLLM (issue 36): two CPU workers of the same tiny model, greedy.

The same 24 streamed and 8 whole-answer requests (chat and completions, 320 tokens each) are
answered twice: once undisturbed, once while one worker's vLLM API server is killed
(``kill -9``) as soon as every stream has begun. No client may see an error; at least 90 % of
the answers must be the undisturbed text (greedy on identical weights; a token boundary at the
cut, or a batch of other sizes, may change the rest), and every difference is reported with the
text around it. One FAULT-RESULT line gives the numbers.

One stack of its own (two workers, about 3 GB each): run it under the machine's heavy-test lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import report
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, running
from tests.vllm.conftest import MODEL, _paths, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

WINDOW = 1024
STREAMS, WHOLE = 24, 8
TOKENS = 320  # long enough that the kill lands mid-answer however fast the machine (48 did not)
SLOTS = 16  # a worker's: the 32 requests spread over both


def _worker(name: str, model_dir: Path, py: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "max_inflight": SLOTS,
        "launch": {
            "model_path": str(model_dir),
            "command": [
                str(py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "{model_path}",
            ],
            "args": {
                "dtype": "bfloat16",
                "max-model-len": WINDOW,
                "max-num-seqs": SLOTS,
                "max-num-batched-tokens": 2048,
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 400,
            "max_restarts": 0,  # the killed one stays down: the machine is small
        },
        "warmup": [{"prompt": "warm up", "max_tokens": 2}],
    }


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("migration")
    dense = models / "qwen3-dense"
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": [_worker("a", dense, py), _worker("b", dense, py)],
        "routing": {
            "prefix_affinity": False,
            "health_interval_s": 1.0,
            "fail_threshold": 2,
            "health_timeout_s": 30,
        },
        "queue": {"max_wait_s": 300},
    }
    gw = gateway(cfg, tmp)
    with running(gw):
        wait_ready(gw, timeout=600, names=("a", "b"))
        yield gw


def _requests() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(STREAMS + WHOLE):
        stream = i < STREAMS
        common = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "stream": stream,
                  "ignore_eos": True}  # fmt: skip
        if stream and i % 3 == 0:
            common["stream_options"] = {"include_usage": True}
        if i % 2:
            chat = [{"role": "user", "content": f"Tell me about the number {i}."}]
            out.append(("/v1/chat/completions", {**common, "messages": chat}))
        else:
            out.append(("/v1/completions", {**common, "prompt": f"The number {i} is"}))
    return out


class Read:
    def __init__(self) -> None:
        self.text = ""
        self.errors: list[str] = []
        self.done = 0
        self.status = 0
        self.began = asyncio.Event()
        self.ids: set[str] = set()
        self.usage: dict[str, Any] | None = None

    def event(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done += 1
            return
        obj = json.loads(line[6:])
        if "error" in obj:
            self.errors.append(str(obj["error"]))
        self.ids.add(str(obj.get("id")))
        self.usage = obj.get("usage") or self.usage
        for c in obj.get("choices", []):
            self.text += c.get("text") or (c.get("delta") or {}).get("content") or ""
        if self.text:
            self.began.set()


async def _one(c: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], i: int,
               read: Read) -> None:  # fmt: skip
    try:
        headers = {"x-request-id": f"req-{i}"}
        async with c.stream("POST", url + path, json=body, headers=headers) as r:
            read.status = r.status_code
            if r.status_code != 200 or not body["stream"]:
                raw = await r.aread()
                if r.status_code != 200:
                    read.errors.append(raw[:300].decode(errors="replace"))
                else:
                    choice = json.loads(raw)["choices"][0]
                    read.text = choice.get("text") or choice["message"]["content"] or ""
                    read.done = 1
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        read.event(line)
    except httpx.HTTPError as e:
        read.errors.append(f"{type(e).__name__}: {e}")
    finally:
        read.began.set()


async def _run(url: str, kill: Any = None) -> list[Read]:
    reqs = _requests()
    reads = [Read() for _ in reqs]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        tasks = [asyncio.create_task(_one(c, url, p, b, i, reads[i]))
                 for i, (p, b) in enumerate(reqs)]  # fmt: skip
        if kill is not None:  # once half the streams have text: most are mid-answer then
            # (waiting for all 24 let a fast round finish the first ones, and on an idle machine
            # every stream was over before the kill landed: nothing to migrate)
            began = [asyncio.ensure_future(r.began.wait()) for r in reads[:STREAMS]]
            for done, _ in enumerate(asyncio.as_completed(began), 1):
                await _
                if done >= STREAMS // 2:
                    break
            await asyncio.to_thread(kill)
            await asyncio.gather(*began)
        await asyncio.gather(*tasks)
    return reads


def _child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _workers(url: str) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in httpx.get(url + "/admin/workers", timeout=30).json()["data"]}


def _difference(i: int, got: str, want: str, cut: int | None) -> dict[str, Any]:
    """Where an answer first differs from the undisturbed one, and the text around it."""
    pairs = zip(got, want, strict=False)
    at = next((k for k, (x, y) in enumerate(pairs) if x != y), min(len(got), len(want)))
    start = max(0, at - 10)
    return {"i": i, "cut_after_tokens": cut, "first_difference_at_char": at,
            "read": got[start : at + 30], "undisturbed": want[start : at + 30]}  # fmt: skip


def _cut_tokens(log: str) -> dict[int, int]:
    """Client index -> tokens it had when its worker died (the migration log lines, whose
    prefix names the client's x-request-id)."""
    found = re.findall(r"client=req-(\d+)\] request \S+: worker a failed mid-answer "
                       r"\(\w+\); continued after (\d+) tokens", log)  # fmt: skip
    return {int(i): int(n) for i, n in found}


@pytest.mark.xfail(
    strict=False,
    reason="timing: on an idle machine every request may end before the kill lands (a CI run "
    "at 12e8c7d moved nothing in 1.7 s); the migration itself is asserted on the simulator",
)
def test_kill_9_under_24_streams_and_8_whole_answers(twins: Proc) -> None:
    url = twins.url
    reference = asyncio.run(_run(url))
    assert all(not r.errors for r in reference), [r.errors for r in reference if r.errors]
    assert_nothing_held(url, within_s=10)

    def kill() -> None:
        # the worker holding the most requests now: routing may have placed every stream on one
        # (a pace penalty after a slow first answer, docs: routing), so a fixed name can miss
        workers = _workers(url)
        pid = int(max(workers.values(), key=lambda w: int(w["inflight"]))["pid"])
        for child in _child_pids(pid):  # the vLLM API server under gpupool's guard
            os.kill(child, signal.SIGKILL)

    t0 = time.monotonic()
    reads = asyncio.run(_run(url, kill))
    took = time.monotonic() - t0
    assert_nothing_held(url, within_s=30)
    log = Path(twins.log_path).read_text()
    metrics = httpx.get(url + "/metrics", timeout=30).text
    moved = [ln for ln in metrics.splitlines() if ln.startswith("gpupool_migrations_total{")]
    errors = [(i, r.errors) for i, r in enumerate(reads) if r.errors]
    same = [
        i for i, (r, ref) in enumerate(zip(reads, reference, strict=True)) if r.text == ref.text
    ]
    cuts = _cut_tokens(log)
    differ = [_difference(i, r.text, ref.text, cuts.get(i))
              for i, (r, ref) in enumerate(zip(reads, reference, strict=True))
              if r.text != ref.text]  # fmt: skip
    report(
        "real vLLM CPU: kill -9 of one of two workers under 24 streams + 8 whole answers",
        client_errors=len(errors),
        identical=f"{len(same)}/{len(reads)}",
        migrated_streams=len(cuts),
        migrated_identical=sum(1 for i in cuts if i in same),
        migrations=moved,
        differences=differ,
        seconds=round(took, 1),
    )
    assert not errors, errors
    assert all(r.done == 1 for r in reads)
    assert all(len(r.ids) <= 1 for r in reads), "one id in every chunk"
    assert len(same) >= 0.9 * len(reads), differ
    # the kill must have hit requests in flight; whether any had text yet (continued from its
    # text, `cuts`) or none (sent again whole, outcome "restarted") depends on the machine's
    # speed: both are migrations, and the continuation itself is proven on the simulator
    # (tests/e2e/test_migration_load.py) and reported here when it happens
    assert moved, "no request was on the killed worker when it died"
