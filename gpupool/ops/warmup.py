"""Warm up a ``url:`` worker once, from outside: ``python -m gpupool.ops.warmup``.

gpupool warms the workers it launches itself. When vLLM runs elsewhere (docker/compose.yaml
runs it in its own containers) this sends the same warm-up requests, from the worker's
``warmup:`` list in the gateway configuration, as a one-shot job: wait for ``/health``, send every
item, exit 0 when all succeeded. Compose starts the small card's container only after this job
has succeeded on the big card, which is seed 000's fix: the Triton autotuner runs (and caches
its results in the shared ``TRITON_CACHE_DIR``) on the 96 GB card, never on the 32 GB one.

    python -m gpupool.ops.warmup --config /etc/gpupool/gpupool.yaml --worker vllm-big
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aiohttp

from gpupool.config import ConfigError, GpupoolConfig, load_config
from gpupool.config.models import WorkerConfig
from gpupool.workers.supervisor.warmup import health_ok, send_warmup


class WarmupError(Exception):
    """The worker never became healthy, or a warm-up request failed."""


def worker_config(cfg: GpupoolConfig, name: str) -> WorkerConfig:
    for wc in cfg.workers:
        if wc.name == name:
            return wc
    known = ", ".join(wc.name for wc in cfg.workers)
    raise WarmupError(f"no worker named `{name}` (known: {known})")


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await health_ok(session, url, 5.0):
        if time.monotonic() > deadline:
            raise WarmupError(f"{url}/health did not answer 200 within {timeout_s:g} s")
        await asyncio.sleep(2.0)


async def warm_up(wc: WorkerConfig, url: str, wait_s: float, request_s: float) -> int:
    """Wait for ``url`` to be healthy, then send ``wc.warmup``; the number of items sent."""
    async with aiohttp.ClientSession() as session:
        await wait_healthy(session, url, wait_s)
        for i, item in enumerate(wc.warmup, 1):
            error = await send_warmup(session, url, wc.model, item, request_s)
            if error is not None:
                raise WarmupError(f"warmup {i}/{len(wc.warmup)}: {error}")
            print(f"warmup {i}/{len(wc.warmup)}: ok", flush=True)
    return len(wc.warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpupool.ops.warmup", description=__doc__)
    parser.add_argument("--config", required=True, help="The gateway's gpupool.yaml.")
    parser.add_argument("--worker", required=True, help="The worker whose `warmup:` to send.")
    parser.add_argument("--url", default=None, help="Override the worker's `url`.")
    parser.add_argument("--wait-s", type=float, default=1800.0, help="Longest wait for /health.")
    parser.add_argument("--request-s", type=float, default=600.0, help="Per-request timeout.")
    args = parser.parse_args(argv)
    try:
        wc = worker_config(load_config(args.config), args.worker)
        url = args.url or wc.url
        if url is None:
            raise WarmupError(f"worker `{wc.name}` has no `url`; pass --url")
        sent = asyncio.run(warm_up(wc, url.rstrip("/"), args.wait_s, args.request_s))
    except (ConfigError, WarmupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{wc.name}: warmed up with {sent} request(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
