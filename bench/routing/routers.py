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
measure what a policy change bought. ``gpupool`` is today's approximate prefix affinity;
``gpupool:precise`` routes on the workers' KV-cache events (``routing.kv_events``; the workers
publish them when it is among the routers), ``gpupool:precise:LEAD`` with ``max_lead`` LEAD.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml
from pool import HASH_SEED, SERVED, Worker
from rig import PY, ROOT, Proc, ensure_venv, free_port, pip_version

PEER_SPECS = {"vllm-router": "vllm-router==0.1.17", "sglang-router": "sglang-router==0.3.2"}
ALL = (
    "gpupool",
    "gpupool:precise",
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


def _gpupool(workers: list[Worker], tmp: Path, cpus: str, base: Path | None = None,
             precise: str | None = None, model_dir: Path | None = None) -> Router:  # fmt: skip
    """``base``: a directory holding another revision's ``gpupool/`` package to run instead;
    ``precise``: route on KV-cache events, with this ``max_lead`` ("": the default)."""
    name = "gpupool" if base is None else f"gpupool@{base.name}"
    if precise is not None:
        name += ":precise" + (f":{precise}" if precise else "")
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
    if precise is not None:
        kv: dict[str, object] = {"enabled": True}
        if precise:
            kv["max_lead"] = float(precise)
        cfg.setdefault("routing", {})["kv_events"] = kv
        for wc, w in zip(cfg["workers"], workers, strict=True):
            if w.events is None:
                raise SystemExit(f"worker {w.name} publishes no KV-cache events")
            wc["kv_events"] = {"endpoint": w.events[0], "replay_endpoint": w.events[1],
                               "hash_seed": HASH_SEED, "tokenizer": str(model_dir)}  # fmt: skip
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


def wants_events(names: list[str]) -> bool:
    return any(n.startswith("gpupool") and ":precise" in n for n in names)


def build(
    names: list[str], workers: list[Worker], tmp: Path, logs: Path, cpus: str, model_dir: Path
) -> list[Router]:
    out = []
    for name in names:
        head, _, precise = name.partition(":precise")
        lead = precise.removeprefix(":") if name != head else None
        if head == "gpupool":
            out.append(_gpupool(workers, tmp, cpus, None, lead, model_dir))
        elif head.startswith("gpupool@"):
            base = baseline(head.split("@", 1)[1], tmp)
            out.append(_gpupool(workers, tmp, cpus, base, lead, model_dir))
        elif name.split(":")[0] in PEER_SPECS:
            out.append(_peer(name, workers, tmp, logs, cpus))
        else:
            raise SystemExit(f"unknown router {name!r} (known: {', '.join(ALL)})")
    return out
