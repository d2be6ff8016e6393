"""``/v1/responses`` streams migrate on real vLLM (issue 36): two CPU workers of one tiny model.

Four greedy Responses streams (``ignore_eos``) are read once undisturbed, then again while the
API server of the first stream to have read ten deltas is killed (``kill -9``), mid-answer.
Every client must read one valid stream from vLLM's own events and the continuation's (no error
event, one ``response.created`` and one ``response.completed``, sequence numbers without gap,
one response id, every delta on one message item whose done events and final output carry the
whole text), and each cut stream's text after its cut must be the surviving worker's own greedy
completion of the rendered prompt and the text before it (nothing repeated or lost at the cut).
How many answers equal the undisturbed ones is reported (greedy on identical weights; they may
differ from a token boundary at the cut on).

One stack of its own (two workers, about 3 GB each): run it under the machine's heavy-test lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpupool.gateway.transform.responses_continuation import chat_messages
from tests.support.fault_tools import report
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running
from tests.vllm.conftest import MODEL, _paths, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

STREAMS = 4
TOKENS = 800  # every one generated (ignore_eos): the kill lands mid-answer
BEGUN = 10  # deltas the first stream to have them has read when its worker is killed


def _worker(name: str, model_dir: Path, py: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "max_inflight": STREAMS,
        "launch": {
            # a port from the tests' own lock (below the ephemeral range, held 300 s): a port
            # gpupool picks by bind(0) stays free only until vLLM binds it, 30 s and more later
            "port": free_port(),
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
                "max-model-len": 1024,
                "max-num-seqs": STREAMS,
                "max-num-batched-tokens": 2048,
                "enforce-eager": True,
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
    tmp = tmp_path_factory.mktemp("responses")
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


def _body(i: int) -> dict[str, Any]:
    # no instructions: the tiny model's template reads content as parts (vLLM's "openai"
    # format) and cannot add a system message's parts to a string (vLLM's own 400)
    return {
        "model": MODEL,
        "input": [{"role": "user", "content": f"Tell me about the number {i}."}],
        "temperature": 0,
        "max_output_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
    }


class Read:
    """One client's Responses stream: its events, kept as they came, and its first worker.
    ``began``: the run's one event, set by the first stream with ``BEGUN`` deltas."""

    def __init__(self, began: asyncio.Event) -> None:
        self.events: list[dict[str, Any]] = []
        self.worker: str | None = None
        self.error = ""
        self.seen = 0  # deltas read
        self.began = began

    @property
    def deltas(self) -> list[str]:
        return [e["delta"] for e in self.events if e["type"] == "response.output_text.delta"]

    @property
    def text(self) -> str:
        return "".join(self.deltas)


async def _one(c: httpx.AsyncClient, url: str, i: int, read: Read) -> None:
    try:
        headers = {"x-request-id": f"resp-{i}"}
        async with c.stream("POST", url + "/v1/responses", json=_body(i), headers=headers) as r:
            read.worker = r.headers.get("x-gpupool-worker")
            if r.status_code != 200:
                read.error = (await r.aread())[:300].decode(errors="replace")
                return
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    read.events.append(json.loads(line[6:]))
                    if read.events[-1]["type"] == "response.output_text.delta":
                        read.seen += 1
                        if read.seen == BEGUN:
                            read.began.set()
    except httpx.HTTPError as e:
        read.error = f"{type(e).__name__}: {e}"


async def _run(url: str, kill: bool) -> tuple[list[Read], str | None]:
    began = asyncio.Event()
    reads = [Read(began) for _ in range(STREAMS)]
    killed = None
    async with httpx.AsyncClient(timeout=600) as c:
        tasks = [asyncio.create_task(_one(c, url, i, r)) for i, r in enumerate(reads)]
        if kill:
            await began.wait()
            killed = next(r.worker for r in reads if r.seen >= BEGUN)
            workers = (await c.get(url + "/admin/workers")).json()["data"]
            guard = int(next(w["pid"] for w in workers if w["name"] == killed))
            for child in _child_pids(guard):  # the vLLM API server under the guard
                os.kill(child, signal.SIGKILL)
        await asyncio.gather(*tasks)
    return reads, killed


def _child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _valid(read: Read) -> None:
    """One uninterrupted answer, as vLLM's Responses stream is."""
    kinds = [e["type"] for e in read.events]
    assert not read.error and "error" not in kinds, (read.error, kinds[-3:])
    assert kinds.count("response.created") == kinds.count("response.completed") == 1
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in read.events] == list(range(len(read.events)))
    assert len({e["item_id"] for e in read.events if "item_id" in e}) == 1
    final = read.events[-1]["response"]
    assert final["id"] == read.events[0]["response"]["id"]
    assert final["output"][0]["content"][0]["text"] == read.text
    done = next(e for e in read.events if e["type"] == "response.output_text.done")
    assert done["text"] == read.text


def _ids(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": MODEL, **body}, timeout=60)
    r.raise_for_status()
    return list(r.json()["tokens"])


# Not strict, as test_migration_real.py's kill test and for its reason: beside two CPU burners
# at 53fdce4 the kill landed after the four streams had ended (cut 0; 4/4 identical, nothing
# repeated or lost), so there was no seam to check. Alone it cut one and its seam was exact.
@pytest.mark.xfail(strict=False, reason="the kill may land after every stream has ended")
def test_responses_streams_go_on_after_a_kill(twins: Proc) -> None:
    url = twins.url
    reference, _ = asyncio.run(_run(url, kill=False))
    for read in reference:
        _valid(read)
    reads, killed = asyncio.run(_run(url, kill=True))
    survivor = next(w for w in httpx.get(url + "/admin/workers").json()["data"]
                    if w["name"] != killed)["url"]  # fmt: skip
    log = twins.logs()
    cut, seams, same = 0, 0, 0
    for i, read in enumerate(reads):
        _valid(read)
        same += read.text == reference[i].text
        moved = re.search(rf"client=resp-{i}\] request \w+: worker {killed} failed mid-answer "
                          r"\(\w+\); continued after (\d+) tokens", log)  # fmt: skip
        if moved is None:
            continue
        cut += 1
        n = int(moved[1])
        prefix = "".join(read.deltas[:n])
        rendered = _ids(survivor, {"messages": chat_messages(_body(i)),
                                   "add_generation_prompt": True})  # fmt: skip
        ids = rendered + _ids(survivor, {"prompt": prefix, "add_special_tokens": False})
        direct = httpx.post(survivor + "/v1/completions", timeout=600, json={
            "model": MODEL, "prompt": ids, "temperature": 0, "ignore_eos": True,
            "max_tokens": TOKENS - n}).json()  # fmt: skip
        assert "".join(read.deltas[n:]) == direct["choices"][0]["text"], i  # the seam exact
        seams += 1
        assert read.events[-1]["response"]["usage"]["input_tokens"] == len(rendered)
    report("Responses streams, kill -9 of a real vLLM worker", streams=STREAMS, cut=cut,
           seams_exact=seams, identical_to_undisturbed=same, killed=killed)  # fmt: skip
    assert cut >= 1, log[-3000:]
    assert_nothing_held(url, within_s=10)
