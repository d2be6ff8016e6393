"""The supervisor: exact vLLM commands, environments, and real process lifecycles.

Lifecycle tests launch ``support/fake_vllm.py`` (a stdlib HTTP server that, like vLLM, forks an
"EngineCore" child which outlives its parent) through the real launcher, so process groups,
the guard's parent-death signal, pid files and logs are the real ones.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import re
import signal
import struct
import sys
import time
import types
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gpupool.config.models import ServerConfig, WarmupItem, WorkerConfig
from gpupool.workers.gpus import GpuInfo
from gpupool.workers.registry import MediaCaps, Registry, Worker, WorkerState
from gpupool.workers.supervisor import (
    LaunchConfigError,
    LaunchSpec,
    Supervisor,
    build_command,
    build_env,
    capacity_of,
    check_launch,
    detect_cache_keys,
    media_limits_of,
    png_bytes,
)
from gpupool.workers.supervisor.lifecycle import describe_exit
from gpupool.workers.supervisor.policy import CrashWindow, backoff_delay
from gpupool.workers.supervisor.procfs import TOKEN_ENV, is_alive
from gpupool.workers.supervisor.warmup import warmup_body

ROOT = Path(__file__).resolve().parents[3]
FAKE = ROOT / "tests" / "support" / "fake_vllm.py"

SEED_000 = """
workers:
  - name: pro6000
    model: qwen3.5-35b-a3b
    launch:
      gpus: [0]
      port: 8101
      model_path: cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit
      command: ["vllm", "serve", "{model_path}"]
      args:
        max-model-len: 131072
        gpu-memory-utilization: 0.92
        kv-cache-dtype: fp8
        max-num-seqs: 2
        max-num-batched-tokens: 4096
        limit-mm-per-prompt: {image: 2, video: 0}
        reasoning-parser: qwen3
        enable-prefix-caching: true
      env: {VLLM_NVFP4_GEMM_BACKEND: marlin}
      startup_timeout_s: 900
