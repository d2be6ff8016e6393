"""GPU cache keys: which cards may share compile and Triton caches.

Triton kernels and autotuning results are valid for every card of one compute capability, so a
cache warmed on a 96 GB RTX PRO 6000 serves a 32 GB RTX 5090 (both ``sm_120``). NVML numbers cards
in PCI bus order; ``build_env`` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so ``launch.gpus`` means the
same cards. Blocking (NVML calls): run once at startup, via ``asyncio.to_thread`` when in a loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from gpupool.config.models import WorkerConfig

logger = logging.getLogger(__name__)


def detect_cache_keys(workers: Iterable[WorkerConfig]) -> dict[str, str]:
    """Worker name → ``sm_<major><minor>`` of its first GPU; {} when NVML is unavailable."""
    wanted = {w.name: w.launch.gpus[0] for w in workers if w.launch and w.launch.gpus}
    if not wanted:
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no driver, no library: CPU host
        logger.info("NVML unavailable (%s); GPU caches keyed as `cpu`", e)
        return {}
    try:
        return {name: _key(pynvml, index) for name, index in wanted.items()}
    finally:
        pynvml.nvmlShutdown()


def _key(nvml: Any, index: int) -> str:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    return f"sm_{major}{minor}"
