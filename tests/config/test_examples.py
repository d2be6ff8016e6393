"""config/examples/: one configuration per seed, each valid, each passing `gpupool check`, and
each worker's flags fitting its card by gpupool's own planner (model shapes from tests/data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpupool.config import load_config
from gpupool.config.models import WorkerConfig
from gpupool.workers.planner import load_model_spec
from gpupool.workers.planner.checks import check_launch_config
from gpupool.workers.planner.memory import GiB
from gpupool.workers.supervisor.command import build_command, build_env
from tests.support.procs import ROOT

EXAMPLES = ROOT / "config" / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))
MODEL_CONFIGS = ROOT / "tests" / "data" / "model_configs"
PRO_6000, RTX_5090, H100 = 95.6, 31.8, 79.2  # GiB as NVML reports them

# example -> worker -> (model config under tests/data/model_configs, GiB of its card)
CARDS = {
    "seed000-pro6000-5090.yaml": {
        "big": ("qwen3.5-35b-a3b-awq", PRO_6000),
        "small": ("qwen3.5-35b-a3b-awq", RTX_5090),
    },
    "seed001-h100-sizing.yaml": {
        "h100-27b": ("qwen3.5-27b", H100),
        "h100-35b-a3b": ("qwen3.5-35b-a3b", H100),
        "h100x2-122b": ("qwen3.5-122b-a10b", H100),
    },
    "seed002-5090-27b-nvfp4.yaml": {"rtx5090": ("qwen3.5-27b-nvfp4", RTX_5090)},
    # no Qwen3.5-35B-A3B NVFP4 fixture: the Qwen3.6 one has the same architecture (SOURCES.md)
    "seed003-5090-35b-a3b-nvfp4.yaml": {"rtx5090": ("qwen3.6-35b-a3b-nvfp4", RTX_5090)},
    # issue 28: two models taking turns on one card (sleep mode)
    "two-models-one-gpu.yaml": {
        "chat": ("qwen3.5-9b", RTX_5090),
        "coder": ("qwen3.5-27b-nvfp4", RTX_5090),
    },
    "seed004-pro6000-b12x-5090-marlin.yaml": {
        "pro6000-b12x": ("qwen3.6-35b-a3b-nvfp4", PRO_6000),
        "rtx5090-marlin": ("qwen3.6-35b-a3b-nvfp4", RTX_5090),
    },
}


def test_one_example_per_seed_each_naming_what_it_learned() -> None:
    assert sorted(CARDS) == [f.name for f in FILES]
    seeds = sorted(p.name for p in (ROOT.parent / "shared" / "seeds").glob("0*.txt"))
    for i in range(len(seeds) or 5):
        (example,) = [f for f in FILES if f.name.startswith(f"seed{i:03d}-")]
        assert "What the seed learned" in example.read_text()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.workers and all(w.launch is not None for w in cfg.workers)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_gpupool_check_passes(path: Path) -> None:
    gpupool = Path(sys.executable).with_name("gpupool")
    r = subprocess.run([str(gpupool), "check", "--config", str(path)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout
    problems = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
    assert not problems, r.stderr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_flags_fit_their_cards(path: Path) -> None:
    """The planner, given each worker's model and card, finds nothing that stops vLLM."""
    cfg = load_config(path)
    for i, w in enumerate(cfg.workers):
        assert w.launch is not None
        model, gib = CARDS[path.name][w.name]
        spec = load_model_spec(MODEL_CONFIGS / model / "config.json")
        findings = check_launch_config(
            w.name, w.launch, [], spec, index=i, gpu_memory_bytes=int(gib * GiB)
        )
        errors = [f"{f.path}: {f.message}" for f in findings if f.level == "error"]
        assert not errors, errors


def _seed000() -> dict[str, WorkerConfig]:
    return {w.name: w for w in load_config(EXAMPLES / "seed000-pro6000-5090.yaml").workers}


def _argv_flags(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            out[token] = True if following.startswith("--") else following
    return out


def test_seed000_small_card_runs_the_seeds_production_command() -> None:
    argv = build_command(_seed000()["small"], 8001)
    assert argv[:3] == ["vllm", "serve", "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit"]
    flags = _argv_flags(argv[3:])
    seed = {
        "--gpu-memory-utilization": "0.83", "--max-model-len": "131072", "--max-num-seqs": "2",
        "--kv-cache-dtype": "fp8", "--quantization": "compressed-tensors",
        "--reasoning-parser": "qwen3", "--limit-mm-per-prompt": '{"image": 2, "video": 0}',
        "--enable-prefix-caching": True, "--trust-remote-code": True,
    }  # fmt: skip
    assert {k: flags.get(k) for k in seed} == seed
    assert int(str(flags["--max-num-batched-tokens"])) >= 2096  # the hybrid attention block


def test_seed000_big_card_warms_every_shape_and_shares_its_cache(tmp_path: Path) -> None:
    workers = _seed000()
    big, small = workers["big"], workers["small"]
    assert big.launch is not None and small.launch is not None
    assert (big.launch.gpus, small.launch.gpus) == ([0], [1])
    sizes = {tuple(size) for item in big.warmup for size in item.images}
    assert {(64, 64), (256, 256), (512, 512)} <= sizes
    assert any(len(item.images) == 2 for item in big.warmup)  # multi-image, at the limit
    assert any(item.prompt and not item.images for item in big.warmup)
    assert not small.warmup  # autotuning on the 5090 is what runs out of memory
    assert any(k.startswith("VLLM_") for k in big.launch.env)
    # both cards are sm_120: one Triton/compile cache, warmed by big, read by small
    env_big = build_env(big, "sm_120", tmp_path, base={})
    env_small = build_env(small, "sm_120", tmp_path, base={})
    for var in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
        assert env_big[var] == env_small[var]
    assert (env_big["CUDA_VISIBLE_DEVICES"], env_small["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