"""


def seed_worker(**launch_changes: Any) -> WorkerConfig:
    data = yaml.safe_load(SEED_000)["workers"][0]
    data["launch"].update(launch_changes)
    return WorkerConfig.model_validate(data)


# -- command.py ------------------------------------------------------------------------------


def test_seed_000_command_is_exactly_the_documented_vllm_serve() -> None:
    assert build_command(seed_worker(), 8101) == [
        "vllm", "serve", "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit",
        "--max-model-len", "131072",
        "--gpu-memory-utilization", "0.92",
        "--kv-cache-dtype", "fp8",
        "--max-num-seqs", "2",
        "--max-num-batched-tokens", "4096",
        "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
        "--reasoning-parser", "qwen3",
        "--enable-prefix-caching",
        "--host", "127.0.0.1", "--port", "8101", "--served-model-name", "qwen3.5-35b-a3b",
    ]  # fmt: skip


def test_false_and_null_flags_are_omitted_lists_become_json_and_port_fills_in() -> None:
    worker = seed_worker(
        command=["python", "-m", "vllm.entrypoints.openai.api_server", "--model={model_path}"],
        args={"enforce-eager": False, "quantization": None, "trust-remote-code": True,
              "allowed-origins": ["a", "b"], "x": "{port}"},
    )  # fmt: skip
    assert build_command(worker, 9000) == [
        "python", "-m", "vllm.entrypoints.openai.api_server",
        "--model=cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit",
        "--trust-remote-code", "--allowed-origins", '["a", "b"]', "--x", "{port}",
        "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "qwen3.5-35b-a3b",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "command", "field"),
    [
        ({"port": 1234}, None, "launch.args.port"),
        ({"--host": "0.0.0.0"}, None, "launch.args.--host"),
        ({"served_model_name": "other"}, None, "launch.args.served_model_name"),
        ({}, ["vllm", "serve", "{model_path}", "--host", "0.0.0.0"], "launch.command[3]"),
    ],
)
def test_user_given_host_port_or_served_name_is_a_config_error(
    args: dict[str, Any], command: list[str] | None, field: str
) -> None:
    worker = seed_worker(args=args, **({"command": command} if command else {}))
    assert worker.launch is not None
    problems = check_launch(worker.launch)
    assert len(problems) == 1 and problems[0].startswith(f"{field}: ")
    with pytest.raises(LaunchConfigError, match="not allowed"):
        build_command(worker, 8000)
    with pytest.raises(LaunchConfigError, match=re.escape(f"workers.pro6000.{field}")):
        Supervisor(Registry(), [worker], ServerConfig(), None)  # type: ignore[arg-type]


def test_port_placeholder_in_the_command_is_allowed() -> None:
    worker = seed_worker(command=["vllm", "serve", "{model_path}", "--port", "{port}"], args={})
    assert build_command(worker, 8123)[3:5] == ["--port", "8123"]


def test_env_pins_gpus_and_shares_caches_between_cards_of_one_architecture(
    tmp_path: Path,
) -> None:
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/home/u"}
    big = build_env(seed_worker(), "sm_120", tmp_path, base)
    small = build_env(seed_worker(gpus=[1]), "sm_120", tmp_path, base)
    assert big["CUDA_VISIBLE_DEVICES"] == "0" and small["CUDA_VISIBLE_DEVICES"] == "1"
    assert big["PATH"] == "/usr/bin" and big["VLLM_NVFP4_GEMM_BACKEND"] == "marlin"
    assert big["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # gpus: [1] is nvidia-smi's card 1
    cache = tmp_path.resolve() / "cache" / "sm_120"
    for env in (big, small):
        assert env["VLLM_CACHE_ROOT"] == str(cache / "vllm")
        assert env["TRITON_CACHE_DIR"] == str(cache / "triton")
    other_arch = build_env(seed_worker(), "sm_90", tmp_path, base)
    assert other_arch["TRITON_CACHE_DIR"] == str(tmp_path.resolve() / "cache/sm_90/triton")


def test_env_without_gpus_or_key_uses_cpu_cache_and_user_env_wins(tmp_path: Path) -> None:
    worker = seed_worker(gpus=None, env={"TRITON_CACHE_DIR": "/mnt/triton"})
    env = build_env(worker, None, tmp_path, {"CUDA_VISIBLE_DEVICES": "3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "CUDA_DEVICE_ORDER" not in env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path.resolve() / "cache/cpu/vllm")
    assert env["TRITON_CACHE_DIR"] == "/mnt/triton"
    hostile = build_env(worker, "../../etc", tmp_path, {})
    assert Path(hostile["VLLM_CACHE_ROOT"]).parent.parent == tmp_path.resolve() / "cache"


class FakeNvml(types.ModuleType):
    """pynvml on a PRO 6000 (card 0) + RTX 5090 (card 1) + H100 (card 2) host."""

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut = False

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return [(12, 0), (12, 0), (9, 0)][handle]


def test_gpu_cache_keys_group_cards_by_compute_capability() -> None:
    gib = 1024**3
    gpus = [
        GpuInfo(0, "NVIDIA RTX PRO 6000 Blackwell", 96 * gib, 96 * gib, (12, 0), "u0"),
        GpuInfo(1, "NVIDIA GeForce RTX 5090", 32 * gib, 32 * gib, (12, 0), "u1"),
        GpuInfo(2, "NVIDIA H100", 80 * gib, 80 * gib, (9, 0), "u2"),
        GpuInfo(3, "NVIDIA H100", 80 * gib, 80 * gib, (9, 0), "u3"),
    ]
    workers = [
        seed_worker(),
        seed_worker(gpus=[1]),
        seed_worker(gpus=[2, 3]),
        seed_worker(gpus=None),
    ]
    for name, w in zip(["pro6000", "rtx5090", "h100", "cpu"], workers, strict=True):
        w.name = name
    keys = detect_cache_keys(workers, gpus)
    assert set(keys) == {"pro6000", "rtx5090", "h100"}
    assert keys["pro6000"] == keys["rtx5090"] != keys["h100"]


def test_capacity_from_max_inflight_else_max_num_seqs() -> None:
    assert capacity_of(seed_worker()) == 2
    assert capacity_of(seed_worker(args={"max_num_seqs": "8"})) == 8
    assert capacity_of(seed_worker(args={})) is None
    data = yaml.safe_load(SEED_000)["workers"][0] | {"max_inflight": 5}
    assert capacity_of(WorkerConfig.model_validate(data)) == 5


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"image": 2, "video": 0}, MediaCaps(image=2, video=0)),
        ({"image": {"count": 5, "width": 512, "height": 512}, "audio": 1}, MediaCaps(5, None, 1)),
        ('{"video": {"count": 1, "num_frames": 32}}', MediaCaps(video=1)),
        (None, MediaCaps()),
    ],
)
def test_media_limits_from_limit_mm_per_prompt(value: object, expected: MediaCaps) -> None:
    args = {} if value is None else {"limit-mm-per-prompt": value}
    assert media_limits_of(seed_worker(args=args)) == expected


def test_language_model_only_admits_no_media() -> None:
    assert media_limits_of(seed_worker(args={"language-model-only": True})) == MediaCaps(0, 0, 0)


# -- warm-up images, backoff -------------------------------------------------------------------


def _png_size(data: bytes) -> tuple[int, int]:
    """Check a PNG's structure and CRCs the way a decoder does; return (width, height)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(tag + body) == crc
        chunks[tag] = body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    assert len(zlib.decompress(chunks[b"IDAT"])) == height * (1 + 3 * width)
    assert b"IEND" in chunks
    return width, height


