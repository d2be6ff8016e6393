"""The `init` phase: `gpupool init` writes the config on the machine's GPUs, vLLM starts with it.

Steps: ``init`` (``gpupool init --model <the prepared model dir>`` with the GPUs found by NVML,
``gpupool check`` on the file it wrote, then the lane's changes for a machine without weights)
→ the shared ``hardware``, ``plan``, ``launch`` → ``request`` (one chat completion through
gpupool) → ``planner`` (init's KV figure against vLLM's log) → ``stop``.

The lane changes only what a machine without weights or network needs, and records each change:
``load-format: dummy`` (random weights of the real shape), the offline environment of the other
phases, the state directory and port of the lane, and ``vllm serve`` → ``python3 -m
vllm.entrypoints.openai.api_server`` only when no ``vllm`` command is on the PATH. Every flag
``init`` chose is served as written.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import lane_http
import yaml
from lane_ctx import Ctx

OFFLINE_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
FALLBACK_COMMAND = [
    "python3",
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "{model_path}",
]
HOLDS = re.compile(r"KV cache \((\d+) blocks\) holds ([\d.]+) sequences of (\d+) tokens")


async def init(ctx: Ctx) -> dict[str, Any]:
    """`gpupool init` for the prepared model on the detected GPUs; `check` on what it wrote."""
    work = ctx.lane.work
    model_dir = work / "model"  # check.py's setup prepared it (shape + offline tokenizer)
    written = work / "init.yaml"
    gpu = os.environ.get("LANE_INIT_GPU")  # the rehearsal has no NVML: it names the card
    extra = ["--gpu", gpu] if gpu else []
    made = await ctx.gpupool_async("init", "--model", str(model_dir), "-o", str(written), *extra)
    out: dict[str, Any] = {"rc": made["rc"], "out": made["out"][-3000:], "gpus_from": gpu or "NVML"}
    if made["rc"] != 0 or not written.exists():
        raise RuntimeError(f"gpupool init failed: {made['out'][-800:]}")
    text = written.read_text()
    checked = await ctx.gpupool_async("check", "--config", str(written))
    out.update(
        {
            "yaml": text,
            "kv_comments": [m.groups() for m in HOLDS.finditer(text)],
            "check_rc": checked["rc"],
            "check_out": checked["out"][-2000:],
        }
    )
    served, changes = for_the_lane(yaml.safe_load(text), ctx)
    ctx.config_path.write_text(yaml.safe_dump(served, sort_keys=False))
    ctx.config = served
    ctx.lane.results["meta"].update(
        {"config": "written by gpupool init", "effective_config": served}
    )
    out["lane_changes"] = changes
    return out


def for_the_lane(cfg: dict[str, Any], ctx: Ctx) -> tuple[dict[str, Any], list[str]]:
    """``cfg`` as the lane serves it, and what was changed (see the module docstring)."""
    changes = [f"server: state_dir {ctx.state_dir}, port {ctx.port}, expose_worker_header"]
    server = cfg.setdefault("server", {})
    server.update({"port": ctx.port, "state_dir": str(ctx.state_dir), "expose_worker_header": True})
    has_vllm = shutil.which("vllm") is not None
    for w in cfg.get("workers", []):
        launch = w.get("launch")
        if not launch:
            continue
        launch.setdefault("args", {})["load-format"] = "dummy"
        launch["env"] = {**OFFLINE_ENV, **(launch.get("env") or {})}
        changes.append(f"{w['name']}: load-format dummy, env {sorted(OFFLINE_ENV)}")
        if not has_vllm and "command" not in launch:
            launch["command"] = FALLBACK_COMMAND
            changes.append(f"{w['name']}: no `vllm` on PATH, command {' '.join(FALLBACK_COMMAND)}")
    return cfg, changes


async def request(ctx: Ctx) -> dict[str, Any]:
    """One chat completion through gpupool, as a user of the written config sends it."""
    body = lane_http.chat(ctx.model, "Say hello to the H200.", 32)
    return await lane_http.post(ctx.client, ctx.gateway().url, body, limit_s=60)
