"""A stand-in for vLLM's API server in the lane's CPU rehearsal: takes vLLM's flags, logs the
lines the check reads (KV cache, torch.compile, cache loads), then serves `gpupool sim`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--served-model-name", "--max-model-len"):
        p.add_argument(flag)
    p.add_argument("--max-num-seqs", default="128")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enable-sleep-mode", action="store_true")
    args, _ = p.parse_known_args()
    cache = Path(os.environ.get("VLLM_CACHE_ROOT", "/tmp/fake-vllm-cache")) / "torch_compile_cache"
    warm = (cache / "graph.bin").exists()
    time.sleep(float(os.environ.get("FAKE_VLLM_START_S", "3")))
    tokens = int(args.gpu_memory_utilization * 800_000)
    print(f"INFO Model loading took 15.26 GiB memory and {1.5:.1f} seconds", flush=True)
    if warm:
        print(
            "INFO Directly load the compiled graph(s) for compile range from the cache, took 2.1 s"
        )
        print("INFO torch.compile takes 4.2 s in total")
    else:
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "graph.bin").write_bytes(b"x" * 1000)
        print("INFO torch.compile takes 31.0 s in total")
    print(f"INFO Available KV cache memory: {args.gpu_memory_utilization * 100:.2f} GiB")
    print(f"INFO GPU KV cache size: {tokens:,} tokens")
    print(f"INFO Maximum concurrency for {args.max_model_len} tokens per request: 10.86x")
    print("INFO init engine (profile, create kv cache, warmup model) took 45.1 seconds", flush=True)
    from gpupool.workers.sim.cli import sim

    sys.argv = [
        "sim",
        "--host",
        args.host,
        "--port",
        args.port,
        "--served-model-name",
        args.served_model_name,
        "--max-model-len",
        args.max_model_len,
        "--max-num-seqs",
        args.max_num_seqs,
        "--ttft-ms",
        "20",
        "--itl-ms",
        "2",
        "--output-tokens",
        "100000",
    ]
    if args.enable_sleep_mode:  # issue 28: the sim's sleep routes on a shared-GPU ledger
        ledger = os.environ.get("FAKE_VLLM_LEDGER", "/tmp/fake-vllm-gpu0-ledger.json")
        sys.argv += ["--enable-sleep-mode", "--gpu-memory-utilization",
                     str(args.gpu_memory_utilization), "--sleep-ledger", ledger,
                     "--sleep-s", "0.8", "--wake-s", "0.6", "--reload-s", "2.0",
                     "--weights-gib", "15.3"]  # fmt: skip
    sim.main(standalone_mode=True)


if __name__ == "__main__":
    main()
