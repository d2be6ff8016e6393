"""Prometheus file-based service discovery for the workers' own ``/metrics``.

The gateway scrapes each worker's vLLM metrics for routing, but operators want vLLM's full
metric set (``vllm:kv_cache_usage_perc``, TTFT, preemptions ...) in Prometheus, labelled by
worker and GPU. Workers come and go (launched on free ports, restarted, drained), so a static
scrape list would rot: gpupool writes the ``file_sd_configs`` file Prometheus already watches,

.. code-block:: json

    [{"targets": ["127.0.0.1:41234"],
      "labels": {"worker": "big", "model": "qwen3.5-35b-a3b", "gpus": "0"}}]

one entry per ready worker with a URL, rewritten on every worker state change. Prometheus
re-reads the file when it changes (inotify, with ``refresh_interval`` as the fallback), so a
worker that stops being ready also stops being scraped.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpupool.workers.registry import Worker, WorkerState

SD_FILE = Path("prometheus") / "workers.json"
"""Where, under ``server.state_dir``, the gateway keeps the SD file."""

_DEFAULT_PORTS = {"http": 80, "https": 443}


def sd_file_path(state_dir: str | os.PathLike[str]) -> Path:
    """``<state_dir>/prometheus/workers.json``."""
    return Path(state_dir) / SD_FILE


def sd_targets(workers: Iterable[Worker]) -> list[dict[str, Any]]:
    """The ``file_sd_configs`` entries for ``workers``: ready ones with a URL, sorted by name.

    Labels: ``worker``, ``model`` and, for workers pinned to GPUs, ``gpus`` (``"0"`` or
    ``"0,1"`` for tensor-parallel workers). An ``https`` URL sets ``__scheme__``; a URL with a
    path prefix sets ``__metrics_path__`` to ``<prefix>/metrics``.
    """
    ready = sorted((w for w in workers if w.state is WorkerState.ready), key=lambda w: w.name)
    return [_entry(w, w.url) for w in ready if w.url]


def _entry(worker: Worker, worker_url: str) -> dict[str, Any]:
    url = urlsplit(worker_url)
    scheme = url.scheme or "http"
    host = url.hostname or "127.0.0.1"
    port = url.port or _DEFAULT_PORTS.get(scheme, 80)
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    labels = {"worker": worker.name, "model": worker.model}
    if worker.gpus:
        labels["gpus"] = ",".join(str(g) for g in worker.gpus)
    if scheme != "http":
        labels["__scheme__"] = scheme
    prefix = url.path.rstrip("/")
    if prefix:
        labels["__metrics_path__"] = prefix + "/metrics"
    return {"targets": [target], "labels": labels}


def write_sd_file(path: str | os.PathLike[str], workers: Iterable[Worker]) -> Path:
    """Write :func:`sd_targets` to ``path`` atomically (a temporary file, then a rename).

    Prometheus never reads a half-written file. No fsync: the file is rebuilt from the registry
    on every change, so durability across a host crash does not matter, and this stays cheap
    enough to call from a registry listener. Returns the path written.
    """
    return write_sd_targets(path, sd_targets(workers))


def write_sd_targets(path: str | os.PathLike[str], targets: list[dict[str, Any]]) -> Path:
    """Write already computed :func:`sd_targets` entries to ``path`` atomically.

    Callers that write from another thread snapshot the entries first, so a write always
    reflects the registry at the moment of the change, whatever thread runs it.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(targets, indent=2, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; Prometheus may run as another user
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
