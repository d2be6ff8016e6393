"""The targets: the upstream reached directly, gpupool, and the peers, each started on CPU1.

Every gateway runs one process (one worker) on one core, with its access log off, in front of
the same upstream. Peers live in their own virtual environments under ``bench/.venvs/``.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import yaml
from rig import GATEWAY_CPU, PY, ROOT, Proc, ensure_venv, free_port, pip_version

MODELS = ("fast", "paced", "idle")
PEERS = ("vllm-router", "sglang-router", "litellm")
ALL = ("direct", "gpupool", "gpupool-precise", "gpupool-base", "gpupool-redis", "aiohttp-naive",
       "python-floor", "python-floor-task", *PEERS, *("gpupool-x2", "gpupool-precise-x2",
       "vllm-router-x2", "vllm-router-cache-x2"))  # fmt: skip
# the -x2 targets: two workers a model (both the same upstream), so a router has a choice to
# make for every request: precise routing then scores two indexes, vllm-router's cache_aware
# policy matches its prefix tree, as in front of a real pool
# gpupool-precise's tokenizer: the tiny model's (`make models`)
KV_TOKENIZER = ROOT / ".models" / "qwen3-dense"


@dataclass
class Target:
    name: str
    port: int
    version: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    proc: Proc | None = None  # None: the upstream itself (direct)
    ready_path: str = "/health"
    note: str = ""
    precise: bool = False  # ready only once every worker is routed precisely (KV events)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        if self.proc is not None:
            self.proc.start()

    def wait(self, timeout: float) -> None:
        if self.proc is not None:
            url = f"http://127.0.0.1:{self.port}{self.ready_path}"
            self.proc.wait_http(url, timeout, self.headers)
        if self.precise:
            self._wait_precise(timeout)

    def _wait_precise(self, timeout: float) -> None:
        """Until ``/admin/workers`` says every worker is routed precisely: the gateway reads
        vLLM's cache settings from its first ``/metrics`` scrape (up to a second after start);
        before, its requests route approximately and would measure nothing of precise routing."""
        deadline, kv = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            url = f"http://127.0.0.1:{self.port}/admin/workers"
            with urllib.request.urlopen(url, timeout=5) as r:
                kv = [w.get("kv") or {} for w in json.load(r)["data"]]
            if kv and all(k.get("precise") for k in kv):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name}: workers not routed precisely: {kv}")

    def kv_routed(self) -> dict[str, float]:
        """``gpupool_kv_routed_requests_total`` by mode, from the gateway's metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        out: dict[str, float] = {}
        for line in lines:
            if line.startswith("gpupool_kv_routed_requests_total{"):
                labels, _, value = line.rpartition(" ")
                mode = labels.split('mode="', 1)[1].split('"', 1)[0]
                out[mode] = out.get(mode, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def _gpupool(
    name: str, upstream: int, tmp: Path, redis_url: str | None, source: Path | None = None,
    precise: bool = False, pair: bool = False,
) -> Target:  # fmt: skip
    """gpupool from this checkout, or (``source``) from another tree of it (``--baseline``).

    ``precise``: KV-event routing on (``routing.kv_events``): each worker names an events
    socket (nobody publishes on it: the upstream caches nothing) and the tiny model's tokenizer,
    and the upstream shows vLLM's ``cache_config_info``, so every chat request is rendered,
    tokenized, hashed and looked up in the (empty) index, as on a real pool. ``pair``: two
    workers a model in front of the same upstream."""
    port = free_port()
    queue: dict[str, object] = {"backend": "memory", "max_queued": 100_000}
    if redis_url:
        queue = {**queue, "backend": "redis", "redis_url": redis_url, "redis_prefix": "bench"}
    cfg = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "access_log": False,
            "state_dir": str(tmp / f"{name}-state"),
        },
        "models": [{"name": m} for m in MODELS],
        "workers": [
            {
                "name": f"up-{m}{suffix}",
                "model": m,
                "url": f"http://127.0.0.1:{upstream}",
                "max_inflight": 100_000,
            }
            for m in MODELS
            for suffix in (("-a", "-b") if pair else ("",))
        ],
        "queue": queue,
    }
    if precise:
        if not (KV_TOKENIZER / "tokenizer.json").exists():
            raise SystemExit(f"{name} needs the tiny model's tokenizer in {KV_TOKENIZER}")
        cfg["routing"] = {"kv_events": {"enabled": True}}
        for w in cfg["workers"]:  # type: ignore[attr-defined]
            w["kv_events"] = {"endpoint": f"ipc://{tmp}/{w['name']}.pub",
                              "tokenizer": str(KV_TOKENIZER)}  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [str(PY), "-m", "gpupool", "serve", "--config", str(path)]
    env, cwd = ({"PYTHONPATH": str(source)}, source) if source is not None else ({}, ROOT)
    # `python -m` puts the working directory first on sys.path: run the baseline from its tree
    proc = Proc(name, argv, GATEWAY_CPU, tmp / f"{name}.log", env=env, cwd=cwd)
    queue_note = "Redis queue backend" if redis_url else "memory queue backend"
    if precise:
        queue_note += ", KV-event routing on"
    return Target(
        name,
        port,
        metadata.version("gpupool") + ("" if source is None else f" @ {source.name}"),
        proc=proc,
        ready_path="/ready",
        note=f"1 process, uvloop + httptools, {queue_note}",
        precise=precise,
    )