@pytest.mark.parametrize(("w", "h"), [(1, 1), (64, 64), (512, 256)])
def test_png_is_valid_and_sized(w: int, h: int) -> None:
    assert _png_size(png_bytes(w, h)) == (w, h)


def test_warmup_body_carries_text_and_images() -> None:
    body = warmup_body("m", WarmupItem(prompt="hi", images=[[64, 64], [32, 16]], max_tokens=4))
    parts = body["messages"][0]["content"]
    assert parts[0] == {"type": "text", "text": "hi"} and body["max_tokens"] == 4
    uri = parts[2]["image_url"]["url"]
    assert _png_size(base64.b64decode(uri.removeprefix("data:image/png;base64,"))) == (32, 16)


def test_backoff_doubles_caps_and_jitters_by_twenty_percent() -> None:
    assert [backoff_delay(k, 1.0, 10.0, 0.0) for k in range(6)] == [1, 2, 4, 8, 10, 10]
    assert backoff_delay(1, 1.0, 10.0, 1.0) == pytest.approx(2.4)
    assert backoff_delay(9, 1.0, 10.0, -1.0) == pytest.approx(8.0)


def test_crash_window_forgets_old_crashes() -> None:
    window = CrashWindow(max_restarts=2, window_s=60)
    assert [window.record(t) for t in (0, 10, 20)] == [1, 2, 3] and window.exhausted()
    assert window.record(75) == 2 and not window.exhausted()


def test_exit_descriptions() -> None:
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-9) == "was killed by SIGKILL"


# -- a crash loop through fakes: backoff without waiting ----------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


class DeadOnArrival:
    """A process that has already exited with code 3."""

    pid = 999_999_999
    returncode = 3

    async def wait(self) -> int:
        return 3

    async def terminate(self, timeout_s: float) -> int:
        return 3

    async def kill(self) -> int:
        return 3

    async def log_tail(self, lines: int) -> list[str]:
        return ["RuntimeError: Triton Error [CUDA]: out of memory"]


class CrashingLauncher:
    def __init__(self) -> None:
        self.specs: list[LaunchSpec] = []

    async def launch(self, spec: LaunchSpec) -> DeadOnArrival:
        self.specs.append(spec)
        return DeadOnArrival()

    async def cleanup_stale(self) -> list[int]:
        return []


