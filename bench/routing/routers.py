"""The routers under test, all in front of the same vLLM workers: gpupool and the peers' policies.

gpupool gets the workers as ``url:`` workers with ``max_inflight`` equal to vLLM's
``--max-num-seqs`` and ``routing.prefill_gate_tokens`` equal to their
``--max-num-batched-tokens`` (what the operator of ``url:`` workers sets from their flags).
The peers are the Rust routers from PyPI (``bench/.venvs/``, installed on first use as
``make bench`` does), one process per policy: vllm-router ``cache_aware``, ``consistent_hash``
and ``round_robin``, and sglang-router ``cache_aware``. Their circuit breakers are off: they
count vLLM's context-length 400s as worker failures, so one workload's errors would take both
workers out of the next one.
``gpupool@REV`` runs another revision's routing (``git archive``) beside the current one, to
measure what a policy change bought.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml
from pool import SERVED, Worker
from rig import PY, ROOT, Proc, ensure_venv, free_port, pip_version

PEER_SPECS = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2"}
ALL = (
    "gpupool",
    "vllm-router:cache_aware",
    "vllm-router:consistent_hash",
    "vllm-router:round_robin",
    "sglang-router:cache_aware",
)


@dataclass
class Router:
    name: str
    port: int
    proc: Proc
    version: str
    ready_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _gpupool(workers: list[Worker], tmp: Path, cpus: str, base: Path | None = None) -> Router:
    """``base``: a directory holding another revision's ``gpupool/`` package to run instead."""
    name = "gpupool" if base is None else f"gpupool@{base.name}"
    port = free_port()
    cfg = {
        "server": {"host": "127.0.0.1", "port": port, "access_log": False,
                   "state_dir": str(tmp / f"{name}-state")},
        "models": [{"name": SERVED}],
        "workers": [
            {"name": w.name, "model": SERVED, "url": w.url, "max_inflight": w.spec.max_num_seqs}
            for w in workers
        ],
        "queue": {"max_queued": 10_000, "max_wait_s": 600},
    }  # fmt: skip
    models_py = (base or ROOT) / "gpupool" / "config" / "models.py"
    if "prefill_gate_tokens" in models_py.read_text():  # as it would read it off vLLM's flags
        cfg["routing"] = {"prefill_gate_tokens": min(w.spec.batched_tokens for w in workers)}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [str(PY), "-m", "gpupool", "serve", "--config", str(path)]
    # `python -m` looks in its working directory first: run the other revision from its own.
    proc = Proc(name, argv, cpus, tmp / f"{name}.log", cwd=base or ROOT)  # type: ignore[arg-type]
    return Router(name, port, proc, metadata.version("gpupool"), "/ready")


def _peer(name: str, workers: list[Worker], tmp: Path, logs: Path, cpus: str) -> Router:
    binary, policy = name.split(":")
    exe = ensure_venv(binary, PEER_SPECS[binary], binary, logs / f"install-{binary}.log")
    port = free_port()
    argv = [str(exe)] + (["launch"] if binary == "sglang-router" else [])
    argv += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls",
             *[w.url for w in workers], "--policy", policy,
             "--prometheus-port", str(free_port()), "--disable-circuit-breaker",
             "--log-level", "warn" if binary == "sglang-router" else "warning"]  # fmt: skip
    log = tmp / f"{name.replace(':', '-')}.log"
    proc = Proc(name, argv, cpus, log)  # type: ignore[arg-type]
    return Router(name, port, proc, pip_version(exe, binary), "/health")


def baseline(rev: str, tmp: Path) -> Path:
    """Another revision's ``gpupool/`` package in ``tmp/<rev>`` (router ``gpupool@rev``)."""
    out = tmp / rev
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "gpupool"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def build(
    names: list[str], workers: list[Worker], tmp: Path, logs: Path, cpus: str
) -> list[Router]:
    out = []
    for name in names:
        if name == "gpupool":
            out.append(_gpupool(workers, tmp, cpus))
        elif name.startswith("gpupool@"):
            out.append(_gpupool(workers, tmp, cpus, baseline(name.split("@", 1)[1], tmp)))
        elif name.split(":")[0] in PEER_SPECS:
            out.append(_peer(name, workers, tmp, logs, cpus))
        else:
            raise SystemExit(f"unknown router {name!r} (known: {', '.join(ALL)})")
    return out