def _naive(upstream: int, tmp: Path) -> Target:
    port = free_port()
    argv = [str(PY), str(Path(__file__).with_name("naive_proxy.py")), "--port", str(port),
            "--upstream", f"http://127.0.0.1:{upstream}"]  # fmt: skip
    proc = Proc("aiohttp-naive", argv, GATEWAY_CPU, tmp / "aiohttp-naive.log")
    note = "aiohttp server + client session, forwarding only (bench/naive_proxy.py)"
    return Target("aiohttp-naive", port, metadata.version("aiohttp"), proc=proc, note=note)


def _floor(name: str, upstream: int, tmp: Path) -> Target:
    port = free_port()
    argv = [str(PY), str(Path(__file__).with_name("floor_proxy.py")), "--port", str(port),
            "--upstream", f"127.0.0.1:{upstream}"]  # fmt: skip
    note = "uvloop + httptools callbacks both ways, forwarding only (bench/floor_proxy.py)"
    if name == "python-floor-task":
        argv.append("--task")
        note += "; each request in an asyncio task awaiting a future"
    proc = Proc(name, argv, GATEWAY_CPU, tmp / f"{name}.log")
    return Target(name, port, metadata.version("httptools"), proc=proc, note=note)


def _rust_router(
    name: str, upstream: int, tmp: Path, logs: Path, policy: str = "round_robin",
    pair: bool = False,
) -> Target:  # fmt: skip
    """vllm-router or sglang-router (``name`` may end in a variant: ``-x2``, ``-cache-x2``);
    ``pair``: the upstream twice, under two names (a router drops a repeated URL)."""
    package = "sglang-router" if name.startswith("sglang-router") else "vllm-router"
    exe = ensure_venv(package, package, package, logs / f"install-{package}.log")
    port = free_port()
    urls = [f"http://127.0.0.1:{upstream}"] + ([f"http://localhost:{upstream}"] if pair else [])
    argv = [str(exe)] + (["launch"] if package == "sglang-router" else [])
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn" if package == "sglang-router" else "warning",
    ]
    proc = Proc(name, argv, GATEWAY_CPU, tmp / f"{name}.log")
    return Target(
        name,
        port,
        pip_version(exe, package),
        proc=proc,
        note=f"Rust; {policy}; {len(urls)} worker(s); 1 core (its runtime sees one CPU)",
    )


def _litellm(upstream: int, tmp: Path, logs: Path) -> Target:
    exe = ensure_venv("litellm", "litellm[proxy]", "litellm", logs / "install-litellm.log")
    port = free_port()
    key = "sk-bench-" + secrets.token_hex(8)
    cfg = {
        "model_list": [
            {
                "model_name": m,
                "litellm_params": {
                    "model": f"openai/{m}",
                    "api_key": "none",
                    "api_base": f"http://127.0.0.1:{upstream}/v1",
                },
            }
            for m in MODELS
        ],
        "general_settings": {"master_key": key},
        "litellm_settings": {"telemetry": False},
    }
    path = tmp / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [
        str(exe),
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        "1",
    ]
    env = {
        "LITELLM_MASTER_KEY": key,
        "LITELLM_LOG": "ERROR",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    proc = Proc("litellm", argv, GATEWAY_CPU, tmp / "litellm.log", env=env, cwd=tmp)
    return Target(
        "litellm",
        port,
        pip_version(exe, "litellm"),
        {"authorization": f"Bearer {key}"},
        proc,
        "/health/liveliness",
        "Python; 1 uvicorn worker; master key; no database",
    )


def baseline_tree(rev: str, tmp: Path) -> Path:
    """This repository at ``rev``, unpacked into ``tmp`` (run with PYTHONPATH pointing at it)."""
    root = ROOT
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    dest = tmp / f"gpupool-{sha}"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", sha], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def build(
    names: list[str],
    upstream: int,
    tmp: Path,
    logs: Path,
    redis_url: str | None,
    baseline: Path | None = None,
) -> list[Target]:
    """``gpupool-base`` is gpupool run from ``baseline`` (a tree of another commit)."""
    if "gpupool-base" in names and baseline is None:
        raise SystemExit("gpupool-base needs --baseline REV")
    makers: dict[str, Callable[[], Target]] = {
        "direct": lambda: Target("direct", upstream,
                                 note="the upstream itself: the physical limit"),
        "gpupool": lambda: _gpupool("gpupool", upstream, tmp, None),
        "gpupool-precise": lambda: _gpupool("gpupool-precise", upstream, tmp, None, None, True),
        "gpupool-base": lambda: _gpupool("gpupool-base", upstream, tmp, None, baseline),
        "gpupool-redis": lambda: _gpupool("gpupool-redis", upstream, tmp, redis_url),
        "aiohttp-naive": lambda: _naive(upstream, tmp),
        "python-floor": lambda: _floor("python-floor", upstream, tmp),
        "python-floor-task": lambda: _floor("python-floor-task", upstream, tmp),
        "vllm-router": lambda: _rust_router("vllm-router", upstream, tmp, logs),
        "sglang-router": lambda: _rust_router("sglang-router", upstream, tmp, logs),
        "litellm": lambda: _litellm(upstream, tmp, logs),
        "gpupool-x2": lambda: _gpupool("gpupool-x2", upstream, tmp, None, pair=True),
        "gpupool-precise-x2": lambda: _gpupool("gpupool-precise-x2", upstream, tmp, None,
                                               None, True, pair=True),
        "vllm-router-x2": lambda: _rust_router("vllm-router-x2", upstream, tmp, logs,
                                               pair=True),
        "vllm-router-cache-x2": lambda: _rust_router("vllm-router-cache-x2", upstream, tmp,
                                                     logs, "cache_aware", pair=True),
    }  # fmt: skip
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown target {unknown[0]!r} (known: {', '.join(ALL)})")
    return [makers[name]() for name in names]
