"""Build the configured admission backend (the one place that chooses between them)."""

from __future__ import annotations

import os
import secrets
import socket

from gpupool.config.models import QueueBackend, QueueConfig
from gpupool.gateway.admission.base import Admission, WorkerView
from gpupool.gateway.admission.memory import MemoryAdmission
from gpupool.gateway.admission.redis_backend import RedisAdmission


def new_replica_id() -> str:
    """``hostname:pid:random``: unique per gateway process, readable in snapshots."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def build_admission(
    cfg: QueueConfig, workers: WorkerView, replica_id: str | None = None
) -> Admission:
    """A not yet started admission; the caller awaits ``start()`` and, at shutdown, ``close()``."""
    rid = replica_id or new_replica_id()
    if cfg.backend is QueueBackend.redis:
        return RedisAdmission(cfg, workers, replica_id=rid)
    return MemoryAdmission.from_config(cfg, workers, rid)
