"""Through real vLLM (CPU build, tiny model): tokens/s and TTFT with and without gpupool.

    .venv/bin/python bench/real_vllm.py [--quick] [--json out.json] [--vllm-url URL]

Starts one vLLM worker on CPU0 (the same flags as tests/vllm/conftest.py, so its compile cache is
warm) and ``gpupool serve`` on CPU1 with it as a ``url:`` worker. The client (on CPU0 with vLLM,
as in the rest of the bench) runs rounds alternating direct / gateway / gateway / direct, each
with ``lanes`` streams at a time (vLLM's max-num-seqs), ``ignore_eos`` and a fixed
``max_tokens``, so every request produces the same number of tokens. Needs .venv-vllm and
.models (``make models``); without them it reports why and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml
from rig import GATEWAY_CPU, PY, RIG_CPU, ROOT, Proc, free_port, pin_self

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_DIR = ROOT / ".models" / "qwen3-dense"
MODEL = "tiny"


def vllm_proc(port: int, tmp: Path) -> Proc:
    argv = [
        str(VLLM_PY),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        MODEL,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "2048",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    return Proc("vllm", argv, RIG_CPU, tmp / "vllm.log", env=env)


def gateway_proc(vllm_url: str, tmp: Path) -> tuple[Proc, int]:
    port = free_port()
    cfg = {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "access_log": False,
            "state_dir": str(tmp / "gw-state"),
        },
        "models": [{"name": MODEL}],
        "workers": [{"name": "vllm", "model": MODEL, "url": vllm_url, "max_inflight": 64}],
    }
    path = tmp / "gpupool-vllm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [str(PY), "-m", "gpupool", "serve", "--config", str(path)]
    return Proc("gpupool", argv, GATEWAY_CPU, tmp / "gpupool-vllm.log"), port


async def one(session: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT s, completion tokens) of one streamed request."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    t0 = time.perf_counter()
    ttft, tokens = float("nan"), 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            obj = orjson.loads(line[6:])
            choices = obj.get("choices") or []
            if ttft != ttft and choices and choices[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                tokens = int(obj["usage"]["completion_tokens"])
    return ttft, tokens


async def round_(url: str, lanes: int, per_lane: int, max_tokens: int) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        ttfts: list[float] = []
        tokens = 0

        async def lane() -> None:
            nonlocal tokens
            for _ in range(per_lane):
                ttft, n = await one(session, url, max_tokens)
                ttfts.append(ttft)
                tokens += n

        await asyncio.gather(*(lane() for _ in range(lanes)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "ttfts": ttfts}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


async def measure(
    direct: str, gateway: str, rounds: int, per_lane: int, max_tokens: int, lanes: int = 4
) -> dict[str, Any]:
    for url in (direct, gateway):  # warm both paths
        await round_(url, lanes, 1, 8)
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    for r in range(rounds):
        order = ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct")
        for path in order:
            runs[path].append(
                await round_(direct if path == "direct" else gateway, lanes, per_lane, max_tokens)
            )
        d, g = runs["direct"][-1], runs["gateway"][-1]
        print(
            f"    round {r + 1}: direct {d['tokens'] / d['seconds']:.1f} tok/s, "
            f"gateway {g['tokens'] / g['seconds']:.1f} tok/s",
            flush=True,
        )
    out: dict[str, Any] = {}
    for path, rs in runs.items():
        ttfts = [t for r in rs for t in r["ttfts"]]
        out[path] = {
            "tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs),
            "ttft_p50_ms": _pct(ttfts, 50) * 1e3,
            "ttft_p99_ms": _pct(ttfts, 99) * 1e3,
            "requests": len(ttfts),
            "round_tokens_per_s": [r["tokens"] / r["seconds"] for r in rs],
        }
    out["tokens_ratio"] = out["gateway"]["tokens_per_s"] / out["direct"]["tokens_per_s"]
    ratios = [
        g / d
        for g, d in zip(
            out["gateway"]["round_tokens_per_s"], out["direct"]["round_tokens_per_s"], strict=False
        )
    ]
    out["round_ratio_median"] = statistics.median(ratios)
    out["describe"] = (
        f"vLLM (CPU) serving {MODEL_DIR.name} on CPU0, gpupool on CPU1; {rounds} interleaved "
        f"rounds per path, each {lanes} concurrent streams x {per_lane} requests of "
        f"{max_tokens} tokens (ignore_eos). Median of per-round ratios: "
        f"{out['round_ratio_median']:.1%}."
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="Write the results here.")
    p.add_argument("--vllm-url", default=None, help="Use a running vLLM serving `tiny`.")
    args = p.parse_args()
    pin_self(RIG_CPU)
    rounds, per_lane, max_tokens = (3, 2, 64) if args.quick else (8, 4, 128)
    if args.vllm_url is None and not (VLLM_PY.exists() and (MODEL_DIR / "config.json").exists()):
        res: dict[str, Any] = {"error": "real vLLM not set up (run `make models`)"}
        print(f"  {res['error']}", flush=True)
    else:
        res = run(args.vllm_url, rounds, per_lane, max_tokens)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


def run(vllm_url: str | None, rounds: int, per_lane: int, max_tokens: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-bench-vllm-"))
    procs: list[Proc] = []
    try:
        if vllm_url is None:
            port = free_port()
            procs.append(vllm_proc(port, tmp).start())
            vllm_url = f"http://127.0.0.1:{port}"
            print(f"  starting vLLM (logs {tmp}) ...", flush=True)
            t0 = time.monotonic()
            procs[0].wait_http(vllm_url + "/health", 600)
            print(f"  vLLM ready after {time.monotonic() - t0:.0f} s", flush=True)
        gw, gw_port = gateway_proc(vllm_url, tmp)
        procs.append(gw.start())
        gw.wait_http(f"http://127.0.0.1:{gw_port}/ready", 120)
        return asyncio.run(
            measure(vllm_url, f"http://127.0.0.1:{gw_port}", rounds, per_lane, max_tokens)
        )
    except (RuntimeError, TimeoutError, aiohttp.ClientError) as e:
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