class NoJitter(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return 0.0


async def test_crash_loop_backs_off_exponentially_then_fails(tmp_path: Path) -> None:
    registry, clock, launcher = Registry(), FakeClock(), CrashingLauncher()
    worker = seed_worker(max_restarts=3, backoff_initial_s=1.0, backoff_max_s=3.0)
    sup = Supervisor(
        registry, [worker], ServerConfig(state_dir=str(tmp_path)), None,  # type: ignore[arg-type]
        launcher=launcher, clock=clock, rng=NoJitter(), gpu_cache_keys={"pro6000": "sm_120"},
    )  # fmt: skip
    await sup.start()
    w = sup.worker("pro6000")
    await _until(lambda: w.state is WorkerState.failed)
    assert clock.sleeps == [1.0, 2.0, 3.0]
    assert len(launcher.specs) == 4 and w.restarts == 3
    assert "exited with code 3 during startup" in (w.last_error or "")
    assert "4 crashes within restart_window_s=600 s (max_restarts=3): giving up" in str(
        w.last_error
    )
    assert w.last_log_lines == ["RuntimeError: Triton Error [CUDA]: out of memory"]
    spec = launcher.specs[0]
    assert spec.argv[:3] == ["vllm", "serve", "cyankiwi/Qwen3.5-35B-A3B-AWQ-4bit"]
    assert spec.env["TRITON_CACHE_DIR"] == str(resolved(tmp_path) / "cache/sm_120/triton")
    assert is_dir(spec.env["TRITON_CACHE_DIR"])
    await sup.undrain("pro6000")  # an operator's retry: a fresh crash window
    await _until(lambda: len(launcher.specs) == 8 and w.state is WorkerState.failed)
    await sup.stop()
    assert state_of(w) is WorkerState.stopped


# -- real processes -----------------------------------------------------------------------------


async def _until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)


def fake_worker(
    tmp: Path, name: str = "w", warmup: list[dict[str, Any]] | None = None, **launch: Any
) -> WorkerConfig:
    args = {
        "max-model-len": 4096,
        "max-num-seqs": 2,
        "info-file": str(tmp / f"{name}.info.json"),
        "record": str(tmp / f"{name}.requests.jsonl"),
        **launch.pop("args", {}),
    }
    launch_cfg = {
        "gpus": [0],
        "model_path": "fake-model",
        "command": [sys.executable, str(FAKE), "{model_path}"],
        "args": args,
        "startup_timeout_s": 20,
        "stop_timeout_s": 5,
        "backoff_initial_s": 0.1,
        "backoff_max_s": 0.4,
        **launch,
    }
    return WorkerConfig.model_validate(
        {"name": name, "model": f"{name}-model", "launch": launch_cfg, "warmup": warmup or []}
    )


def resolved(path: Path) -> Path:
    return path.resolve()


def is_dir(path: str) -> bool:
    return Path(path).is_dir()


def state_of(worker: Worker) -> WorkerState:
    """The state now (a call, so mypy does not carry an earlier narrowing over an await)."""
    return worker.state


def info_of(tmp: Path, name: str = "w") -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp / f"{name}.info.json").read_text())
    return data


def pids_of(info: dict[str, Any]) -> list[int]:
    return [info["pid"], info["child"]]


@contextlib.asynccontextmanager
async def supervising(
    tmp: Path, *workers: WorkerConfig, **kw: Any
) -> AsyncIterator[tuple[Supervisor, Registry]]:
    registry = Registry()
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(
            registry, list(workers), ServerConfig(state_dir=str(tmp / "state")), session,
            health_interval_s=0.2, health_timeout_s=0.5, fail_threshold=2, **kw,
        )  # fmt: skip
        await sup.start()
        try:
            yield sup, registry
        finally:
            await sup.stop()


async def ready(sup: Supervisor, name: str = "w", timeout_s: float = 20) -> Worker:
    await sup.wait_for(name, [WorkerState.ready], timeout_s)
    return sup.worker(name)


