"""GPU discovery through a fake NVML, the cache key, and ``gpupool gpus``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from click.testing import CliRunner

from gpupool.workers.gpus import (
    GpuInfo,
    NvmlProcessMemory,
    architecture,
    cache_key,
    discover_gpus,
    shared_cache_key,
)
from gpupool.workers.planner.cli import PlannerDeps, gpus

MiB = 1 << 20


@dataclass
class FakeMemory:
    total: int
    free: int


@dataclass
class FakeDevice:
    name: str | bytes
    total_mib: int
    cc: tuple[int, int]
    uuid: str | bytes
    broken: bool = False
    processes: list[Any] = field(default_factory=list)  # (pid, usedGpuMemory) per process


@dataclass
class FakeNvml:
    """The pynvml calls discovery makes, over a list of devices."""

    devices: list[FakeDevice]
    init_error: Exception | None = None
    shutdowns: list[int] = field(default_factory=list)

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns.append(1)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        if handle.broken:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        name: str | bytes = handle.name
        return name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> FakeMemory:
        return FakeMemory(handle.total_mib * MiB, handle.total_mib * MiB // 2)

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        cc: tuple[int, int] = handle.cc
        return cc

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        uuid: str | bytes = handle.uuid
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        if handle.broken:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return [FakeProcess(pid, used) for pid, used in handle.processes]


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None  # (NVML's field name)


PRO_6000 = FakeDevice("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 97887, (12, 0), "GPU-a")
RTX_5090 = FakeDevice(b"NVIDIA GeForce RTX 5090", 32607, (12, 0), b"GPU-b")


def two_cards() -> FakeNvml:
    return FakeNvml([PRO_6000, RTX_5090])


def test_discovery_reads_every_device_through_nvml() -> None:
    nvml = two_cards()
    found = discover_gpus(nvml)
    assert [g.index for g in found] == [0, 1]
    assert found[0].name == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
    assert found[1].name == "NVIDIA GeForce RTX 5090"  # bytes from old pynvml are decoded
    assert found[1].uuid == "GPU-b"
    assert found[1].memory_total_bytes == 32607 * MiB
    assert found[1].memory_free_bytes == 32607 * MiB // 2
    assert found[0].compute_capability == (12, 0)
    assert nvml.shutdowns == [1]


def test_no_nvml_library_means_no_gpus_not_an_error() -> None:
    class NVMLError_LibraryNotFound(Exception):
        pass

    nvml = FakeNvml([PRO_6000], init_error=NVMLError_LibraryNotFound("not found"))
    assert discover_gpus(nvml) == []


def test_a_lost_device_is_skipped_and_the_others_reported() -> None:
    lost = FakeDevice("lost", 1, (8, 0), "GPU-x", broken=True)
    found = discover_gpus(FakeNvml([lost, RTX_5090]))
    assert [g.index for g in found] == [1]


def test_real_discovery_on_this_host_does_not_raise() -> None:
    # These machines have no GPU: the real pynvml raises NVMLError_LibraryNotFound inside.
    assert isinstance(discover_gpus(), list)


def gpu(name: str, cc: tuple[int, int], total_gib: int = 32) -> GpuInfo:
    return GpuInfo(0, name, total_gib << 30, total_gib << 30, cc, "GPU-0")


def test_cards_of_one_architecture_share_a_cache_key_whatever_their_memory() -> None:
    pro = gpu("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 96)
    small = gpu("NVIDIA GeForce RTX 5090", (12, 0), 32)
    assert cache_key(pro) == cache_key(small) == "nvidia-blackwell-sm120"


def test_different_compute_capabilities_never_share_a_cache() -> None:
    keys = {
        cache_key(gpu("GB10", (12, 1))),
        cache_key(gpu("B200", (10, 0))),
        cache_key(gpu("RTX 5090", (12, 0))),
        cache_key(gpu("H100", (9, 0))),
        cache_key(gpu("A100", (8, 0))),
        cache_key(gpu("A10", (8, 6))),
    }
    assert len(keys) == 6
    assert cache_key(gpu("H100", (9, 0))) == "nvidia-hopper-sm90"
    assert architecture((8, 9)) == "ada"


def test_a_tensor_parallel_worker_gets_one_key() -> None:
    a, b = gpu("RTX 5090", (12, 0)), gpu("RTX PRO 6000", (12, 0), 96)
    assert shared_cache_key([a, b]) == "nvidia-blackwell-sm120"
    assert shared_cache_key([a, gpu("H100", (9, 0))]) == (
        "nvidia-blackwell-sm120+nvidia-hopper-sm90"
    )
    assert shared_cache_key([]) is None


def deps(nvml: FakeNvml) -> PlannerDeps:
    return PlannerDeps(discover=lambda: discover_gpus(nvml))


def test_gpus_command_prints_a_table() -> None:
    result = CliRunner().invoke(gpus, [], obj=deps(two_cards()), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "NVIDIA GeForce RTX 5090" in result.output
    assert "31.84 GiB" in result.output
    assert "12.0 (sm120)" in result.output
    assert "nvidia-blackwell-sm120" in result.output


def test_gpus_command_json() -> None:
    result = CliRunner().invoke(gpus, ["--json"], obj=deps(two_cards()))
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert [g["name"] for g in data["gpus"]][1] == "NVIDIA GeForce RTX 5090"
    assert data["gpus"][0]["memory_total_bytes"] == 97887 * MiB
    assert data["gpus"][0]["compute_capability"] == "12.0"
    assert data["gpus"][0]["cache_key"] == data["gpus"][1]["cache_key"]


def test_gpus_command_says_clearly_when_there_is_no_gpu() -> None:
    no_nvml = FakeNvml([], init_error=RuntimeError("NVML Shared Library Not Found"))
    result = CliRunner().invoke(gpus, [], obj=deps(no_nvml))
    assert result.exit_code == 0
    assert result.output.strip() == "No NVIDIA GPU found (NVML not available)"
    data = json.loads(CliRunner().invoke(gpus, ["--json"], obj=deps(no_nvml)).output)
    assert data == {"gpus": [], "message": "No NVIDIA GPU found (NVML not available)"}


def test_gpus_help_has_examples() -> None:
    result = CliRunner().invoke(gpus, ["--help"])
    assert "Examples:" in result.output
    assert "gpupool gpus --json" in result.output


def test_process_memory_sums_a_workers_processes_on_its_gpus() -> None:
    """What a swap group reads to see a sleeping worker's memory freed (swap/memory.py)."""
    a = FakeDevice("A", 81559, (9, 0), "GPU-a", processes=[(10, 60 << 30), (11, 2 << 30), (99, 5)])
    b = FakeDevice("B", 81559, (9, 0), "GPU-b", processes=[(10, 1 << 30), (12, None)])
    memory = NvmlProcessMemory(FakeNvml([a, b]))
    assert memory.held_bytes({10, 11}, [0]) == 62 << 30  # not pid 99, another program's
    assert memory.held_bytes({10, 12}, [0, 1]) == 61 << 30  # None where the driver cannot say
    assert memory.held_bytes({7}, [0]) == 0  # not listed: freed, or invisible (caller decides)
    assert (
        NvmlProcessMemory(FakeNvml([a], init_error=RuntimeError("no driver"))).held_bytes({10}, [0])
        is None
    )
    lost = FakeDevice("C", 1, (9, 0), "GPU-c", broken=True)
    assert NvmlProcessMemory(FakeNvml([lost])).held_bytes({10}, [0]) is None
    assert NvmlProcessMemory(FakeNvml([a])).held_bytes({10}, []) is None
