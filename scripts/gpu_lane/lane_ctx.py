"""What every step gets: the lane, the gateway, an HTTP client, the GPU sampler, the config."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import lane_gpu
import lane_logs
from lane_gateway import Gateway
from lane_util import Lane, sh


@dataclass
class Ctx:
    lane: Lane
    config_path: Path
    config: dict[str, Any]
    state_dir: Path
    client: httpx.AsyncClient
    sampler: lane_gpu.Sampler
    port: int
    gw: Gateway | None = None
    baseline_mib: list[int] | None = None

    @property
    def model(self) -> str:
        return str(self.config["models"][0]["name"])

    def kv_routing(self) -> bool:
        """Precise prefix routing (``routing.kv_events.enabled``) in the served config."""
        kv = (self.config.get("routing") or {}).get("kv_events") or {}
        return bool(kv.get("enabled"))

    @property
    def worker_names(self) -> list[str]:
        return [w["name"] for w in self.config["workers"]]

    def worker_cfg(self, name: str) -> dict[str, Any]:
        return next(w for w in self.config["workers"] if w["name"] == name)

    def gateway(self) -> Gateway:
        if self.gw is None or not self.gw.alive():
            raise RuntimeError("gpupool is not running")
        return self.gw

    def window(self, name: str) -> int:
        w = self.gateway().workers.get(name) or {}
        return int(
            w.get("max_model_len")
            or self.worker_cfg(name)["launch"]["args"].get("max-model-len", 0)
        )

    def by_window(self, model: str | None = None) -> list[str]:
        """This model's workers, smallest window first."""
        names = [w["name"] for w in self.config["workers"] if w["model"] == (model or self.model)]
        return sorted(names, key=self.window)

    def direct_url(self, name: str) -> str:
        url = self.gateway().workers[name].get("url")
        if not url:
            raise RuntimeError(f"worker {name} has no address (state {self.gateway().state(name)})")
        return str(url)

    def log_path(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def launches(self, name: str) -> list[dict[str, Any]]:
        return lane_logs.worker_launches(self.log_path(name))

    def gpupool(self, *args: str, timeout: float = 120) -> dict[str, Any]:
        return sh([self.lane.python, "-m", "gpupool", *args], timeout=timeout)

    async def gpupool_async(self, *args: str, limit_s: float = 120) -> dict[str, Any]:
        return await asyncio.to_thread(self.gpupool, *args, timeout=limit_s)


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("vllm", "torch", "triton", "transformers", "gpupool"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = sys.version.split()[0]
    return out


def cache_stats(state_dir: Path) -> dict[str, Any]:
    """Files and bytes under each GPU-keyed cache (``<state_dir>/cache/<key>/{vllm,triton}``)."""
    root = state_dir / "cache"
    out: dict[str, Any] = {}
    if not root.is_dir():
        return out
    for key in sorted(p for p in root.iterdir() if p.is_dir()):
        for kind in ("vllm", "triton"):
            files = [p for p in (key / kind).rglob("*") if p.is_file()]
            out[f"{key.name}/{kind}"] = {
                "files": len(files),
                "mib": round(sum(p.stat().st_size for p in files) / 2**20, 1),
            }
    return out


def parse_json(text: str) -> Any:
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        return None
