"""Planner fixtures: every test runs with an empty Hugging Face cache of its own and offline, so
nothing reaches the network and nothing from the machine's real cache leaks in."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.workers.gpus import GpuInfo

MODEL_CONFIGS = Path(__file__).parents[2] / "data" / "model_configs"
MiB = 1 << 20
GiB = 1 << 30

# NVML totals of the cards the seeds and the issue name
RTX_5090 = 32607 * MiB
RTX_PRO_6000 = 97887 * MiB
H100 = 81559 * MiB
H200 = 143771 * MiB


@pytest.fixture(autouse=True)
def hf_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``HF_HUB_CACHE`` is an empty folder under ``tmp_path``; ``HF_HUB_OFFLINE=1``."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield cache


def put_in_hf_cache(cache: Path, repo_id: str, files: dict[str, Path | dict[str, object]]) -> Path:
    """Lay ``files`` out the way huggingface_hub caches a download: blobs, a snapshot of links,
    and ``refs/main`` naming the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    for name, content in files.items():
        blob = repo / "blobs" / f"blob-{name}"
        if isinstance(content, Path):
            shutil.copyfile(content, blob)
        else:
            blob.write_text(json.dumps(content))
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return snapshot


def gpu(index: int, name: str, memory: int, cc: tuple[int, int]) -> GpuInfo:
    return GpuInfo(index, name, memory, memory, cc, f"GPU-{index}")
