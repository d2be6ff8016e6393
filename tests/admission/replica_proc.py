"""A gateway replica in its own process, for SIGKILL tests.

    python -m tests.admission.replica_proc REDIS_URL PREFIX hold|wait

``hold``: take the one slot of ``w1`` and print ``held``. ``wait``: queue for it and print
``queued``. Then sleep until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys

from gpupool.config.models import QueueConfig
from gpupool.gateway.admission.base import Ticket
from gpupool.gateway.admission.redis_backend import RedisAdmission

# a lease's TTL in Redis, this process's and the test's side alike: 1.5 s leaves a loaded
# machine's event-loop stalls (renewals every 0.05 s) far inside it
TTL_S = 1.5


class _OneWorker:
    def capacity(self, worker: str) -> int:
        return 1

    def available(self, worker: str) -> bool:
        return worker == "w1"

    def slots(self, worker: str) -> int:
        return 1 if worker == "w1" else 0


async def main(url: str, prefix: str, mode: str) -> None:
    cfg = QueueConfig(
        redis_url=url, redis_prefix=prefix, lease_ttl_s=TTL_S, keepalive_interval_s=0.05
    )
    adm = RedisAdmission(cfg, _OneWorker(), replica_id=f"proc:{os.getpid()}:0")
    await adm.start()
    ticket = Ticket("proc-1", "m", "t", 0, ["w1"], max_wait_s=600.0)
    if mode == "hold":
        await adm.acquire(ticket)
        print("held", flush=True)
    else:

        async def on_wait(position: int) -> None:
            print("queued", flush=True)

        waiting = asyncio.create_task(adm.acquire(ticket, on_wait))
        await asyncio.wait({waiting}, timeout=3600)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
