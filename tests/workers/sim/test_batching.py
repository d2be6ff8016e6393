"""The simulator's GPU-shaped engine (``gpupool sim --gpu``): the scheduler step by step (no
clock), then over real HTTP: vLLM's gauges and counters as requests run, wait and abort."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from gpupool.workers.sim.app import create_sim_app
from gpupool.workers.sim.batching import Seq, StepEngine
from gpupool.workers.sim.config import GpuShape, SimConfig
from gpupool.workers.sim.engine import Admission
from gpupool.workers.sim.faults import Knobs

MODEL = "m"


def engine(max_num_seqs: int = 4, **shape: float) -> StepEngine:
    config = SimConfig(model=MODEL, max_model_len=4096, max_num_seqs=max_num_seqs,
                       gpu=GpuShape(**shape))  # type: ignore[arg-type]  # fmt: skip
    return StepEngine(config, Knobs.from_config(config))


def seq(prompt: int, out: int, text: str = "a") -> Seq:
    pieces = [f"{text}{i}" for i in range(prompt)]
    return Seq(Admission("r", pieces, out, output_lens=(out,)))


def step(e: StepEngine) -> list[tuple[Seq, int]]:
    """One scheduler step without its sleep: admit, schedule, finish."""
    e._admit(time.monotonic())
    batch = e._schedule()
    e._finish(batch, time.monotonic())
    return batch


def test_a_step_lasts_its_base_plus_each_sequence_plus_its_prefill() -> None:
    e = engine(step_ms=20, seq_step_ms=2, prefill_ms_per_1k=10)
    e.waiting.extend([seq(1000, 8), seq(1, 8)])
    e._admit(time.monotonic())
    batch = e._schedule()
    assert [chunk for _, chunk in batch] == [1000, 1]
    assert e._duration(batch) == pytest.approx((20 + 2 * 2 + 10 * 1001 / 1000) / 1000)


def test_several_tokens_a_step_after_the_step_that_ends_the_prompt() -> None:
    e = engine(tokens_per_step=4)
    s = seq(10, 10)
    e.waiting.append(s)
    made = []
    while not s.done:
        step(e)
        made.append(s.produced)
    assert made == [1, 5, 9, 10]  # the prefill step samples one, then four a step
    assert e.metrics.counters["generation_tokens"] == 10
    assert not e.scheduled and e._reserved == 0


def test_max_num_seqs_run_and_the_rest_wait_in_the_engine() -> None:
    e = engine(max_num_seqs=2)
    seqs = [seq(4, 3, text=str(i)) for i in range(5)]
    e.waiting.extend(seqs)
    step(e)
    running, waiting, _ = (g() for g in e.metrics.gauges.values())
    assert (running, waiting) == (2, 3)
    while e.waiting or e.scheduled:
        step(e)
        assert len(e.scheduled) <= 2
    assert all(s.produced == 3 for s in seqs)


def test_prompts_are_chunked_into_the_step_budget_after_the_decodes() -> None:
    e = engine(max_num_batched_tokens=1024)
    short, long = seq(8, 50, "s"), seq(3000, 4, "l")
    e.waiting.append(short)
    step(e)  # short's prompt is done: it decodes from now on
    e.waiting.append(long)
    chunks = [[c for _, c in step(e)] for _ in range(3)]
    assert chunks == [[0, 1023], [0, 1023], [0, 954]]  # one token of each budget for the decode
    assert long.computed == 3000 and long.produced == 1


def test_prefix_cache_hits_skip_prefill_and_the_cache_evicts_least_recent() -> None:
    e = engine(num_gpu_blocks=8)  # 128 tokens of cache
    first, again = seq(64, 1, "x"), seq(64, 1, "x")
    e.waiting.append(first)
    step(e)
    e.waiting.append(again)
    e._admit(time.monotonic())
    assert again.computed == 48  # three full blocks; the last block holds the last token
    counters = e.metrics.counters
    assert (counters["prefix_cache_queries"], counters["prefix_cache_hits"]) == (128, 48)
    e._finish(e._schedule(), time.monotonic())
    for other in ("y", "z"):  # 2 x 4 blocks push x's out
        e.waiting.append(seq(64, 1, other))
        step(e)
    late = seq(64, 1, "x")
    e.waiting.append(late)
    e._admit(time.monotonic())
    assert late.computed == 0


def test_the_kv_cache_holds_whole_lengths_before_admitting() -> None:
    e = engine(max_num_seqs=8, num_gpu_blocks=10)
    a, b = seq(64, 64, "a"), seq(64, 64, "b")  # 8 blocks each
    e.waiting.extend([a, b])
    step(e)
    assert e.scheduled == [a] and list(e.waiting) == [b]


def test_the_defaults_are_the_classic_simulator() -> None:
    assert SimConfig().gpu is None
    with pytest.raises(ValueError, match="tokens_per_step"):
        SimConfig(gpu=GpuShape(tokens_per_step=0))


def test_the_cli_builds_the_gpu_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpupool.workers.sim import cli

    seen: list[SimConfig] = []
    monkeypatch.setattr("gpupool.workers.sim.app.run_sim", seen.append)
    args = ["--gpu", "--step-ms", "30", "--seq-step-ms", "0.25", "--tokens-per-step", "4",
            "--prefill-ms-per-1k", "5", "--max-num-batched-tokens", "512",
            "--num-gpu-blocks-override", "100"]  # fmt: skip
    result = CliRunner().invoke(cli.sim, args)
    assert result.exit_code == 0, result.output
    assert seen[0].gpu == GpuShape(30, 0.25, 4, 5, 512, 100)
    assert CliRunner().invoke(cli.sim, []).exit_code == 0
    assert seen[1].gpu is None
    bad = CliRunner().invoke(cli.sim, ["--gpu", "--step-ms", "0"])
    assert bad.exit_code == 2 and "step_ms must be > 0" in bad.output


# -- over HTTP -----------------------------------------------------------------------------


@contextmanager
def serve(config: SimConfig) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(create_sim_app(config), host="127.0.0.1", port=0,
                                           access_log=False, log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.fixture
async def gpu_sim() -> AsyncIterator[httpx.AsyncClient]:
    shape = GpuShape(step_ms=10, seq_step_ms=0, tokens_per_step=1)
    config = SimConfig(model=MODEL, max_num_seqs=2, mode="lorem", output_tokens=400, gpu=shape)
    with serve(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield client


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


async def _until(client: httpx.AsyncClient, ok: object, what: str) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while True:
        m = _metrics((await client.get("/metrics")).text)
        if callable(ok) and ok(m):
            return m
        assert time.monotonic() < deadline, f"never {what}: {m}"
        await asyncio.sleep(0.02)


def _chat(max_tokens: int, stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello there " * 20}],
            "max_tokens": max_tokens, "stream": stream}  # fmt: skip


async def test_gauges_and_counters_move_while_requests_run_wait_and_abort(
    gpu_sim: httpx.AsyncClient,
) -> None:
    tasks = [asyncio.create_task(gpu_sim.post("/v1/chat/completions", json=_chat(300)))
             for _ in range(3)]  # fmt: skip
    m = await _until(
        gpu_sim,
        lambda m: (
            m["vllm:num_requests_running"] == 2
            and m["vllm:num_requests_waiting"] == 1
            and m["vllm:generation_tokens_total"] > 0
        ),
        "two running, one waiting, tokens counted before any request ended",
    )
    assert m["vllm:kv_cache_usage_perc"] > 0
    assert m["vllm:prompt_tokens_total"] > 0
    assert m["vllm:prefix_cache_queries_total"] == m["vllm:prompt_tokens_total"]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    m = await _until(
        gpu_sim,
        lambda m: m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0,
        "empty after the clients went away",
    )
    assert m["vllm:request_success_total"] == 3  # all three aborted (the abort series)
    assert m["vllm:kv_cache_usage_perc"] == 0
    stats = (await gpu_sim.get("/sim/stats")).json()
    assert (stats["aborted_total"], stats["completed_total"]) == (3, 0)


async def test_streamed_and_whole_bodies_carry_every_token(gpu_sim: httpx.AsyncClient) -> None:
    whole = (await gpu_sim.post("/v1/chat/completions", json=_chat(7))).json()
    assert whole["usage"]["completion_tokens"] == 7
    async with gpu_sim.stream("POST", "/v1/chat/completions", json=_chat(7, True)) as r:
        raw = b"".join([part async for part in r.aiter_raw()])
    events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert len(events) == 1 + 7  # the role chunk, then one per token
    assert raw.endswith(b"data: [DONE]\n\n")
    m = _metrics((await gpu_sim.get("/metrics")).text)
    assert m["vllm:generation_tokens_total"] == 14
    assert m["vllm:prefix_cache_hits_total"] > 0  # the second prompt found the first's blocks
    (await gpu_sim.post("/reset_prefix_cache")).raise_for_status()


async def test_the_gpu_mode_serves_the_same_metric_names(gpu_sim: httpx.AsyncClient) -> None:
    with serve(SimConfig(model=MODEL)) as url:
        async with httpx.AsyncClient() as client:
            classic = _metrics((await client.get(url + "/metrics")).text)
    assert set(_metrics((await gpu_sim.get("/metrics")).text)) == set(classic)
