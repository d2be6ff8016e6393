"""GPUs by name, for planning without NVML: ``--gpu "RTX 5090,RTX PRO 6000"`` or ``8xH200``.

Memory is what NVML reports as the total (``nvidia-smi``'s MiB), not the marketing GB: a "32 GB"
RTX 5090 has 32,607 MiB (31.8 GiB). ``--gpu-memory-gb`` takes GiB for cards not listed here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpupool.workers.gpus import GpuInfo
from gpupool.workers.planner.errors import PlanArgsError

if TYPE_CHECKING:
    from gpupool.config.models import GpuCard

MiB = 1 << 20
GiB = 1 << 30
ASSUMED_CC = (9, 0)
"""Compute capability assumed for a GPU given only by its memory (Hopper: FP8 capable)."""


@dataclass(frozen=True, slots=True)
class KnownGpu:
    name: str  # as NVML names it
    memory_mib: int
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...]


CATALOG: tuple[KnownGpu, ...] = (
    KnownGpu("NVIDIA RTX PRO 6000 Blackwell", 97887, (12, 0), ("rtxpro6000", "pro6000")),
    KnownGpu("NVIDIA GeForce RTX 5090", 32607, (12, 0), ("rtx5090", "5090")),
    KnownGpu("NVIDIA GeForce RTX 5080", 16303, (12, 0), ("rtx5080", "5080")),
    KnownGpu("NVIDIA GeForce RTX 4090", 24564, (8, 9), ("rtx4090", "4090")),
    KnownGpu("NVIDIA GeForce RTX 3090", 24576, (8, 6), ("rtx3090", "3090")),
    KnownGpu("NVIDIA RTX 6000 Ada Generation", 49140, (8, 9), ("rtx6000ada", "6000ada")),
    KnownGpu("NVIDIA L40S", 46068, (8, 9), ("l40s",)),
    KnownGpu("NVIDIA L4", 23034, (8, 9), ("l4",)),
    KnownGpu("NVIDIA A10", 23028, (8, 6), ("a10",)),
    KnownGpu("NVIDIA A100-SXM4-80GB", 81920, (8, 0), ("a10080gb", "a100")),
    KnownGpu("NVIDIA A100-SXM4-40GB", 40960, (8, 0), ("a10040gb",)),
    KnownGpu("NVIDIA H100 NVL", 95830, (9, 0), ("h100nvl",)),
    KnownGpu("NVIDIA H100 80GB HBM3", 81559, (9, 0), ("h10080gb", "h100sxm", "h100pcie", "h100")),
    KnownGpu("NVIDIA H200", 143771, (9, 0), ("h200", "h200sxm", "h200nvl")),
    KnownGpu("NVIDIA B200", 183359, (10, 0), ("b200",)),
)

_COUNT = re.compile(r"^\s*(\d+)\s*[x*]\s*(.+)$", re.IGNORECASE)
_NOISE = re.compile(r"nvidia|geforce|blackwell|workstation|edition|[\s_-]")


def _key(name: str) -> str:
    return _NOISE.sub("", name.lower())


def known_gpu_names() -> str:
    return ", ".join(g.aliases[0] for g in CATALOG)


def lookup_gpu(name: str) -> KnownGpu:
    key = _key(name)
    for gpu in CATALOG:
        if key in gpu.aliases or key == _key(gpu.name):
            return gpu
    raise PlanArgsError(
        f"unknown GPU `{name}` (known: {known_gpu_names()}); give --gpu-memory-gb instead"
    )


def _counted(items: Sequence[str]) -> list[str]:
    out: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        m = _COUNT.match(item)
        out.extend([m.group(2)] * int(m.group(1)) if m else [item])
    return out


def gpus_from_names(spec: str) -> list[GpuInfo]:
    """``"RTX 5090, RTX PRO 6000"`` or ``"8xH200"`` → GPUs indexed in that order."""
    out: list[GpuInfo] = []
    for i, name in enumerate(_counted(spec.split(","))):
        gpu = lookup_gpu(name)
        total = gpu.memory_mib * MiB
        out.append(GpuInfo(i, gpu.name, total, total, gpu.compute_capability, ""))
    if not out:
        raise PlanArgsError("--gpu names no GPU")
    return out


def gpus_from_memory(spec: str) -> list[GpuInfo]:
    """``"80,80"`` or ``"2x79.2"`` (GiB each) → GPUs of unknown model (compute capability 9.0
    assumed)."""
    out: list[GpuInfo] = []
    for i, text in enumerate(_counted(spec.split(","))):
        try:
            gib = float(text)
        except ValueError:
            raise PlanArgsError(f"--gpu-memory-gb: `{text}` is not a number of GiB") from None
        if gib <= 0:
            raise PlanArgsError(f"--gpu-memory-gb: {gib} must be positive")
        total = round(gib * GiB)
        out.append(GpuInfo(i, f"GPU with {gib:g} GiB", total, total, ASSUMED_CC, ""))
    if not out:
        raise PlanArgsError("--gpu-memory-gb names no GPU")
    return out


def gpus_from_cards(cards: Mapping[int, GpuCard]) -> list[GpuInfo]:
    """The config's ``gpus:`` section as GPUs: a named card's NVML memory and compute
    capability (``memory_gb`` overrides the memory), or a card of that memory (9.0 assumed)."""
    out: list[GpuInfo] = []
    for index, card in sorted(cards.items()):
        known = lookup_gpu(card.name) if card.name else None
        total = round(card.memory_gb * GiB) if card.memory_gb else 0
        if known is not None:
            total = total or known.memory_mib * MiB
            out.append(GpuInfo(index, known.name, total, total, known.compute_capability, ""))
        else:
            name = f"GPU with {card.memory_gb:g} GiB"
            out.append(GpuInfo(index, name, total, total, ASSUMED_CC, ""))
    return out


@dataclass(frozen=True, slots=True)
class MachineGpus:
    """The GPUs a plan or a check uses, and where they came from (said in the output)."""

    gpus: list[GpuInfo]
    source: str


def machine_gpus(
    discovered: Sequence[GpuInfo],
    cards: Mapping[int, GpuCard] | None = None,
    *,
    names: str | None = None,
    memory_gb: str | None = None,
) -> MachineGpus:
    """The command line's ``--gpu`` / ``--gpu-memory-gb`` list, else NVML, else the config's
    ``gpus:`` section, else none."""
    if names:
        return MachineGpus(gpus_from_names(names), "--gpu")
    if memory_gb:
        return MachineGpus(gpus_from_memory(memory_gb), "--gpu-memory-gb")
    if discovered:
        return MachineGpus(list(discovered), "NVML")
    if cards:
        return MachineGpus(gpus_from_cards(cards), "the config's `gpus:` (no NVML here)")
    return MachineGpus([], "none: no NVML, no `gpus:` in the config")
