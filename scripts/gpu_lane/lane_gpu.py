"""What nvidia-smi says: GPUs, memory over time, which process holds which GPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from lane_util import sh

GPU_FIELDS = "index,name,uuid,memory.total,memory.used,driver_version"
APP_FIELDS = "pid,process_name,used_memory,gpu_uuid"


def _csv(query: list[str]) -> list[list[str]]:
    r = sh(["nvidia-smi", *query, "--format=csv,noheader,nounits"], timeout=20)
    if r["rc"] != 0:
        return []
    return [[c.strip() for c in line.split(",")] for line in r["out"].splitlines() if line.strip()]


def gpus() -> list[dict[str, Any]]:
    rows = _csv([f"--query-gpu={GPU_FIELDS}"])
    keys = ["index", "name", "uuid", "memory_total_mib", "memory_used_mib", "driver"]
    out = [dict(zip(keys, row, strict=False)) for row in rows if len(row) >= len(keys)]
    for g in out:
        for k in ("index", "memory_total_mib", "memory_used_mib"):
            g[k] = _int(g[k])
    return out


def used_mib() -> list[int]:
    return [_int(row[0]) for row in _csv(["--query-gpu=memory.used"]) if row]


def apps() -> list[dict[str, Any]]:
    """Compute processes: pid, name, MiB, GPU index (from its uuid)."""
    index = {g["uuid"]: g["index"] for g in gpus()}
    rows = _csv([f"--query-compute-apps={APP_FIELDS}"])
    return [
        {"pid": _int(r[0]), "name": r[1], "used_mib": _int(r[2]), "gpu": index.get(r[3], r[3])}
        for r in rows
        if len(r) >= 4
    ]


def _int(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        return -1


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and parent_of(int(entry)) == pid:
            kids.append(int(entry))
    return sorted(kids)


def ancestors(pid: int) -> list[int]:
    chain: list[int] = []
    cur: int | None = pid
    while cur and cur > 1 and len(chain) < 20:
        chain.append(cur)
        cur = parent_of(cur)
    return chain


def cuda_visible_devices(pid: int) -> str | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"CUDA_VISIBLE_DEVICES="):
            return item.split(b"=", 1)[1].decode()
    return None


def apps_by_worker(guards: dict[str, int | None]) -> dict[str, list[dict[str, Any]]]:
    """Each worker's GPU processes (found by walking up to its guard pid), with the
    CUDA_VISIBLE_DEVICES they were started with: nvidia-smi's per-process GPU proves it."""
    owner = {pid: name for name, pid in guards.items() if pid}
    found: dict[str, list[dict[str, Any]]] = {name: [] for name in guards}
    for app in apps():
        name = next((owner[p] for p in ancestors(app["pid"]) if p in owner), "?")
        app["cuda_visible_devices"] = cuda_visible_devices(app["pid"])
        found.setdefault(name, []).append(app)
    return found


class Sampler:
    """Samples every GPU's used memory in a thread: ``[(t, [MiB per GPU]), ...]``."""

    def __init__(self, t0: float, interval_s: float = 1.0) -> None:
        self.t0, self.interval_s = t0, interval_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = used_mib()
            if used:
                self.samples.append((round(time.monotonic() - self.t0, 1), used))
            self._stop.wait(self.interval_s)

    def between(self, t_from: float, t_to: float) -> list[tuple[float, list[int]]]:
        return [s for s in self.samples if t_from <= s[0] <= t_to]

    def peak(self, t_from: float, t_to: float) -> list[int]:
        window = self.between(t_from, t_to)
        if not window:
            return []
        return [max(s[1][i] for s in window) for i in range(len(window[0][1]))]

    def thin(self, every_s: float = 5.0) -> list[tuple[float, list[int]]]:
        """Samples at most one per ``every_s`` (for the report)."""
        out: list[tuple[float, list[int]]] = []
        for s in self.samples:
            if not out or s[0] - out[-1][0] >= every_s:
                out.append(s)
        return out
