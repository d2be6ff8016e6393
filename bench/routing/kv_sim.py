"""An llm-d-shaped workload on simulated GPU workers: precise prefix routing (KV events) beside
gpupool's approximate affinity, the same simulators behind each.

    .venv/bin/python bench/routing/kv_sim.py [--tenants 12] [--seconds 20] [--clients 24]

Many tenants, each with a long shared system prompt and short questions; the prefixes together
are larger than one worker's prefix cache (``--blocks`` of 16 tokens each) but fit the pool;
``--clients`` streaming clients keep the two workers near saturation, each request from a
tenant picked at random. For each mode, a fresh pool (``bench/throughput.py``'s simulators,
``--gpu``, prefill cost ``--prefill-ms-per-1k``): time to the first streamed byte (p50, p90),
requests completed, and the prefix-cache hit rate the simulators count
(``vllm:prefix_cache_hits`` / ``queries``). Simulated time: the ranking of the modes is the
point, not the figures. The simulators hash prompts with the tiny model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench import throughput as tput

DENSE = tput.ROOT / ".models" / "qwen3-dense"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon"]  # fmt: skip


@dataclass(frozen=True)
class CacheShape(tput.Shape):
    num_gpu_blocks: int = 600
    prefill_ms_per_1k: float = 60.0

    def sim_args(self) -> list[str]:
        return [*super().sim_args(), "--num-gpu-blocks-override", str(self.num_gpu_blocks)]


async def _one(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    """Seconds to the first streamed byte."""
    t = time.perf_counter()
    first = 0.0
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_raw():
            first = first or time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}")
    return first


async def _counts(http: httpx.AsyncClient, direct: dict[str, str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in direct.values():
        text = (await http.get(url + "/metrics")).text
        for name, value in re.findall(r"^vllm:prefix_cache_(hits|queries)_total\{.*\} (\S+)$",
                                      text, re.M):  # fmt: skip
            if name == "hits":
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


async def _run(pool: tput.Pool, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words))
                for _ in range(args.tenants)]  # fmt: skip
    ttft: list[float] = []
    stop = time.monotonic() + args.seconds
    async with tput.http_client() as http:
        h0, q0 = await _counts(http, pool.direct)

        async def client(k: int) -> None:
            crng = random.Random(args.seed * 1000 + k)
            while time.monotonic() < stop:
                system = prefixes[crng.randrange(args.tenants)]
                question = " ".join(crng.choice(WORDS) for _ in range(12))
                messages = [{"role": "system", "content": system},
                            {"role": "user", "content": question}]  # fmt: skip
                body = {"model": tput.MODEL, "stream": True, "max_tokens": 16,
                        "messages": messages}  # fmt: skip
                ttft.append(await _one(http, pool.gateway, body))

        await asyncio.gather(*(client(k) for k in range(args.clients)))
        h1, q1 = await _counts(http, pool.direct)
    ttft.sort()
    return {"completed": len(ttft), "ttft_p50_s": round(ttft[len(ttft) // 2], 3),
            "ttft_p90_s": round(ttft[int(len(ttft) * 0.9)], 3),
            "hit_rate": round((h1 - h0) / (q1 - q0), 3) if q1 > q0 else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--prefix-words", type=int, default=500)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--blocks", type=int, default=600)
    ap.add_argument("--prefill-ms-per-1k", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=34)
    lead = "routing.kv_events.max_lead (precise) and affinity_max_lead (both)"
    ap.add_argument("--max-lead", type=float, default=0.0, help=lead)
    args = ap.parse_args()
    shape = CacheShape(num_gpu_blocks=args.blocks, prefill_ms_per_1k=args.prefill_ms_per_1k)
    out = {}
    for mode, kv in (("precise", DENSE), ("approximate", None)):
        routing = {"kv_events": {"max_lead": args.max_lead}, "affinity_max_lead": args.max_lead}
        with tput.pool(shape, kv=kv, routing=routing) as pool:
            out[mode] = asyncio.run(_run(pool, args))
        print(mode, json.dumps(out[mode]), flush=True)


if __name__ == "__main__":
    main()
