"""The configurations shipped in config/ run as they are, on any machine (simulated workers):

* ``gpupool.yaml`` (the default): Claude-style clients work, the official ``anthropic`` SDK
  whole and streamed, and a thinking budget its workers cannot honour is the same clear 400
  streamed or not (the simulator serves ``/v1/messages`` as vLLM's adapter does);
* ``two-models-one-gpu-sim.yaml`` (more models than GPUs): both models answer, taking turns on
  the one simulated GPU, and only one is ever awake.

Only the address and the state directory are changed (a free port, a temporary directory).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.support.procs import ROOT, Proc, gateway, running

ASK: Any = [{"role": "user", "content": "hello there"}]


@dataclass(frozen=True)
class Served:
    url: str
    split: bool  # the workers run no reasoning parser: the gateway splits


def _shipped(name: str, tmp: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "config" / name).read_text())
    cfg["server"]["state_dir"] = str(tmp / "state")
    for w in cfg["workers"]:
        args = w.get("launch", {}).get("args", {})
        if "sleep-ledger" in args:  # the simulated GPU's ledger, beside the state
            args["sleep-ledger"] = str(tmp / "gpu0.json")
    return cfg


def _serve(cfg: dict[str, Any], tmp: Path) -> Proc:
    return gateway(cfg, tmp)


@pytest.fixture(scope="module", params=["parser", "split"])
def default_gw(tmp_path_factory: pytest.TempPathFactory, request: Any) -> Iterator[Served]:
    """The default config as shipped (its workers run the model's reasoning parser, as
    gpupool launches them), and with ``reasoning-parser: false`` (the gateway splits)."""
    tmp = tmp_path_factory.mktemp("default-config")
    cfg = _shipped("gpupool.yaml", tmp)
    if request.param == "split":
        for w in cfg["workers"]:
            w["launch"]["args"]["reasoning-parser"] = False
    gw = _serve(cfg, tmp)
    with running(gw, ready_path="/ready", timeout=90):
        yield Served(gw.url, request.param == "split")


def test_the_default_config_serves_claude_clients(default_gw: Served) -> None:
    claude = anthropic.Anthropic(base_url=default_gw.url, api_key="x", max_retries=0, timeout=60)
    whole = claude.messages.create(model="qwen3.5", max_tokens=16, messages=ASK)
    assert whole.type == "message" and whole.content and whole.usage.output_tokens > 0
    with claude.messages.stream(model="qwen3.5", max_tokens=16, messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens > 0
    assert claude.messages.count_tokens(model="qwen3.5", messages=ASK).input_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_budget_is_the_same_answer_streamed_or_not(default_gw: Served, stream: bool) -> None:
    """Workers with the reasoning parser honour a budget; where the gateway splits (workers
    without one) nothing can end a thought at a budget: a 400 in Anthropic's shape, streamed
    too, never a 200 and then an ``internal_error`` event."""
    claude = anthropic.Anthropic(base_url=default_gw.url, api_key="x", max_retries=0, timeout=60)
    budget: Any = {"type": "enabled", "budget_tokens": 1024}
    if not default_gw.split:
        reply = claude.messages.create(model="qwen3.5", max_tokens=2048, messages=ASK,
                                       thinking=budget, stream=stream)  # fmt: skip
        assert reply is not None
        return
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="qwen3.5", max_tokens=2048, messages=ASK, thinking=budget,
                               stream=stream)  # fmt: skip
    body: Any = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "BadRequestError"
    assert "thinking.budget_tokens cannot be honoured" in body["error"]["message"]


def test_more_models_than_gpus_on_the_simulator(tmp_path: Path) -> None:
    gw = _serve(_shipped("two-models-one-gpu-sim.yaml", tmp_path), tmp_path)
    with running(gw, ready_path="/health", timeout=90):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for model in ["chat", "coder", "chat", "coder"]:
            r = client.chat.completions.create(model=model, max_tokens=4, messages=ASK)
            assert r.model == model and r.choices[0].message.content
            workers = httpx.get(gw.url + "/admin/workers", timeout=10).json()["data"]
            states = {w["name"]: w["state"] for w in workers}
            assert states[model] == "ready"
            assert list(states.values()).count("ready") == 1, states


def test_drain_keeps_a_launched_worker_warm_and_stop_is_its_own_action(
    default_gw: Served,
) -> None:
    """On the default config's launched workers: Drain takes no new requests and keeps the
    process (Resume answers ``ready`` at once, the same process); Stop ends it; each answer
    names the state the action leads to (a Resume from stopped: ``starting``)."""
    if default_gw.split:
        pytest.skip("once is enough")
    admin = default_gw.url + "/admin/workers/small"
    before = httpx.get(admin, timeout=10).json()
    drained = httpx.post(admin + "/drain", timeout=60).json()
    assert drained["state"] == "draining" and drained["pid"] == before["pid"]
    resumed = httpx.post(admin + "/undrain", timeout=60).json()
    assert resumed["state"] == "ready" and resumed["pid"] == before["pid"]
    stopped = httpx.post(admin + "/stop", timeout=60).json()
    assert stopped["state"] == "stopped" and stopped["pid"] is None
    started = httpx.post(admin + "/undrain", timeout=60).json()
    assert started["state"] == "starting"
    restarted = httpx.post(default_gw.url + "/admin/workers/big/restart", timeout=60).json()
    assert restarted["state"] == "starting"
    for name in ("small", "big"):
        for _ in range(300):
            if (
                httpx.get(default_gw.url + f"/admin/workers/{name}", timeout=10).json()["state"]
                == "ready"
            ):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"{name} never ready again")
