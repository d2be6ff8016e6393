"""The simulated GPU's NVML: what the sleep ledger (``sleep.py``) says each simulated worker's
process holds, read by pid. A swap group reads it through the same seam as NVML
(``workers/swap/memory.py``) for a launched simulator with ``--sleep-ledger``, so tests can play
a sleep that frees nothing (``sleep_fail: "keep_memory"``) and see the group notice."""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import orjson

from gpupool.workers.sim.sleep import GPU_BYTES


class LedgerMemory:
    """``GpuMemory`` over one ledger file (blocking: a file read)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def held_bytes(self, pids: Collection[int], gpus: Sequence[int]) -> int | None:
        try:
            data: dict[str, Any] = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None  # (written by atomic replace: a read sees a whole file, or none yet)
        total = 0
        for member in data.get("members", {}).values():
            pid = int(member.get("pid", 0))
            if pid in pids and _alive(pid):
                total += int(member.get("held_bytes", 0))
        return total

    def device_bytes(self, gpus: Sequence[int]) -> tuple[int, int] | None:
        """(used, total) of the simulated card: what every live member holds (a ``url:``
        simulator on the ledger too), of ``GPU_BYTES``."""
        try:
            data: dict[str, Any] = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None
        used = sum(
            int(m.get("held_bytes", 0))
            for m in data.get("members", {}).values()
            if _alive(int(m.get("pid", 0)))
        )
        return used, GPU_BYTES * max(len(gpus), 1)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
