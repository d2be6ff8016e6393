"""Swap-group test stacks: `gpupool serve` with launched (or url:) simulated workers that share
one simulated GPU through a sleep ledger, and a sampler that checks the invariants while a
test runs (never two members of a group ready at once; the ledger records every wake or start
that would not fit, every request a sleeping (or falling asleep) worker received, every sleep
that aborted a generation, and each member's sleeps that had to wait for one)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from tests.support.procs import Proc, gateway, running

AWAKE = ("ready", "waking", "falling_asleep")


def launched(name: str, model: str, ledger: Path, **args: Any) -> dict[str, Any]:
    """A launched simulated worker on GPU 0 holding 0.85 of it while awake."""
    base = {"gpu-memory-utilization": 0.85, "sleep-ledger": str(ledger), "max-num-seqs": 4,
            "itl-ms": 10, "output-tokens": 200, "sleep-s": 0.05, "wake-s": 0.1}  # fmt: skip
    return {
        "name": name,
        "model": model,
        "launch": {
            "gpus": [0],
            "model_path": "unused",
            "command": [sys.executable, "-m", "gpupool.workers.sim"],
            "args": {**base, **args},
            "startup_timeout_s": 60,
            "backoff_initial_s": 0.2,
        },
    }


def two_model_config(tmp: Path, **extra: Any) -> dict[str, Any]:
    ledger = tmp / "gpu0-ledger.json"
    cfg: dict[str, Any] = {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [launched("coder-w", "coder", ledger), launched("chat-w", "chat", ledger)],
        "routing": {"health_interval_s": 0.5, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0.3},
        "queue": {"max_wait_s": 60},
    }
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def ledger_of(tmp: Path) -> dict[str, Any]:
    path = tmp / "gpu0-ledger.json"
    return json.loads(path.read_text()) if path.exists() else {"members": {}, "violations": []}


def sleeps_waited(ledger: dict[str, Any]) -> dict[str, int]:
    """Each member's sleeps that found a generation running (``mode=wait`` let it finish).

    None where every client stays: the gateway asks for a sleep once its own in-flight count
    for the worker is 0, so nothing runs there then, and no stream of its can be cut. (A client
    that leaves mid-stream may make one: its abort reaches the worker a moment late.)"""
    return {name: m.get("sleeps_waited", 0) for name, m in ledger["members"].items()}


def sdk(gw: Proc) -> openai.OpenAI:
    """The official SDK on the gateway: no retries, so a refused request shows."""
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)


def workers(gw: Proc) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in httpx.get(f"{gw.url}/admin/workers", timeout=10).json()["data"]}


def wait_states(gw: Proc, want: dict[str, str], timeout: float = 60) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    seen: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        seen = workers(gw)
        if all(seen[n]["state"] == s for n, s in want.items()):
            return seen
        time.sleep(0.05)
    states = [(n, w["state"], w["last_error"]) for n, w in seen.items()]
    raise AssertionError(f"never {want}: {states}")


class Sampler:
    """Polls /admin/workers while a test runs: the most members of one group awake at once."""

    def __init__(self, gw: Proc) -> None:
        self.gw = gw
        self.most_awake = 0
        self.samples = 0
        self.states: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                data = client.get(f"{self.gw.url}/admin/workers").json()["data"]
                groups: dict[str, int] = {}
                for w in data:
                    self.states.add(w["state"])
                    if w["swap_group"] and w["state"] in AWAKE:
                        groups[w["swap_group"]] = groups.get(w["swap_group"], 0) + 1
                self.most_awake = max([self.most_awake, *groups.values()])
                self.samples += 1
                time.sleep(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@contextmanager
def serving(cfg: dict[str, Any], tmp: Path) -> Iterator[Proc]:
    gw = gateway(cfg, tmp)
    with running(gw, ready_path="/ready", timeout=90):
        yield gw


def metric(gw: Proc, name: str, **labels: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
