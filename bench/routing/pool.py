"""The vLLM workers of the routing bench: started once, shared by every router in turn.

Each worker is a real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``, the CPU
build here) on its own CPUs, serving the same random-weight model (``--load-format dummy``) with
prefix caching on and ``VLLM_SERVER_DEV_MODE=1`` so that ``POST /reset_prefix_cache`` empties its
cache between routers. Workers differ only in their window (``--max-model-len``): one long, one
short, for the mixed-context workload.

On a GPU machine (the GPU lane) a worker names its GPUs and its share of their memory
(``gpus``, ``gpu_memory``): it runs with ``CUDA_VISIBLE_DEVICES`` and
``--gpu-memory-utilization``, in the model's own dtype, and workers sharing a GPU start one after
the other (the second one's memory profile must see the first's allocation).
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rig import ROOT, Proc, free_port, http_ok

# The GPU lane runs the bundle's vLLM with the machine's python3 (GPUPOOL_BENCH_VLLM_PYTHON)
VLLM_PY = Path(
    os.environ.get("GPUPOOL_BENCH_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python"
)
SERVED = "bench"


@dataclass
class WorkerSpec:
    name: str
    window: int
    cpus: str  # for taskset and VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-7"
    max_num_seqs: int
    batched_tokens: int
    extra_args: list[str] = field(default_factory=list)
    gpus: str = ""  # CUDA_VISIBLE_DEVICES, e.g. "0"; empty: the CPU build
    gpu_memory: float = 0.0  # --gpu-memory-utilization
    kv_events: bool = False  # publish KV-cache events (for gpupool:precise)


@dataclass
class Worker:
    spec: WorkerSpec
    port: int
    proc: Proc | None  # None: attached to a worker started elsewhere

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return self.spec.name

    events: tuple[str, str] | None = None  # its KV-cache events' PUB and replay endpoints


def cpu_dtype() -> str:
    """bfloat16 where the CPU computes it (AVX-512 BF16 or AMX), else float32: without them
    PyTorch emulates bfloat16 matmuls some 200 times slower than float32 (measured on an AVX2
    EPYC: 0.25 against 54 GFLOPS), which would make every prefill in the bench a crawl."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & set(flags) else "float32"


HASH_SEED = "0"  # PYTHONHASHSEED of every worker publishing events (the gateway must know it)


def events_config(spec: WorkerSpec, tmp: Path) -> tuple[list[str], tuple[str, str]]:
    """``--kv-events-config`` on Unix sockets under ``tmp`` (vLLM's ZMQ publisher, as gpupool
    gives launched workers), and the endpoints to subscribe to."""
    pub, replay = f"ipc://{tmp}/{spec.name}.pub", f"ipc://{tmp}/{spec.name}.replay"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
           "replay_endpoint": replay}  # fmt: skip
    return ["--kv-events-config", json.dumps(cfg)], (pub, replay)


def _argv(spec: WorkerSpec, model_dir: Path, port: int) -> list[str]:
    device = (["--gpu-memory-utilization", str(spec.gpu_memory)] if spec.gpus
              else ["--dtype", cpu_dtype()])  # fmt: skip
    return [
        str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port),
        "--load-format", "dummy", *device,
        "--max-model-len", str(spec.window),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--max-num-batched-tokens", str(spec.batched_tokens),
        "--enable-prefix-caching",
        *spec.extra_args,
    ]  # fmt: skip


def start(specs: list[WorkerSpec], model_dir: Path, tmp: Path, kv_gib: int,
          attach: dict[str, int]) -> list[Worker]:  # fmt: skip
    """Start each worker, or use the one already on ``attach[name]``'s port. A GPU worker on the
    same GPUs as an earlier one of ``specs`` (the same ``gpus``) starts once that one is ready."""
    out: list[Worker] = []
    for spec in specs:
        events = None
        if spec.kv_events:
            flags, events = events_config(spec, tmp)
            spec.extra_args = [*spec.extra_args, *flags]
        if spec.name in attach:
            out.append(Worker(spec, attach[spec.name], None, events))
            continue
        port = free_port()
        env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": HASH_SEED}
        if spec.gpus:
            env["CUDA_VISIBLE_DEVICES"] = spec.gpus
            for earlier in out:
                if earlier.spec.gpus == spec.gpus:
                    wait(earlier, 900)
        else:
            env |= {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": spec.cpus}
        cpu = spec.cpus  # Proc pins with taskset -c
        proc = Proc(f"vllm-{spec.name}", _argv(spec, model_dir, port), cpu,  # type: ignore[arg-type]
                    tmp / f"vllm-{spec.name}.log", env=env)  # fmt: skip
        out.append(Worker(spec, port, proc.start(), events))
    return out


_KV_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens")


def kv_tokens(w: Worker) -> int | None:
    """The KV cache the worker allocated, in tokens, as its start-up log says (None: attached)."""
    if w.proc is None:
        return None
    found = _KV_TOKENS.findall(w.proc.tail(2_000_000))
    return int(found[-1].replace(",", "")) if found else None


def wait(w: Worker, timeout: float) -> None:
    if w.proc is not None:
        w.proc.wait_http(w.url + "/health", timeout)
    elif not http_ok(w.url + "/health", timeout=10):
        raise RuntimeError(f"no worker answers on {w.url}")


def _post(url: str, body: bytes = b"", timeout: float = 30) -> bytes:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return bytes(r.read())


def reset_prefix_cache(workers: list[Worker]) -> None:
    for w in workers:
        _post(w.url + "/reset_prefix_cache")


_METRIC = re.compile(rb"^(vllm:[a-z_:]+?)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def metrics(w: Worker) -> dict[str, float]:
    """The worker's counters and gauges, summed over labels."""
    with urllib.request.urlopen(w.url + "/metrics", timeout=30) as r:
        text = r.read()
    out: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        key = name.decode()
        out[key] = out.get(key, 0.0) + float(value)
    return out


def snapshot(workers: list[Worker]) -> dict[str, dict[str, float]]:
    return {w.name: metrics(w) for w in workers}


def delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], key: str
) -> dict[str, float]:
    return {n: after[n].get(key, 0.0) - before[n].get(key, 0.0) for n in after}
