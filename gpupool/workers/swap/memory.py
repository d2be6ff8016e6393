"""Seeing a sleeping worker's GPU memory freed, not trusting its ``/sleep`` answer.

vLLM's /sleep can answer 200 while the memory stays (multimodal encoders, vllm#47654; 0.14 left
16 GB a GPU, vllm#32714): the next member's wake on that GPU would die of out-of-memory. So a
launched member's memory is read (``GpuMemory``: NVML per process, ``gpus.NvmlProcessMemory``; a
simulator's ledger, ``sim/memory.py``) just before its /sleep and after it, until it holds at
most ``swap.sleep_residue_gib`` (what a sleeping vLLM keeps: its CUDA context, the CUDA-graph
pool; vLLM's own sleep test allows 2 GiB for a 0.5B model) or ``swap.free_timeout_s`` passes.

A ``url:`` member's processes are not gpupool's to name, so its sleep is seen through its GPU
(``DeviceWatch``): a group takes turns on one GPU, so where a launched member names it (its
``launch.gpus``, on this host) a ``url:`` member's sleep is read there as the device's used
memory against the planner's figure: after the /sleep the GPU must have room for the group's
launched members (the largest share of the card one of them takes, ``gpu-memory-utilization``),
that is, at most ``1 - share`` of it used, whoever holds the rest. A group of ``url:`` members
only names no GPU (they may be on another host): their /is_sleeping answer is what frees it
(``reading.py``), unverified.

What cannot be seen is said, not guessed: no NVML, or a worker whose processes NVML does not
list while awake (a container without the host's pid namespace), is ``unverified`` and its
/sleep answer is trusted as before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpupool.workers.registry import Worker
from gpupool.workers.supervisor import procfs

GIB = 1 << 30
_POLL_S = 0.1


class GpuMemory(Protocol):
    def held_bytes(self, pids: Collection[int], gpus: Sequence[int]) -> int | None:
        """Bytes ``pids`` hold on ``gpus``; None when it cannot be read. Blocking."""
        ...


class Freed(StrEnum):
    freed = "freed"
    held = "held"  # still more than the residue after the wait: restart it
    unverified = "unverified"  # nothing to read, or this worker cannot be seen


class DeviceMemory(Protocol):
    def device_bytes(self, gpus: Sequence[int]) -> tuple[int, int] | None:
        """(used, total) bytes of ``gpus`` together, whoever holds them; None when it cannot
        be read. Blocking."""
        ...


@dataclass(frozen=True, slots=True)
class Check:
    freed: Freed
    awake_bytes: int | None
    asleep_bytes: int | None
    seconds: float
    of_device: bool = False  # the GPU's used memory (``DeviceWatch``), not the worker's own

    def describe(self) -> str:
        if self.freed is Freed.unverified:
            return "sleep not verified (its GPU memory cannot be read here)"
        before = (self.awake_bytes or 0) / GIB
        after = (self.asleep_bytes or 0) / GIB
        what = "GPU used: " if self.of_device else ""
        return f"{what}{before:.1f} GiB before /sleep, {after:.1f} GiB {self.seconds:.1f} s after"


@dataclass(frozen=True, slots=True)
class MemoryWatch:
    """Reads one launched worker's GPU memory (its process group's, on its GPUs)."""

    memory: GpuMemory
    gpus: tuple[int, ...]
    residue_bytes: int
    timeout_s: float

    async def read(self, w: Worker) -> int | None:
        if w.pid is None:
            return None
        pids = await asyncio.to_thread(_pids, w.pid)
        return await asyncio.to_thread(self.memory.held_bytes, pids, self.gpus)

    async def until_freed(self, w: Worker, awake: int | None) -> Check:
        """Read ``w`` after its /sleep answered until it holds at most the residue."""
        t0 = time.monotonic()
        if not awake:  # nothing seen while it held the GPU: blind to this worker
            return Check(Freed.unverified, awake, None, 0.0)
        while True:
            held = await self.read(w)
            seconds = time.monotonic() - t0
            if held is None:
                return Check(Freed.unverified, awake, None, seconds)
            if held <= self.residue_bytes:
                return Check(Freed.freed, awake, held, seconds)
            if seconds >= self.timeout_s:
                return Check(Freed.held, awake, held, seconds)
            await asyncio.sleep(_POLL_S)

    def held(self, check: Check) -> str:
        """Why a sleep whose memory stayed is not trusted (``Freed.held``)."""
        gpus = ",".join(map(str, self.gpus))
        return (
            f"/sleep answered, but it still holds {(check.asleep_bytes or 0) / GIB:.1f} GiB on "
            f"GPU {gpus} after {check.seconds:.1f} s (more than swap.sleep_residue_gib "
            f"{self.residue_bytes / GIB:g}): restarted, never woken beside"
        )


@dataclass(frozen=True, slots=True)
class DeviceWatch:
    """Reads a ``url:`` member's GPU (its group's launched members name it): freed once the
    device has room for ``need_share`` of it (the planner's figure for those members)."""

    memory: DeviceMemory
    gpus: tuple[int, ...]
    need_share: float
    timeout_s: float

    async def _seen(self) -> tuple[int, int] | None:
        return await asyncio.to_thread(self.memory.device_bytes, self.gpus)

    async def read(self, w: Worker) -> int | None:
        seen = await self._seen()
        return None if seen is None else seen[0]

    async def until_freed(self, w: Worker, awake: int | None, wait: bool = True) -> Check:
        """Read the GPU after ``w``'s /sleep answered until it has room (``wait``: up to
        ``timeout_s``; else one read)."""
        t0 = time.monotonic()
        while True:
            seen = await self._seen()
            seconds = time.monotonic() - t0
            if seen is None:
                return Check(Freed.unverified, awake, None, seconds, of_device=True)
            used, total = seen
            if used <= total * (1 - self.need_share):
                return Check(Freed.freed, awake, used, seconds, of_device=True)
            if not wait or seconds >= self.timeout_s:
                return Check(Freed.held, awake, used, seconds, of_device=True)
            await asyncio.sleep(_POLL_S)

    def held(self, check: Check) -> str:
        gpus = ",".join(map(str, self.gpus))
        return (
            f"/sleep answered, but GPU {gpus} still has {(check.asleep_bytes or 0) / GIB:.1f} "
            f"GiB used after {check.seconds:.1f} s: no room for the {self.need_share:g} of it "
            "the group's launched members take (the planner's figure); never woken beside, "
            "read again until there is"
        )


Watch = MemoryWatch | DeviceWatch


def _pids(leader: int) -> list[int]:
    """The worker's processes: its process group (vLLM's engine cores are its children, in the
    group: ``start_new_session`` made the leader's pid the group's id)."""
    return sorted({leader, *procfs.group_members(leader)})
