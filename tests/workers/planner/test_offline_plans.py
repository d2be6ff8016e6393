"""Plans without a GPU and without a model cache (issue 25): every example in config/examples/
names its cards (``gpus:``), so ``gpupool plan --config`` prints a plan for each worker on a
laptop, with model shapes from the package's built-in catalogue of the seed models
(``gpupool.workers.planner.shapes``); ``--gpu`` / ``--gpu-memory-gb`` name the cards instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpupool.workers.gpus import discover_gpus
from gpupool.workers.planner.cli import PlannerDeps, plan
from tests.support.procs import ROOT
from tests.workers.planner.conftest import H100, H200, RTX_5090, RTX_PRO_6000

EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))
GPUPOOL = str(Path(sys.executable).with_name("gpupool"))


def offline_env(tmp_path: Path) -> dict[str, str]:
    """No network, an empty Hugging Face home, no cache variable pointing anywhere else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    (tmp_path / "hf-home").mkdir(exist_ok=True)
    return {**env, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}


def gpupool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUPOOL, *args], capture_output=True, text=True, timeout=120,
                          env=offline_env(tmp_path), cwd=tmp_path)  # fmt: skip


def plan_json(*args: str) -> dict[str, Any]:
    """``gpupool plan ... --json`` in process, with NVML finding nothing."""
    r = CliRunner().invoke(plan, [*args, "--json"], obj=PlannerDeps(discover=lambda: []))
    assert r.exit_code in (0, 1), r.output
    data: dict[str, Any] = json.loads(r.output)
    return data


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_every_worker_offline(example: Path, tmp_path: Path) -> None:
    r = gpupool(tmp_path, "plan", "--config", str(example), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["workers"], "no launched worker"
    for w in data["workers"]:
        assert w["skipped"] is None and w["plan"]["verdict"].startswith("ok"), w
        assert w["model_source"].startswith("built-in shape"), w["model_source"]
    if not discover_gpus():
        assert data["gpus_from"] == "the config's `gpus:` (no NVML here)"
    human = gpupool(tmp_path, "plan", "--config", str(example))
    assert human.returncode == 0 and "no plan" not in human.stdout, human.stdout
    assert "GPU memory unknown" not in human.stdout


def test_seed000_plans_each_card_at_its_own_size() -> None:
    data = plan_json("--config", str(ROOT / "config" / "examples" / "seed000-pro6000-5090.yaml"))
    memory = {w["name"]: w["plan"]["gpu"]["memory_bytes"] for w in data["workers"]}
    assert memory == {"big": RTX_PRO_6000, "small": RTX_5090}


def test_the_command_line_names_the_cards_instead(tmp_path: Path) -> None:
    config = str(ROOT / "config" / "examples" / "seed001-h100-sizing.yaml")
    named = plan_json("--config", config, "--gpu", "4xH200")
    assert named["gpus_from"] == "--gpu"
    assert {w["plan"]["gpu"]["memory_bytes"] for w in named["workers"]} == {H200}
    sized = plan_json("--config", config, "--gpu-memory-gb", "79.2,79.2,40,40")
    by_name = {w["name"]: w["plan"]["gpu"]["memory_bytes"] for w in sized["workers"]}
    assert by_name["h100-27b"] == round(79.2 * (1 << 30))
    assert by_name["h100x2-122b"] == 40 * (1 << 30)  # GPUs 2 and 3
    one = plan_json("--config", config, "--gpu-memory-gb", "80")  # one size for every worker
    assert {w["plan"]["gpu"]["memory_bytes"] for w in one["workers"]} == {80 * (1 << 30)}
    assert {w["plan"]["gpu"]["memory_bytes"] for w in plan_json("--config", config)["workers"]} == {
        H100
    }


def test_check_plans_with_the_cards_it_is_given(tmp_path: Path) -> None:
    config = tmp_path / "gpupool.yaml"
    text = (ROOT / "config" / "examples" / "seed002-5090-27b-nvfp4.yaml").read_text()
    config.write_text(text.replace('  0: "RTX 5090"\n', "  0: {memory_gb: 8}\n"))
    r = gpupool(tmp_path, "check", "--config", str(config))
    assert r.returncode == 1, r.stdout + r.stderr  # the 27B does not fit 8 GiB: check says so
    assert "workers[0].launch" in r.stderr
    ok = gpupool(tmp_path, "check", "--config", str(config), "--gpu", "RTX PRO 6000")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "GPUs from --gpu" in ok.stdout


def test_an_unknown_card_fails_at_load_naming_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "gpupool.yaml"
    text = (ROOT / "config" / "examples" / "seed002-5090-27b-nvfp4.yaml").read_text()
    config.write_text(text.replace('  0: "RTX 5090"\n', '  0: "RTX 9999"\n'))
    for command in ("plan", "check"):
        r = gpupool(tmp_path, command, "--config", str(config))
        assert r.returncode != 0
        out = r.stdout + r.stderr
        assert "gpus[0]" in out and "unknown card `RTX 9999`" in out and "h200" in out, out
        assert "Traceback" not in out
