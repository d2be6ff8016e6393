"""gpupool itself: the effective config, `gpupool serve` started and stopped, worker states."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml
from lane_util import Lane

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def prepare_model(shape: Path, tokenizer: Path | None, dest: Path) -> Path:
    """A servable model dir: the shape's config.json plus an offline tokenizer (weights: dummy)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(shape / "config.json", dest / "config.json")
    if tokenizer is not None and tokenizer.name == "none":
        return dest  # the rehearsal's simulator needs no tokenizer
    if tokenizer and (tokenizer / "tokenizer.json").exists():
        for name in TOKENIZER_FILES:
            if (tokenizer / name).exists():
                shutil.copy(tokenizer / name, dest / name)
        return dest
    import make_tiny_models  # the machine has tokenizers + transformers

    make_tiny_models.build_tokenizer().save_pretrained(dest)
    return dest


def effective_config(
    config: Path,
    model_dir: Path,
    state_dir: Path,
    port: int,
    shape_dir: Callable[[str], Path] | None = None,
) -> dict[str, Any]:
    """The config as served, state under ``state_dir``: every launched worker whose
    ``model_path`` is ``MODEL`` on ``model_dir`` (the phase's shape), one with
    ``SHAPE:<name>`` on ``shape_dir(name)`` (another shape of ``shapes/``, prepared the same way:
    a config with two different models, as the sleep phase's hybrid beside a dense model)."""
    cfg = yaml.safe_load(config.read_text())
    server = cfg.setdefault("server", {})
    server.update(
        {
            "host": "127.0.0.1",
            "port": port,
            "expose_worker_header": True,
            "state_dir": str(state_dir),
        }
    )
    for w in cfg.get("workers", []):
        launch = w.get("launch")
        if not launch:
            continue
        path = str(launch.get("model_path", "MODEL"))
        if path.startswith("SHAPE:") and shape_dir is not None:
            launch["model_path"] = str(shape_dir(path.removeprefix("SHAPE:")))
        else:
            launch["model_path"] = str(model_dir)
    return cfg


class Gateway:
    """One `gpupool serve` process and a poller that records every worker state change."""

    def __init__(self, lane: Lane, config_path: Path, port: int) -> None:
        self.lane, self.config_path = lane, config_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.timeline: list[dict[str, Any]] = []
        self.workers: dict[str, dict[str, Any]] = {}
        self.started_at = 0.0
        self._poller: asyncio.Task[None] | None = None
        self._client = httpx.AsyncClient()

    def start(self, log: Path) -> None:
        self.started_at = self.lane.elapsed()
        with log.open("ab") as f:
            self.proc = subprocess.Popen(
                [self.lane.python, "-m", "gpupool", "serve", "--config", str(self.config_path)],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        self._poller = asyncio.create_task(self._poll())
        self.lane.say("gpupool serve started, pid", self.proc.pid)

    async def _poll(self) -> None:
        while True:
            try:
                r = await self._client.get(self.url + "/admin/workers", timeout=5)
                self._record(r.json()["data"])
            except (httpx.HTTPError, OSError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.5)

    def _record(self, data: list[dict[str, Any]]) -> None:
        t = round(self.lane.elapsed(), 1)
        for w in data:
            old = self.workers.get(w["name"])
            key = (w["state"], w["restarts"], w["pid"])
            if old is None or (old["state"], old["restarts"], old["pid"]) != key:
                self.timeline.append(
                    {
                        "t": t,
                        "worker": w["name"],
                        "state": w["state"],
                        "restarts": w["restarts"],
                        "pid": w["pid"],
                        "last_error": (w.get("last_error") or "")[:200],
                    }
                )
            self.workers[w["name"]] = w

    def state(self, name: str) -> str | None:
        w = self.workers.get(name)
        return w["state"] if w else None

    def guards(self) -> dict[str, int | None]:
        return {name: w.get("pid") for name, w in self.workers.items()}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_states(self, names: list[str], want: set[str], limit_s: float) -> bool:
        """Until every named worker is in one of ``want`` (or has failed, or time runs out)."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end and self.alive():
            states = [self.state(n) for n in names]
            if all(s in want for s in states):
                return True
            if "failed" in states and "failed" not in want:
                return False
            await asyncio.sleep(0.5)
        return False

    def first(self, worker: str, state: str, after: float = 0.0) -> float | None:
        for e in self.timeline:
            if e["worker"] == worker and e["state"] == state and e["t"] >= after:
                return float(e["t"])
        return None

    async def admin(self, path: str, method: str = "GET", limit_s: float = 300) -> dict:
        r = await self._client.request(method, self.url + path, timeout=limit_s)
        return {"status": r.status_code, "body": r.json() if r.content else None}

    async def stop(self, limit_s: float = 60) -> dict[str, Any]:
        """SIGTERM, as an operator would; how long until gpupool (and its workers) exited."""
        if self._poller:
            self._poller.cancel()
        if self.proc is None:
            return {"stopped": False}
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.proc.wait, limit_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)
        return {"exit_code": self.proc.returncode, "seconds": round(time.monotonic() - t0, 1)}

    async def close(self) -> None:
        await self._client.aclose()