async def test_starts_warms_and_serves_then_stop_leaves_no_process(tmp_path: Path) -> None:
    warmup: list[dict[str, Any]] = [
        {"prompt": "Say hi"},
        {"prompt": "Two images", "images": [[64, 64], [256, 128]]},
    ]
    cfg = fake_worker(tmp_path, warmup=warmup)
    seen: list[tuple[WorkerState, WorkerState]] = []
    async with supervising(tmp_path, cfg, gpu_cache_keys={"w": "sm_120"}) as (sup, registry):
        registry.on_change(lambda w, old: seen.append((old, w.state)))
        w = await ready(sup)
        info = info_of(tmp_path)
        assert seen == [
            (WorkerState.starting, WorkerState.warming),
            (WorkerState.warming, WorkerState.ready),
        ]
        assert registry.get("w") is w and w.supervised and w.routable
        assert w.max_model_len == 4096 and w.capacity == 2 and w.gpus == [0]
        assert w.url is not None and w.url.startswith("http://127.0.0.1:")
        assert w.pid == os.getpgid(info["pid"]) == os.getpgid(info["child"])
        assert info["env"]["CUDA_VISIBLE_DEVICES"] == "0"
        state = resolved(tmp_path) / "state"
        assert info["env"]["TRITON_CACHE_DIR"] == str(state / "cache/sm_120/triton")
        assert info["env"][TOKEN_ENV]
        assert json.loads((state / "run/w.pid").read_text())["pid"] == w.pid
        assert "Starting vLLM server" in (state / "logs/w.log").read_text()
        bodies = [json.loads(line) for line in (tmp_path / "w.requests.jsonl").open()]
        assert [b["model"] for b in bodies] == ["w-model", "w-model"]
        images = [p for p in bodies[1]["messages"][0]["content"] if p["type"] == "image_url"]
        sizes = [_png_size(base64.b64decode(p["image_url"]["url"].split(",")[1])) for p in images]
        assert sizes == [(64, 64), (256, 128)]
        guard = w.pid or 0
    assert w.state is WorkerState.stopped and not w.routable
    assert not any(is_alive(p) for p in [guard, *pids_of(info)])
    assert not (state / "run/w.pid").exists()


async def test_crash_is_restarted_and_the_old_engine_core_killed(tmp_path: Path) -> None:
    async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, _):
        w = await ready(sup)
        old = info_of(tmp_path)
        os.kill(old["pid"], signal.SIGKILL)
        await _until(lambda: w.state is not WorkerState.ready)
        w = await ready(sup)
        assert w.restarts == 1
        assert w.last_error == "worker process was killed by SIGKILL while serving"
        assert info_of(tmp_path)["pid"] != old["pid"]
        assert not any(is_alive(p) for p in pids_of(old))


async def test_crash_loop_fails_with_the_log_tail(tmp_path: Path) -> None:
    cfg = fake_worker(tmp_path, args={"crash-after-s": 0, "exit-code": 7}, max_restarts=2)
    async with supervising(tmp_path, cfg) as (sup, _):
        await sup.wait_for("w", [WorkerState.failed], 20)
        w = sup.worker("w")
        assert w.restarts == 2
        assert (w.last_error or "").startswith("worker process exited with code 7 during startup")
        assert "giving up" in str(w.last_error)
        assert w.last_log_lines[-1] == "RuntimeError: Triton Error [CUDA]: out of memory"
        assert not any("gpupool: launching" in line for line in w.last_log_lines)
        log = (tmp_path / "state/logs/w.log").read_text()
        assert log.count("===== gpupool: launching") == 3
        assert not is_alive(info_of(tmp_path)["child"])


async def test_frozen_worker_is_killed_and_restarted(tmp_path: Path) -> None:
    async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, _):
        w = await ready(sup)
        old = info_of(tmp_path)
        os.kill(old["pid"], signal.SIGSTOP)
        await _until(lambda: w.state is not WorkerState.ready)
        assert "/health failed 2 times in a row" in (w.last_error or "")
        w = await ready(sup)
        assert w.restarts == 1 and info_of(tmp_path)["pid"] != old["pid"]
        assert not any(is_alive(p) for p in pids_of(old))


async def test_drain_waits_for_inflight_requests_and_keeps_the_process_warm(
    tmp_path: Path,
) -> None:
    """Drain only stops new requests: the process stays up, so Resume is instant (same
    process, ready at once); Stop is its own action and ends the process."""
    async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, _):
        w = await ready(sup)
        pid = info_of(tmp_path)["pid"]
        w.inflight = 1
        drain = asyncio.create_task(sup.drain("w", timeout_s=10))
        await asyncio.sleep(0.6)
        assert w.state is WorkerState.draining and not w.routable and not drain.done()
        w.inflight = 0
        assert await drain is True
        assert w.state is WorkerState.draining and is_alive(pid) and w.url is not None
        await sup.undrain("w")
        assert w.state is WorkerState.ready and info_of(tmp_path)["pid"] == pid  # no restart
        assert await sup.stop_worker("w", timeout_s=10) is True
        assert state_of(w) is WorkerState.stopped
        assert not any(is_alive(p) for p in pids_of(info_of(tmp_path)))
        await sup.undrain("w")
        assert w.state is WorkerState.starting  # what the action leads to, said at once
        await ready(sup)


