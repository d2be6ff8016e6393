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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
