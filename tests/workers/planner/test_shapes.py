"""Built-in shapes: they name the right model, agree with the hand-checked fixtures, and let
every file in config/examples plan offline on a machine that has never seen the models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpupool.config import load_config
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner import PlanArgs, load_model_spec, plan_from_args
from gpupool.workers.planner.cli import PlannerDeps, plan
from gpupool.workers.planner.gpu_catalog import gpus_from_cards
from gpupool.workers.planner.params import total_params
from gpupool.workers.planner.resolve import resolve_model
from gpupool.workers.planner.shapes import builtin_shape
from tests.support.procs import ROOT
from tests.workers.planner.conftest import (
    MODEL_CONFIGS,
    RTX_PRO_6000,
)

# repo id -> (base shape, quantization template)
NAMES = {
    "Qwen/Qwen3.5-0.8B": ("Qwen3.5-0.8B", None),
    "Qwen/Qwen3.5-2B": ("Qwen3.5-2B", None),
    "Qwen/Qwen3.5-27B": ("Qwen3.5-27B", None),
    "Qwen/Qwen3.5-27B-FP8": ("Qwen3.5-27B", "fp8"),
    "Kbenkhaled/Qwen3.5-27B-NVFP4": ("Qwen3.5-27B", "nvfp4"),
    "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit": ("Qwen3.5-35B-A3B", "awq"),
    "someone/Qwen3.5-35B-A3B-GPTQ-Int4": ("Qwen3.5-35B-A3B", "awq"),
    "nvidia/Qwen3.6-35B-A3B-NVFP4": ("Qwen3.6-35B-A3B", "nvfp4-modelopt"),
    "Qwen/Qwen3.5-397B-A17B-FP8": ("Qwen3.5-397B-A17B", "fp8"),
    "nvidia/Qwen3.5-397B-A17B-NVFP4": ("Qwen3.5-397B-A17B", "nvfp4-modelopt"),
    "/data/models/qwen3.5-122b-a10b": ("Qwen3.5-122B-A10B", None),
}


@pytest.mark.parametrize("ref", NAMES)
def test_names_find_their_shape(ref: str) -> None:
    shape = builtin_shape(ref)
    assert shape is not None
    assert (shape.name, shape.quantization) == NAMES[ref]


@pytest.mark.parametrize("ref", ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "Qwen/Qwen3.5-270B"])
def test_other_models_have_no_shape(ref: str) -> None:
    assert builtin_shape(ref) is None


@pytest.mark.parametrize(
    ("ref", "billions"),
    [
        ("Qwen/Qwen3.5-0.8B", 0.8),
        ("Qwen/Qwen3.5-2B", 2),
        ("Qwen/Qwen3.5-4B", 4),
        ("Qwen/Qwen3.5-9B", 9),
        ("Qwen/Qwen3.5-27B", 27),
        ("Qwen/Qwen3.5-35B-A3B", 35),
        ("Qwen/Qwen3.5-122B-A10B", 122),
        ("Qwen/Qwen3.5-397B-A17B", 397),
    ],
)
def test_shapes_add_up_to_the_size_in_their_name(ref: str, billions: float) -> None:
    spec = resolve_model(ref).spec
    assert spec.is_hybrid and spec.full_attention_layers * 4 == spec.num_layers
    assert total_params(spec) / 1e9 == pytest.approx(billions, rel=0.15)


# built-in reference -> the hand-checked fixture in tests/data/model_configs (SOURCES.md)
FIXTURES = {
    "Qwen/Qwen3.5-9B": "qwen3.5-9b",
    "Qwen/Qwen3.5-27B": "qwen3.5-27b",
    "Qwen/Qwen3.5-35B-A3B": "qwen3.5-35b-a3b",
    "Qwen/Qwen3.6-35B-A3B": "qwen3.6-35b-a3b",
    "Qwen/Qwen3.5-122B-A10B": "qwen3.5-122b-a10b",
    "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit": "qwen3.5-35b-a3b-awq",
    "Kbenkhaled/Qwen3.5-27B-NVFP4": "qwen3.5-27b-nvfp4",
    "nvidia/Qwen3.6-35B-A3B-NVFP4": "qwen3.6-35b-a3b-nvfp4",
}


@pytest.mark.parametrize("ref", FIXTURES)
def test_built_in_shapes_plan_like_the_fixtures(ref: str) -> None:
    """Same weights, KV per token, hybrid block and KV capacity on a 96 GB card."""
    args = PlanArgs(gpu_memory_bytes=RTX_PRO_6000, max_model_len=131072, kv_cache_dtype="fp8")
    built_in = plan_from_args(resolve_model(ref).spec, args)
    fixture = plan_from_args(load_model_spec(MODEL_CONFIGS / FIXTURES[ref]), args)
    assert built_in.weights.total == fixture.weights.total
    assert built_in.kv_bytes_per_token == fixture.kv_bytes_per_token
    assert built_in.layout == fixture.layout
    assert built_in.capacity == fixture.capacity


def test_shape_files_say_where_their_numbers_come_from() -> None:
    folder = ROOT / "gpupool" / "workers" / "planner" / "shapes"
    docs = [json.loads(p.read_text()) for p in folder.glob("qwen*.json")]
    assert len(docs) == 9
    assert all(d["source"] and d["repos"] for d in docs)


# example -> the GPUs the seed ran it on, as NVML would list them
EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))


def host_of(path: Path) -> list[GpuInfo]:
    """The machine an example was written for: the cards its `gpus:` section names."""
    return gpus_from_cards(load_config(path).gpus)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_names_its_cards(path: Path) -> None:
    cards = load_config(path).gpus
    used = {
        i for w in load_config(path).workers if w.launch and w.launch.gpus for i in w.launch.gpus
    }
    assert cards and used <= set(cards), f"{path.name}: `gpus:` must name GPUs {sorted(used)}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_offline(path: Path, hf_env: Path) -> None:
    """`gpupool plan --config` with an empty HF cache and HF_HUB_OFFLINE=1: every worker gets a
    plan from a built-in shape, says so, and can start."""
    assert not any(hf_env.iterdir())
    result = CliRunner().invoke(
        plan, ["--config", str(path), "--json"], obj=PlannerDeps(discover=lambda: host_of(path))
    )
    assert result.exit_code == 0, result.output
    workers = json.loads(result.output)["workers"]
    assert workers and all(w["plan"] is not None for w in workers), result.output
    assert all(w["model_source"].startswith("built-in shape") for w in workers)
    assert all(w["plan"]["verdict"] != "cannot start" for w in workers)


def test_the_table_output_says_a_built_in_shape_was_used() -> None:
    path = ROOT / "config" / "examples" / "seed002-5090-27b-nvfp4.yaml"
    host = host_of(path)
    result = CliRunner().invoke(plan, ["--config", str(path)], obj=PlannerDeps(lambda: host))
    assert "model shape from built-in shape Qwen3.5-27B + nvfp4 template" in result.output


def test_plan_takes_a_repo_id() -> None:
    args = ["--model", "Qwen/Qwen3.5-27B", "--gpu-memory-gb", "79.2", "--quantization", "fp8"]
    result = CliRunner().invoke(plan, args)
    assert result.exit_code == 0, result.output
    assert "model shape from built-in shape Qwen3.5-27B" in result.output
