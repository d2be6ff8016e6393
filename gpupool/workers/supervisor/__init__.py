"""Supervision of ``launch:`` workers: vLLM processes gpupool starts, warms, watches and stops.

Modules: ``command`` (pure: argv, environment, capacity, media limits), ``process`` (the
``Launcher`` seam and the real subprocess launcher, with ``guard`` and ``procfs``), ``logs``,
``warmup``, ``policy`` (backoff, crash window), ``clock``, ``lifecycle`` (one worker's task) and
``supervisor`` (the pool and its administrative operations).
"""

from gpupool.workers.supervisor.clock import Clock, MonotonicClock
from gpupool.workers.supervisor.command import (
    build_command,
    build_env,
    cache_dir,
    capacity_of,
    check_launch,
    media_limits_of,
)
from gpupool.workers.supervisor.errors import (
    LaunchConfigError,
    SupervisorError,
    UnknownWorker,
    WorkerExists,
)
from gpupool.workers.supervisor.gpus import detect_cache_keys
from gpupool.workers.supervisor.process import (
    Launcher,
    LaunchSpec,
    SubprocessLauncher,
    WorkerProcess,
)
from gpupool.workers.supervisor.supervisor import Supervisor
from gpupool.workers.supervisor.warmup import png_bytes, png_data_uri

__all__ = [
    "Clock",
    "LaunchConfigError",
    "LaunchSpec",
    "Launcher",
    "MonotonicClock",
    "SubprocessLauncher",
    "Supervisor",
    "SupervisorError",
    "UnknownWorker",
    "WorkerExists",
    "WorkerProcess",
    "build_command",
    "build_env",
    "cache_dir",
    "capacity_of",
    "check_launch",
    "detect_cache_keys",
    "media_limits_of",
    "png_bytes",
    "png_data_uri",
]