async def test_drain_timeout_and_undrain_while_draining(tmp_path: Path) -> None:
    async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, _):
        w = await ready(sup)
        pid = info_of(tmp_path)["pid"]
        w.inflight = 1
        drain = asyncio.create_task(sup.drain("w", timeout_s=10))
        await _until(lambda: w.state is WorkerState.draining)
        await sup.undrain("w")
        assert await drain is False
        assert w.state is WorkerState.ready and info_of(tmp_path)["pid"] == pid
        os.kill(pid, signal.SIGKILL)  # the health watch runs again after undrain
        await _until(lambda: w.restarts == 1)
        await ready(sup)
        assert await sup.drain("w", timeout_s=0.2) is False  # still one in flight: it goes on
        assert w.state is WorkerState.draining and is_alive(info_of(tmp_path)["pid"])
        assert await sup.stop_worker("w", timeout_s=0.2) is False  # cut off
        assert state_of(w) is WorkerState.stopped


async def test_stop_escalates_to_sigkill_for_a_worker_ignoring_sigterm(tmp_path: Path) -> None:
    cfg = fake_worker(tmp_path, args={"ignore-sigterm": True}, stop_timeout_s=0.5)
    async with supervising(tmp_path, cfg) as (sup, _):
        w = await ready(sup)
        guard, info = w.pid or 0, info_of(tmp_path)
        started = time.monotonic()
    # without the escalation the stop would wait forever (the worker ignores SIGTERM); the
    # bound is the 0.5 s stop timeout plus slack for a loaded machine (3 s ran out beside two
    # CPU burners: 3.3 s)
    assert time.monotonic() - started < 15
    assert w.state is WorkerState.stopped
    assert not any(is_alive(p) for p in [guard, *pids_of(info)])


async def test_restart_add_and_remove(tmp_path: Path) -> None:
    async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, registry):
        await ready(sup)
        first = info_of(tmp_path)
        await sup.restart("w")
        assert sup.worker("w").state is WorkerState.starting  # not "stopped": where it goes
        await ready(sup)
        assert info_of(tmp_path)["pid"] != first["pid"]
        assert not any(is_alive(p) for p in pids_of(first))
        await sup.add(fake_worker(tmp_path, name="extra"))
        await ready(sup, "extra")
        extra = info_of(tmp_path, "extra")
        await sup.remove("extra")
        assert registry.get("extra") is None and sup.names() == ["w"]
        assert not any(is_alive(p) for p in pids_of(extra))


async def test_slow_start_is_waited_for(tmp_path: Path) -> None:
    cfg = fake_worker(tmp_path, args={"startup-delay": 1.5}, startup_timeout_s=15)
    async with supervising(tmp_path, cfg) as (sup, _):
        started = time.monotonic()
        w = await ready(sup)
        assert time.monotonic() - started >= 1.4 and w.restarts == 0


async def test_start_slower_than_startup_timeout_fails(tmp_path: Path) -> None:
    cfg = fake_worker(tmp_path, args={"startup-delay": 60}, startup_timeout_s=1.0)
    async with supervising(tmp_path, cfg) as (sup, _):
        await sup.wait_for("w", [WorkerState.failed], 10)
        w = sup.worker("w")
        assert (w.last_error or "").startswith("not ready within startup_timeout_s=1 s")
        assert w.restarts == 0
        assert not any(is_alive(p) for p in pids_of(info_of(tmp_path)))


