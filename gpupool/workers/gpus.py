"""NVIDIA GPU discovery through NVML, and the key that names a GPU architecture's caches.

:func:`discover_gpus` never raises: on a host without a GPU, without the driver or without
``pynvml`` it returns ``[]``. Tests pass a fake NVML (any object with the methods of
:class:`Nvml`).

Indices are NVML's, which follow PCI bus order. CUDA numbers devices fastest-first unless
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is set, so a launcher that pins ``CUDA_VISIBLE_DEVICES`` from
these indices should set that variable too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int
    name: str
    memory_total_bytes: int
    memory_free_bytes: int
    compute_capability: tuple[int, int]
    uuid: str

    @property
    def sm(self) -> str:
        """``sm120`` for compute capability 12.0."""
        major, minor = self.compute_capability
        return f"sm{major}{minor}"


class MemoryInfo(Protocol):
    total: int
    free: int


class Nvml(Protocol):
    """The part of ``pynvml`` discovery uses (the module itself satisfies it)."""

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> MemoryInfo: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> Sequence[Any]: ...


def load_nvml() -> Nvml | None:
    """The real ``pynvml`` module, or None when it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    nvml: Nvml = pynvml
    return nvml


def discover_gpus(nvml: Nvml | None = None) -> list[GpuInfo]:
    """Every GPU NVML reports, by index; ``[]`` when NVML is absent or fails. Never raises."""
    lib = nvml if nvml is not None else load_nvml()
    if lib is None:
        return []
    try:
        lib.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU
        return []
    try:
        return [gpu for i in range(lib.nvmlDeviceGetCount()) if (gpu := _device(lib, i))]
    except Exception:
        return []
    finally:
        _shutdown(lib)


def _device(lib: Nvml, index: int) -> GpuInfo | None:
    """One device, or None when NVML cannot describe it (lost, unsupported)."""
    try:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        memory = lib.nvmlDeviceGetMemoryInfo(handle)
        major, minor = lib.nvmlDeviceGetCudaComputeCapability(handle)
        return GpuInfo(
            index=index,
            name=_text(lib.nvmlDeviceGetName(handle)),
            memory_total_bytes=int(memory.total),
            memory_free_bytes=int(memory.free),
            compute_capability=(int(major), int(minor)),
            uuid=_text(lib.nvmlDeviceGetUUID(handle)),
        )
    except Exception:
        return None


def _shutdown(lib: Nvml) -> None:
    try:
        lib.nvmlShutdown()
    except Exception:
        return


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# Compute capability → architecture family. The family is only a readable label in the key;
# the capability is what decides compatibility.
_FAMILIES: tuple[tuple[tuple[int, int], str], ...] = (
    ((6, 0), "pascal"),
    ((7, 0), "volta"),
    ((7, 5), "turing"),
    ((8, 0), "ampere"),
    ((8, 9), "ada"),
    ((9, 0), "hopper"),
    ((10, 0), "blackwell"),
)


def architecture(compute_capability: tuple[int, int]) -> str:
    """``blackwell`` for 10.x/11.x/12.x, ``hopper`` for 9.0, ... ``unknown`` before Pascal."""
    family = "unknown"
    for first, name in _FAMILIES:
        if compute_capability >= first:
            family = name
    return family


def cache_key(gpu: GpuInfo) -> str:
    """Names the persistent compile/Triton caches for ``gpu``: ``nvidia-blackwell-sm120``.

    Keyed by compute capability, not by product or memory size. Triton and torch.compile emit
    code for a target architecture (``sm_120``); a 96 GB RTX PRO 6000 and a 32 GB RTX 5090 are
    both sm_120 and can load each other's kernels and autotuning results, which is how seed 000
    warms the cache on the big card so the small card's first request does not run the autotuner
    (and its 4-8 GB of benchmark buffers). Different capabilities never share: sm_121 (GB10)
    kernels differ from sm_120 ones (seed 002), and sm_100 (B200) from both. A toolchain change
    (driver, CUDA, Triton) is caught by Triton's own hashes: a miss, never a wrong kernel.
    Tuned choices from a larger card may be slightly slower on a smaller one; they are valid.
    """
    return f"nvidia-{architecture(gpu.compute_capability)}-{gpu.sm}"


def shared_cache_key(gpus: Sequence[GpuInfo]) -> str | None:
    """One key for a multi-GPU (tensor-parallel) worker: the GPUs' keys, deduplicated and sorted
    (``a+b`` when architectures are mixed). None for no GPUs."""
    keys = sorted({cache_key(g) for g in gpus})
    return "+".join(keys) if keys else None


class NvmlProcessMemory:
    """GPU memory held by a set of processes, per NVML (``nvmlDeviceGetComputeRunningProcesses``
    on each GPU named): the seam a swap group reads to see a sleeping worker's memory freed.

    Blocking (NVML calls): run it with ``asyncio.to_thread``. None when NVML cannot say (no
    library or driver, a GPU it cannot read). 0 when none of ``pids`` is among its processes:
    freed, or invisible (inside a container without the host's pid namespace NVML reports host
    pids, which match nothing here); the caller tells the two apart by what it read while the
    worker was awake (0 then: it cannot see this worker)."""

    def __init__(self, nvml: Nvml | None = None) -> None:
        self._nvml = nvml

    def held_bytes(self, pids: Collection[int], gpus: Sequence[int]) -> int | None:
        return self._read(lambda lib: _held(lib, set(pids), gpus), gpus)

    def device_bytes(self, gpus: Sequence[int]) -> tuple[int, int] | None:
        """(used, total) bytes of ``gpus`` together, whoever holds them (a ``url:`` worker's
        processes are not gpupool's to name); None when NVML cannot say."""
        return self._read(lambda lib: _device_used(lib, gpus), gpus)

    def _read(self, read: Callable[[Nvml], _T], gpus: Sequence[int]) -> _T | None:
        lib = self._nvml if self._nvml is not None else load_nvml()
        if lib is None or not gpus:
            return None
        try:
            lib.nvmlInit()
        except Exception:
            return None
        try:
            return read(lib)
        except Exception:  # NVMLError of any kind: unknown, never "freed"
            return None
        finally:
            _shutdown(lib)


def _device_used(lib: Nvml, gpus: Sequence[int]) -> tuple[int, int]:
    used = total = 0
    for index in gpus:
        memory = lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(index))
        used, total = used + int(memory.total) - int(memory.free), total + int(memory.total)
    return used, total


def _held(lib: Nvml, pids: set[int], gpus: Sequence[int]) -> int:
    total = 0
    for index in gpus:
        handle = lib.nvmlDeviceGetHandleByIndex(index)
        for proc in lib.nvmlDeviceGetComputeRunningProcesses(handle):
            if int(proc.pid) in pids:
                total += int(proc.usedGpuMemory or 0)  # (None where the driver cannot say)
    return total
