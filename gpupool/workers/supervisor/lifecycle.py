"""One supervised worker's life, run as one asyncio task.

    starting ──probe ready──▶ warming ──warm-up sent──▶ ready ──▶ health watch
       │  ▲                                                         │
       │  └──── backoff ◀── crash (exit, or /health failing N times: SIGKILL the group)
       └─ startup_timeout_s ─▶ failed        too many crashes in restart_window_s ─▶ failed

Every state change goes through ``registry.transition``. Draining and stopping belong to the
``Supervisor``: it cancels this task first, so a stop is never mistaken for a crash.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from gpupool.config.models import LaunchConfig, ModelConfig, WorkerConfig
from gpupool.workers.probe import ProbeResult, probe
from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.supervisor.clock import Clock
from gpupool.workers.supervisor.command import (
    WORKER_HOST,
    build_command,
    build_env,
    capacity_of,
    kv_events,
    kv_socket_dir,
)
from gpupool.workers.supervisor.policy import CrashWindow, backoff_delay
from gpupool.workers.supervisor.ports import free_port
from gpupool.workers.supervisor.process import Launcher, LaunchSpec, WorkerProcess
from gpupool.workers.supervisor.warmup import health_ok, send_warmup

logger = logging.getLogger(__name__)

_CACHE_ENV = ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR")


@dataclass(frozen=True, slots=True)
class Settings:
    state_dir: Path
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    fail_threshold: int = 3
    probe_interval_s: float = 0.5
    probe_timeout_s: float = 5.0
    log_tail_lines: int = 20
    kv_seed: str | None = None  # set: workers publish KV-cache events (``command.kv_events``)


@dataclass(frozen=True, slots=True)
class Seams:
    """What every worker's task shares: the registry and the replaceable I/O."""

    registry: Registry
    session: aiohttp.ClientSession
    launcher: Launcher
    clock: Clock
    rng: random.Random
    settings: Settings
    # Per worker, awaited before every launch: a swap group's turn on the GPU (workers/swap).
    gates: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Failure:
    message: str
    restartable: bool = True


def describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _make_cache_dirs(env: dict[str, str]) -> None:
    for key in _CACHE_ENV:
        if env.get(key):
            Path(env[key]).mkdir(parents=True, exist_ok=True)


