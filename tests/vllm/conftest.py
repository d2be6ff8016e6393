"""One `gpupool serve` supervising two real vLLM (CPU) workers for the whole session.

The vLLM virtual environment and the tiny offline models come from `make test`
(scripts/setup_vllm.sh and scripts/make_tiny_models.py); without them these tests skip.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import ROOT, Proc, gateway, running, sim

MODEL = "tiny"
BIG_WINDOW, SMALL_WINDOW = 2048, 768


def _paths() -> tuple[Path, Path]:
    py = Path(os.environ.get("GPUPOOL_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
    models = Path(os.environ.get("GPUPOOL_TINY_MODELS", ROOT / ".models"))
    return py, models


def _worker(name: str, model_dir: Path, window: int, py: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
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
                "max-model-len": window,
                "max-num-seqs": 4,
                "max-num-batched-tokens": 2048,
                # these workers return raw `<think>` text so that the gateway's split is tested
                "reasoning-parser": False,
                # no torch.compile: on CPU it is most of a start (34 s of 70 with a cold cache,
                # several minutes on a loaded 2-core box), and these tests read the API, not speed
                # (vLLM's own CPU CI skips it too, VLLM_CPU_CI_ENV)
                "enforce-eager": True,
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 300,
            "backoff_initial_s": 0.5,
        },
        "warmup": [{"prompt": "warm up", "max_tokens": 2}],
    }


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("vllm")
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL, "reasoning": "qwen3"}],
        "workers": [
            _worker("big", models / "qwen3-dense", BIG_WINDOW, py),
            _worker("small", models / "qwen3-next-hybrid", SMALL_WINDOW, py),
        ],
        "routing": {"health_interval_s": 1.0, "fail_threshold": 2},
    }
    gw = gateway(cfg, tmp)
    with running(gw):
        wait_ready(gw, timeout=420)
        yield {"gw": gw, "tmp": tmp, "models": models, "py": py}


def wait_ready(gw: Proc, timeout: float, names: tuple[str, ...] = ("big", "small")) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        data = httpx.get(gw.url + "/admin/workers", timeout=5).json()["data"]
        states = {w["name"]: w["state"] for w in data}
        if all(states.get(n) == "ready" for n in names):
            return
        time.sleep(0.5)
    raise TimeoutError(f"workers not ready: {states}\n{gw.logs()}")


@pytest.fixture(scope="session")
def contract_sim(
    real_stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    s = sim(model=MODEL, max_model_len=BIG_WINDOW, tmp=tmp_path_factory.mktemp("contract"),
            mode="lorem", max_num_seqs=4)  # fmt: skip
    with running(s):
        yield s
