"""GPU cache keys: which cards may share compile and Triton caches.

Triton kernels and autotuning results are valid for every card of one compute capability, so a
cache warmed on a 96 GB RTX PRO 6000 serves a 32 GB RTX 5090 (both sm120). NVML numbers cards
in PCI bus order; ``build_env`` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so ``launch.gpus`` means the
same cards. The key itself comes from :func:`gpupool.workers.gpus.shared_cache_key`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpupool.config.models import WorkerConfig
from gpupool.workers.gpus import GpuInfo, shared_cache_key


def detect_cache_keys(workers: Iterable[WorkerConfig], gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """Worker name → cache key of its GPUs; workers without (known) GPUs get none."""
    by_index = {g.index: g for g in gpus}
    keys: dict[str, str] = {}
    for w in workers:
        if w.launch is None or not w.launch.gpus:
            continue
        key = shared_cache_key([by_index[i] for i in w.launch.gpus if i in by_index])
        if key is not None:
            keys[w.name] = key
    return keys