class WorkerRun:
    """The task and process of one ``launch:`` worker."""

    def __init__(
        self,
        cfg: WorkerConfig,
        launch: LaunchConfig,
        worker: Worker,
        seams: Seams,
        cache_key: str | None,
        model: ModelConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.launch = launch
        self.worker = worker
        self.seams = seams
        self.cache_key = cache_key
        self.crashes = CrashWindow(launch.max_restarts, launch.restart_window_s)
        self.proc: WorkerProcess | None = None
        self.url: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._launched_once = False

    # -- control, used by the Supervisor ---------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def active(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, *, resume: bool = False) -> None:
        """Run the lifecycle task; ``resume`` watches the current process instead of launching."""
        if not self.active:
            self._task = asyncio.create_task(self._run(resume), name=f"gpupool-{self.cfg.name}")

    async def cancel(self) -> None:
        task, self._task = self._task, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise

    async def stop_process(self, *, graceful: bool = True) -> None:
        proc = self.proc
        if proc is None:
            return
        if graceful:
            await proc.terminate(self.launch.stop_timeout_s)
        else:
            await proc.kill()
        self.proc = None
        self.worker.pid = None

    def transition(self, state: WorkerState) -> None:
        self.seams.registry.transition(self.worker, state)

    # -- the task --------------------------------------------------------------------------------

    async def _wait_for_dependencies(self) -> None:
        """``start_after``: wait until those workers are ready (or have failed, then go on)."""
        deps = self.launch.start_after
        registry = self.seams.registry
        settled = (WorkerState.ready, WorkerState.failed, WorkerState.stopped)
        while True:
            waiting = [d for d in deps if (w := registry.get(d)) and w.state not in settled]
            if not waiting:
                return
            self.worker.last_error = f"waiting for {', '.join(waiting)} to be ready first"
            await asyncio.sleep(0.5)

    async def _run(self, resume: bool) -> None:
        try:
            while True:
                failure = await (self._watch() if resume else self._bring_up())
                resume = False
                if not await self._recover(failure):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave the worker silently stuck
            logger.exception("worker %s: supervisor task failed", self.cfg.name)
            self.worker.last_error = f"supervisor error: {type(e).__name__}: {e}"
            self.transition(WorkerState.failed)

    async def _bring_up(self) -> Failure:
        """Launch, wait for readiness, warm up, then watch. Returns only on failure."""
        self.worker.url = None
        self.transition(WorkerState.starting)
        if not self._launched_once:
            await self._wait_for_dependencies()
        self._launched_once = True
        gate = self.seams.gates.get(self.cfg.name)
        if gate is not None:
            await gate()
        try:
            proc = await self._launch()
        except OSError as e:
            return Failure(f"cannot start the worker: {e}")
        ready = await self._wait_ready(proc)
        if isinstance(ready, Failure):
            return ready
        self.transition(WorkerState.warming)
        await self._warm_up(proc)
        if proc.returncode is not None:
            return Failure(f"worker process {describe_exit(proc.returncode)} while warming up")
        self._mark_ready(proc, ready)
        return await self._watch()

    async def _launch(self) -> WorkerProcess:
        port = self.launch.port or free_port(WORKER_HOST)
        settings = self.seams.settings
        argv = build_command(self.cfg, port, self.model)
        env = build_env(self.cfg, self.cache_key, settings.state_dir, model=self.model)
        if settings.kv_seed is not None:
            sock_dir = kv_socket_dir(settings.state_dir)
            await asyncio.to_thread(sock_dir.mkdir, parents=True, exist_ok=True)
            argv, env, self.worker.kv_source = kv_events(self.cfg, argv, env, settings.kv_seed,
                                                         sock_dir)  # fmt: skip
        await asyncio.to_thread(_make_cache_dirs, env)
        self.url = f"http://{WORKER_HOST}:{port}"
        self.proc = await self.seams.launcher.launch(LaunchSpec(self.cfg.name, argv, env))
        self.worker.pid = self.proc.pid
        logger.info("worker %s: started pid %d on port %d", self.cfg.name, self.proc.pid, port)
        return self.proc

    async def _wait_ready(self, proc: WorkerProcess) -> ProbeResult | Failure:
        clock, settings = self.seams.clock, self.seams.settings
        deadline = clock.now() + self.launch.startup_timeout_s
        while True:
            if proc.returncode is not None:
                return Failure(f"worker process {describe_exit(proc.returncode)} during startup")
            result = await probe(
                self.seams.session, self._url(), self.cfg.model, settings.probe_timeout_s
            )
            if result.ready:
                return result
            if clock.now() >= deadline:
                return Failure(
                    f"not ready within startup_timeout_s={self.launch.startup_timeout_s:g} s "
                    f"(last probe: {result.error})",
                    restartable=False,
                )
            await self._sleep_or_exit(proc, settings.probe_interval_s)

    async def _warm_up(self, proc: WorkerProcess) -> None:
        errors = []
        items = self.cfg.warmup
        for i, item in enumerate(items, 1):
            if proc.returncode is not None:
                return
            error = await send_warmup(
                self.seams.session, self._url(), self.cfg.model, item, self.launch.startup_timeout_s
            )
            if error is not None:
                errors.append(f"warmup {i}/{len(items)}: {error}")
        if errors:
            self.worker.last_error = "; ".join(errors)
            logger.warning("worker %s: %s", self.cfg.name, self.worker.last_error)

    def _mark_ready(self, proc: WorkerProcess, ready: ProbeResult) -> None:
        worker = self.worker
        worker.url = self._url()
        worker.max_model_len = ready.max_model_len
        worker.pid = proc.pid
        worker.gpus = self.launch.gpus
        worker.capacity = capacity_of(self.cfg) or worker.capacity
        worker.consecutive_failures = 0
        self.transition(WorkerState.ready)

    async def _watch(self) -> Failure:
        proc, settings, worker = self._proc(), self.seams.settings, self.worker
        worker.consecutive_failures = 0
        while True:
            await self._sleep_or_exit(proc, settings.health_interval_s)
            if proc.returncode is not None:
                return Failure(f"worker process {describe_exit(proc.returncode)} while serving")
            if await health_ok(self.seams.session, self._url(), settings.health_timeout_s):
                worker.consecutive_failures = 0
                continue
            worker.consecutive_failures += 1
            if worker.consecutive_failures >= settings.fail_threshold:
                return Failure(
                    f"/health failed {worker.consecutive_failures} times in a row while the "
                    "process was alive (hung or stopped); killed its process group"
                )

    async def _recover(self, failure: Failure) -> bool:
        """Reap the process and record why; True after the backoff when a restart should follow."""
        worker, launch = self.worker, self.launch
        worker.url = None
        lines = await self._reap()
        worker.last_error = failure.message
        worker.last_log_lines = lines
        logger.warning("worker %s: %s", self.cfg.name, failure.message)
        if not failure.restartable:
            self.transition(WorkerState.failed)
            return False
        crashes = self.crashes.record(self.seams.clock.now())
        if self.crashes.exhausted():
            worker.last_error += (
                f"; {crashes} crashes within restart_window_s={launch.restart_window_s:g} s "
                f"(max_restarts={launch.max_restarts}): giving up"
            )
            self.transition(WorkerState.failed)
            return False
        worker.restarts += 1
        self.transition(WorkerState.starting)
        jitter = self.seams.rng.uniform(-1.0, 1.0)
        delay = backoff_delay(crashes - 1, launch.backoff_initial_s, launch.backoff_max_s, jitter)
        logger.info("worker %s: restarting in %.1f s", self.cfg.name, delay)
        await self.seams.clock.sleep(delay)
        return True

    async def _reap(self) -> list[str]:
        proc = self.proc
        if proc is None:
            return []
        await proc.kill()
        self.proc = None  # only now: a stop cancelling this still finds the process to kill
        self.worker.pid = None
        return await proc.log_tail(self.seams.settings.log_tail_lines)

    async def _sleep_or_exit(self, proc: WorkerProcess, seconds: float) -> None:
        """Sleep ``seconds``, waking early when the process exits."""
        waits: list[Awaitable[object]] = [proc.wait(), self.seams.clock.sleep(seconds)]
        tasks = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    def _proc(self) -> WorkerProcess:
        if self.proc is None:
            raise RuntimeError(f"worker {self.cfg.name} has no process")
        return self.proc

    def _url(self) -> str:
        if self.url is None:
            raise RuntimeError(f"worker {self.cfg.name} has no address")
        return self.url
