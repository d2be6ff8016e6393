"""Linux ``/proc`` and pid-file helpers. Every function blocks: call them via ``asyncio.to_thread``.

A pid file ``<state_dir>/run/<worker>.pid`` records what one gpupool run started: the
process-group leader, its group, and a random token that gpupool put in the worker's
environment as ``GPUPOOL_WORKER_TOKEN``. A later run kills only processes of that group
whose ``/proc/<pid>/environ`` still carries that token, so a recycled pid is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TOKEN_ENV = "GPUPOOL_WORKER_TOKEN"
_GONE_STATES = frozenset("ZXx")


@dataclass(frozen=True, slots=True)
class PidRecord:
    pid: int
    pgid: int
    token: str
    argv: list[str]


def write_pid_file(path: Path, record: PidRecord) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
    tmp.replace(path)


def read_pid_file(path: Path) -> PidRecord | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return PidRecord(int(data["pid"]), int(data["pgid"]), str(data["token"]), data["argv"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_file(path: Path) -> None:
    path.unlink(missing_ok=True)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...]."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return data.rpartition(")")[2].split()


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] not in _GONE_STATES


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and len(fields) > 2 and fields[0] not in _GONE_STATES and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def carries_token(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{TOKEN_ENV}={token}".encode() in environ.split(b"\0")


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Poll until every pid is gone (or a zombie); return the ones still alive."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if is_alive(p)]
    return alive


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def kill_stale(path: Path, timeout_s: float = 10.0) -> list[int]:
    """Kill what a previous run's pid file at ``path`` left behind; return the pids killed."""
    record = read_pid_file(path)
    if record is None:
        remove_file(path)
        return []
    candidates = {record.pid, *group_members(record.pgid)}
    victims = sorted(p for p in candidates if is_alive(p) and carries_token(p, record.token))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_gone(victims, timeout_s)
    remove_file(path)
    return victims