_GPUPOOL_SCRIPT = """
import asyncio, sys
import aiohttp
from gpupool.config.models import ServerConfig, WorkerConfig
from gpupool.workers.registry import Registry, WorkerState
from gpupool.workers.supervisor import Supervisor

async def main() -> None:
    cfg = WorkerConfig.model_validate_json(sys.argv[1])
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(Registry(), [cfg], ServerConfig(state_dir=sys.argv[2]), session)
        await sup.start()
        await sup.wait_for(cfg.name, [WorkerState.ready], 30)
        print("READY", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_gpupool_killed_by_sigkill_leaves_no_orphan(tmp_path: Path) -> None:
    state = tmp_path / "state"
    gpupool = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _GPUPOOL_SCRIPT, fake_worker(tmp_path).model_dump_json(), str(state),
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
    )  # fmt: skip
    assert gpupool.stdout is not None
    try:
        assert await asyncio.wait_for(gpupool.stdout.readline(), 30) == b"READY\n"
    finally:
        gpupool.kill()
        await gpupool.wait()
    guard = json.loads((state / "run/w.pid").read_text())["pid"]
    survivors = [guard, *pids_of(info_of(tmp_path))]
    await _until(lambda: not any(is_alive(p) for p in survivors), timeout_s=5)


async def test_stale_processes_of_a_previous_run_are_killed_at_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "state/run"
    run_dir.mkdir(parents=True)
    old_info = tmp_path / "old.json"
    env = {**os.environ, TOKEN_ENV: "previous-run"}
    stale = await asyncio.create_subprocess_exec(
        sys.executable, str(FAKE), "--info-file", str(old_info), "--port", "0",
        env=env, start_new_session=True, stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    # a recycled pid: the pid file names a process that never carried the token
    innocent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)"
    )
    try:
        await _until(old_info.exists)
        record = {"pid": stale.pid, "pgid": stale.pid, "token": "previous-run", "argv": []}
        (run_dir / "w.pid").write_text(json.dumps(record))
        gone = {"pid": innocent.pid, "pgid": innocent.pid, "token": "previous-run", "argv": []}
        (run_dir / "removed-worker.pid").write_text(json.dumps(gone))
        stale_pids = pids_of(json.loads(old_info.read_text()))
        async with supervising(tmp_path, fake_worker(tmp_path)) as (sup, _):
            assert not any(is_alive(p) for p in stale_pids)
            assert is_alive(innocent.pid)
            assert not (run_dir / "removed-worker.pid").exists()
            await ready(sup)
    finally:
        for proc in (stale, innocent):
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def test_the_gpupool_simulator_runs_under_the_supervisor(tmp_path: Path) -> None:
    pytest.importorskip("gpupool.workers.sim.cli")
    cfg = WorkerConfig.model_validate(
        {
            "name": "sim",
            "model": "qwen-sim",
            "launch": {
                "model_path": "/models/qwen",
                "command": [sys.executable, "-m", "gpupool.workers.sim", "--model", "{model_path}"],
                "args": {"max-model-len": "32k", "max-num-seqs": 4},
                "startup_timeout_s": 30,
            },
            "warmup": [{"prompt": "Say hi", "max_tokens": 4}],
        }
    )
    async with supervising(tmp_path, cfg) as (sup, _):
        w = await ready(sup, "sim", timeout_s=30)
        assert w.max_model_len == 32768 and w.capacity == 4 and w.last_error is None


async def test_start_after_waits_for_the_big_card_to_be_ready(tmp_path: Path) -> None:
    """Seed 000: the small card starts only once the big one has warmed the shared cache."""
    big = fake_worker(tmp_path, "big", args={"startup-delay": 1.0})
    small = fake_worker(tmp_path, "small", start_after=["big"])
    registry = Registry()
    async with aiohttp.ClientSession() as session:
        sup = Supervisor(registry, [big, small], ServerConfig(state_dir=str(tmp_path)), session)
        await sup.start()
        try:
            # as soon as small says it waits, not 0.6 s on (a stall past big's 1-s start runs it)
            await _until(lambda: "waiting for big" in (sup.worker("small").last_error or ""))
            assert sup.worker("small").pid is None  # not launched yet
            await sup.wait_for("small", {WorkerState.ready}, 30)
            assert sup.worker("big").state is WorkerState.ready
        finally:
            await sup.stop()
