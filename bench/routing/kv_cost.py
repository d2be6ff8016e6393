"""What precise prefix routing adds to a request: ``KvRouting.predict`` (render the chat template,
tokenize, hash the blocks, on its thread pool unless the prompt is short, look up each worker's
index), in process.

    .venv/bin/python bench/routing/kv_cost.py [--workers 2] [--n 200]

Prints the median and p90 per request for a short chat, a 1.5K- and a 6K-token shared system
prompt (each with a different question every time), with the tiny models' tokenizer and the
routing bench's chat template (``make_model.CHAT_TEMPLATE``: the tiny model's own reads content
parts, so vLLM hands it lists, and it cannot add a system message's list to a string).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from make_model import CHAT_TEMPLATE

from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.routing.policy import RouteRequest
from gpupool.workers.kvevents.pool import KvPool
from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.probe import CacheInfo
from gpupool.workers.registry import Worker, WorkerState

ROOT = Path(__file__).resolve().parents[2]


def with_template(model_dir: str, d: str) -> str:
    """A copy of ``model_dir``'s tokenizer files under ``d`` with the routing bench's template."""
    out = Path(d) / "model"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, out / name)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(out)


async def measure(workers: int, n: int, model_dir: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        model_dir = with_template(model_dir, d)
        pool = KvPool()
        ws = []
        for i in range(workers):
            w = Worker(f"w{i}", "m", url="http://x", state=WorkerState.ready,
                       kv_source=KvSource(f"ipc://{d}/w{i}", None, "", "0"))  # fmt: skip
            w.cache_info = CacheInfo(128, "sha256", True, 10_000, False)
            pool.watch(w)
            ws.append(w)
        kv = KvRouting(pool, {"m": model_dir})
        try:
            for label, words in (("short chat", 20), ("1.5K system", 600), ("6K system", 2400)):
                system = " ".join(["alpha", "beta", "gamma", "delta"] * (words // 4))
                took = []
                for i in range(n):
                    question = {"role": "user", "content": f"question {i}?"}
                    body = {"messages": [{"role": "system", "content": system}, question]}
                    t = time.perf_counter()
                    r = await kv.predict(RouteRequest("m", 0, False), "/v1/chat/completions",
                                         body, None, ws)  # fmt: skip
                    took.append(time.perf_counter() - t)
                    assert r.kv is not None
                ms = sorted(x * 1000 for x in took[n // 4 :])  # after the first requests' checks
                print(f"{label:12} {r.kv.tokens:5} tokens: median {statistics.median(ms):.3f} ms,"
                      f" p90 {ms[int(len(ms) * 0.9)]:.3f} ms")  # fmt: skip
        finally:
            kv.close()
            await pool.aclose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "qwen3-dense"))
    args = ap.parse_args()
    asyncio.run(measure(args.workers, args.n, args.model_dir))


if __name__ == "__main__":
    main()
