"""A gateway replica's per-key limits in their own process, for SIGKILL tests.

    python -m tests.gateway.security.limits_proc REDIS_URL PREFIX LEASE_TTL_S

Takes one slot of key ``alice`` (``max_concurrent: 1``), prints ``held`` and sleeps until killed.
"""

from __future__ import annotations

import asyncio
import sys

from gpupool.config.models import ApiKey
from gpupool.gateway.security.keys import Principal
from gpupool.gateway.security.limits import KeyLimits


async def main(url: str, prefix: str, ttl: str) -> None:
    limits = KeyLimits(url, prefix, lease_ttl_s=float(ttl))
    key = ApiKey(name="alice", sha256="a" * 64, max_concurrent=1)
    await limits.admit(Principal("alice", "alice", key=key))
    print("held", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
