"""Swap groups from the configuration (config/swap.py) and what a launched member's command
gets (supervisor/command.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool.config import ConfigError, parse_config
from gpupool.config.models import GpupoolConfig
from gpupool.config.swap import crowded_gpus
from gpupool.workers.planner import ModelSpec, load_model_spec
from gpupool.workers.planner.memory import GiB
from gpupool.workers.planner.swap_checks import HostRam, check_swap, swap_notes
from gpupool.workers.supervisor.command import build_command, build_env
from tests.support.procs import ROOT

MODEL_CONFIGS = ROOT / "tests" / "data" / "model_configs"


def cfg(*workers: dict[str, Any]) -> GpupoolConfig:
    models = sorted({w["model"] for w in workers})
    return parse_config({"models": [{"name": m} for m in models], "workers": list(workers)})


def launched(name: str, model: str, gpus: list[int], share: float | None) -> dict[str, Any]:
    args = {} if share is None else {"gpu-memory-utilization": share}
    return {"name": name, "model": model,
            "launch": {"model_path": "/m", "gpus": gpus, "args": args}}  # fmt: skip


def test_workers_that_cannot_all_be_awake_on_one_gpu_form_a_group() -> None:
    c = cfg(launched("a", "x", [0], 0.85), launched("b", "y", [0], 0.85))
    assert [(w.swap_group, w.sleep and w.sleep.level) for w in c.workers] == [("gpu0", 1)] * 2
    (group,) = crowded_gpus(c.workers)
    assert "0.85 + b 0.85 = 1.7" in group.explain()


def test_shares_that_fit_stay_apart_and_vllms_default_counts() -> None:
    c = cfg(launched("a", "x", [0], 0.45), launched("b", "y", [0], 0.4))
    assert [w.swap_group for w in c.workers] == [None, None]
    c = cfg(launched("a", "x", [0], None), launched("b", "y", [0], 0.3))  # 0.9 + 0.3
    assert [w.swap_group for w in c.workers] == ["gpu0", "gpu0"]
    c = cfg(launched("a", "x", [0], 0.9), launched("b", "y", [1], 0.9))
    assert [w.swap_group for w in c.workers] == [None, None]


def test_a_named_group_wins_and_sleep_settings_are_kept() -> None:
    a = {**launched("a", "x", [0], 0.8), "swap_group": "mine", "sleep": {"level": 2}}
    c = cfg(a, launched("b", "y", [0], 0.8))
    assert [w.swap_group for w in c.workers] == ["mine", "mine"]
    assert [w.sleep and int(w.sleep.level) for w in c.workers] == [2, 1]


def test_members_launch_with_sleep_mode_and_dev_mode() -> None:
    c = cfg(launched("a", "x", [0], 0.85), launched("b", "y", [0], 0.85))
    argv = build_command(c.workers[0], 8001)
    env = build_env(c.workers[0], None, "/tmp/state", base={})
    assert argv.count("--enable-sleep-mode") == 1 and env["VLLM_SERVER_DEV_MODE"] == "1"
    alone = cfg(launched("a", "x", [0], 0.5)).workers[0]
    assert "--enable-sleep-mode" not in build_command(alone, 8001)
    assert "VLLM_SERVER_DEV_MODE" not in build_env(alone, None, "/tmp/state", base={})


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [("sleep", {"level": 3}, "workers[0].sleep.level"),
     ("sleep", {"idle_s": 0}, "workers[0].sleep.idle_s"),
     ("swap_group", "a b", "workers[0].swap_group")],
)  # fmt: skip
def test_bad_sleep_settings_name_their_field(field: str, value: object, where: str) -> None:
    w = {"name": "a", "model": "x", "url": "http://127.0.0.1:9", field: value}
    with pytest.raises(ConfigError) as e:
        cfg(w)
    assert where in str(e.value)


def test_level_2_on_dummy_weights_is_refused_naming_why() -> None:
    """vLLM cannot reload `load-format: dummy` weights: a level-2 wake would fail and restart
    the worker every time (what the H200 lane measured as a "52 s level-2 switch")."""
    a = launched("a", "x", [0], 0.8)
    a["launch"]["args"]["load-format"] = "dummy"
    with pytest.raises(ConfigError) as e:
        cfg({**a, "sleep": {"level": 2}}, launched("b", "y", [0], 0.8))
    assert "workers[0].sleep.level" in str(e.value) and "cannot reload" in str(e.value)
    c = cfg({**a, "sleep": {"level": 1}}, launched("b", "y", [0], 0.8))  # level 1: fine
    assert [int(w.sleep.level) for w in c.workers if w.sleep] == [1, 1]
    for words in (["--load-format", "dummy"], ["--load-format=dummy"]):  # in the command
        b = launched("a", "x", [0], 0.8)
        b["launch"]["command"] = ["vllm", "serve", "{model_path}", *words]
        with pytest.raises(ConfigError):
            cfg({**b, "sleep": {"level": 2}}, launched("b", "y", [0], 0.8))


def _specs(c: GpupoolConfig, model: str) -> dict[str, ModelSpec | None]:
    spec = load_model_spec(MODEL_CONFIGS / model / "config.json")  # ~17.5 GiB of weights
    return {w.name: spec for w in c.workers}


def test_check_refuses_level_1_weights_the_host_cannot_hold() -> None:
    c = cfg(*(launched(n, n, [0], 0.8) for n in ("a", "b", "c")))
    specs = _specs(c, "qwen3.5-9b")
    big = HostRam(total=64 * GiB, available=60 * GiB)
    assert check_swap(c, specs, big) == []  # two asleep: ~35 GiB
    small = HostRam(total=32 * GiB, available=30 * GiB)
    (finding,) = check_swap(c, specs, small)
    assert finding.level == "error" and "35.1 GiB" in finding.message
    busy = HostRam(total=64 * GiB, available=20 * GiB)
    assert [f.level for f in check_swap(c, specs, busy)] == ["warning"]


def test_check_warns_of_slow_level_2_wakes_and_explains_groups() -> None:
    a = {**launched("a", "x", [0], 0.8), "sleep": {"level": 2}}
    c = cfg(a, launched("b", "y", [0], 0.8))
    findings = check_swap(c, _specs(c, "qwen3.5-9b"), HostRam(64 * GiB, 60 * GiB))
    assert [(f.level, f.path) for f in findings] == [("warning", "workers[0].sleep.level")]
    (note,) = swap_notes(c)
    assert "a, b share GPU 0" in note and "a level 2, b level 1" in note


def test_check_warns_of_a_group_member_without_a_gpu() -> None:
    a = {"name": "a", "model": "x", "swap_group": "g", "launch": {"model_path": "/m"}}
    (finding,) = check_swap(cfg(a), {}, None)
    assert finding.path == "workers[0].launch.gpus" and "not supported" in finding.message


def test_a_discovered_worker_cannot_join_a_swap_group() -> None:
    """Its workers come and go outside the group's turns: the group could wake a member beside
    them (issue 37: 25 out-of-memory wakes). `check` and `serve` refuse, saying what to do."""
    for extra in ({"swap_group": "g"}, {"sleep": {"level": 1}}):
        w = {"name": "a", "model": "x", "discover": {"dns": "vllm.local", "port": 8000}, **extra}
        with pytest.raises(ConfigError) as e:
            cfg(w)
        assert "workers[0]" in str(e.value) and "`discover:` entry cannot" in str(e.value)
        assert "url:" in str(e.value)


def test_check_says_one_replica_controls_a_group_on_redis() -> None:
    a = {**launched("a", "x", [0], 0.8), "swap_group": "g"}
    c = cfg(a, launched("b", "y", [0], 0.8))
    assert not any("replica" in n for n in swap_notes(c))
    c.queue.backend = type(c.queue.backend)("redis")
    assert any("second replica" in n for n in swap_notes(c))
