"""Precise prefix routing's predictions against vLLM's own report, on real vLLM (CPU) workers.

    .venv/bin/python bench/routing/kv_predict.py [--workers 3] [--requests 90] [--blocks 48]
        [--mode precise|approximate|both]

Starts ``gpupool serve`` with N launched workers of the tiny dense model (prefix caching on,
``--enable-prompt-tokens-details``, each KV cache ``--blocks`` blocks of 128 tokens: less than the
tenants' prefixes together), ``routing.kv_events.enabled``, then sends a mixed multi-tenant
workload (tenants with long prefixes, half of them with a ``cache_salt``, chat and completions,
two at a time) and prints how gpupool's predicted cached tokens compared with vLLM's reported
``prompt_tokens_details.cached_tokens`` (``gpupool_kv_predictions_total``), and where not equal,
the requests' numbers (the gateway's log line for each miss: predicted, of which placed by a
request just before and not stored yet, reported). ``--mode both`` runs the workload a second
time on fresh workers with today's approximate affinity (``kv_events`` off) and prints, for
each, the share of prompt tokens vLLM found cached and the requests' latency. Needs the vLLM
venv and tiny models (``tests/vllm/README.md``); run it under ``flock /tmp/gpupool-heavy.lock``
on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]  # fmt: skip


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(n: int, blocks: int, tmp: Path, port: int, precise: bool) -> dict[str, Any]:
    py = os.environ.get("GPUPOOL_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python"))
    model = str(Path(os.environ.get("GPUPOOL_TINY_MODELS", ROOT / ".models")) / "qwen3-dense")
    worker = {
        "model": "tiny",
        "launch": {
            "model_path": model,
            "command": [py, "-m", "vllm.entrypoints.openai.api_server", "--model", "{model_path}"],
            "args": {
                "dtype": "bfloat16",
                "max-model-len": 2048,
                "max-num-seqs": 4,
                "max-num-batched-tokens": 2048,
                "enable-prompt-tokens-details": True,
                "num-gpu-blocks-override": blocks,
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 400,
        },
    }
    return {
        "server": {"port": port, "state_dir": str(tmp / "state")},
        "models": [{"name": "tiny"}],
        "workers": [{"name": f"w{i + 1}", **worker} for i in range(n)],
        "routing": {"kv_events": {"enabled": precise}},
    }


def _wait_precise(url: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = httpx.get(url + "/admin/workers", timeout=5).json()["data"]
            if len(data) == n and all(
                w["state"] == "ready" and (w.get("kv") or {"precise": True})["precise"]
                for w in data
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("workers not precise in time")


def _outcomes(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(
        r'^gpupool_kv_predictions_total\{.*outcome="(\w+)".*\} (\S+)$', text, re.M
    ):
        out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def _workload(url: str, requests: int, tenants: int, seed: int) -> list[tuple[int, int, float]]:
    """``(prompt_tokens, cached_tokens, seconds)`` per request."""
    rng = random.Random(seed)
    prefixes = [(" ".join(rng.choice(WORDS) for _ in range(600)), f"t{i}" if i % 2 else None)
                for i in range(tenants)]  # fmt: skip

    def one(i: int) -> tuple[int, int, float]:
        prefix, salt = prefixes[rng.randrange(tenants)]
        question = f"question {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
        if salt:
            body["cache_salt"] = salt
        if i % 4 == 3:
            body["prompt"] = prefix + " " + question
            path = "/v1/completions"
        else:
            body["messages"] = [{"role": "user", "content": prefix + "\n" + question}]
            path = "/v1/chat/completions"
        t = time.perf_counter()
        r = httpx.post(url + path, json=body, timeout=300)
        took = time.perf_counter() - t
        r.raise_for_status()
        usage = r.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], took

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(requests)))


def run(args: argparse.Namespace, precise: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp, port = Path(d), _port()
        cfg = tmp / "gpupool.yaml"
        cfg.write_text(yaml.safe_dump(_config(args.workers, args.blocks, tmp, port, precise)))
        log = (tmp / "gateway.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        gw = subprocess.Popen([sys.executable, "-m", "gpupool", "serve", "--config", str(cfg)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_precise(url, args.workers, 600)
            done = _workload(url, args.requests, args.tenants, args.seed)
            outcomes = _outcomes(url)
        finally:
            gw.terminate()
            gw.wait(60)
        misses = [ln for ln in (tmp / "gateway.log").read_text(errors="replace").splitlines()
                  if "kv prediction for" in ln]  # fmt: skip
    total = sum(outcomes.values())
    secs = sorted(s for _, _, s in done)
    return {"mode": "precise" if precise else "approximate", "workers": args.workers,
            "requests": args.requests, "blocks": args.blocks, "outcomes": outcomes,
            "exact_share": round(outcomes.get("exact", 0) / total, 4) if total else None,
            "requests_with_hits": sum(1 for _, c, _ in done if c),
            "cached_share": round(sum(c for _, c, _ in done) / sum(p for p, _, _ in done), 4),
            "latency_p50_s": round(secs[len(secs) // 2], 3),
            "latency_p90_s": round(secs[int(len(secs) * 0.9)], 3),
            "misses": misses}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--requests", type=int, default=90)
    ap.add_argument("--tenants", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--mode", choices=("precise", "approximate", "both"), default="precise")
    args = ap.parse_args()
    modes = {"precise": [True], "approximate": [False], "both": [True, False]}[args.mode]
    for precise in modes:
        print(json.dumps(run(args, precise), indent=2), flush=True)


if __name__ == "__main__":
    main()
