"""The supervisor: every ``launch:`` worker's process, lifecycle and administrative control.

Workers with ``url:`` are not supervised (the remote poller watches them) and are skipped.
The supervisor writes worker state only through ``registry.transition``; routing sends new
requests only to ``ready`` workers, so ``draining`` is enough to stop new traffic.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import aiohttp

from gpupool.config.models import ModelConfig, ServerConfig, WorkerConfig
from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.supervisor.clock import Clock, MonotonicClock
from gpupool.workers.supervisor.command import capacity_of, check_launch, media_limits_of
from gpupool.workers.supervisor.errors import LaunchConfigError, UnknownWorker, WorkerExists
from gpupool.workers.supervisor.lifecycle import Seams, Settings, WorkerRun
from gpupool.workers.supervisor.process import Launcher, SubprocessLauncher

_POLL_S = 0.05


class Supervisor:
    """Starts, watches, restarts, drains and stops supervised vLLM workers."""

    def __init__(
        self,
        registry: Registry,
        workers: list[WorkerConfig],
        server_cfg: ServerConfig,
        session: aiohttp.ClientSession,
        launcher: Launcher | None = None,
        clock: Clock | None = None,
        gpu_cache_keys: dict[str, str] | None = None,
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 5.0,
        fail_threshold: int = 3,
        rng: random.Random | None = None,
        models: Sequence[ModelConfig] = (),
        kv_seed: str | None = None,
    ) -> None:
        """``gpu_cache_keys`` maps a worker name to its GPU's architecture and compute capability
        (for example ``"sm_120"``); workers with one key share compile and Triton caches.
        ``models``: the workers' models, whose settings add vLLM flags (``command.model_flags``).
        ``kv_seed``: launched workers publish KV-cache events, with this PYTHONHASHSEED."""
        state_dir = Path(os.path.abspath(server_cfg.state_dir))
        settings = Settings(state_dir, health_interval_s, health_timeout_s, fail_threshold,
                            kv_seed=kv_seed)  # fmt: skip
        self._seams = Seams(
            registry=registry,
            session=session,
            launcher=launcher or SubprocessLauncher(state_dir),
            clock=clock or MonotonicClock(),
            rng=rng or random.Random(),
            settings=settings,
        )
        self._cache_keys = dict(gpu_cache_keys or {})
        self._models = {m.name: m for m in models}
        self._runs: dict[str, WorkerRun] = {}
        self._started = False
        self._gate_of: Callable[[str], Callable[[], Awaitable[None]] | None] | None = None
        for cfg in workers:
            if cfg.launch is not None:
                self._runs[cfg.name] = self._new_run(cfg)

    def use_launch_gates(
        self, gate_of: Callable[[str], Callable[[], Awaitable[None]] | None]
    ) -> None:
        """Await ``gate_of(name)()`` before each launch of worker ``name`` (swap groups), also
        for workers added later (a reload)."""
        self._gate_of = gate_of
        for name in self._runs:
            gate = gate_of(name)
            if gate is not None:
                self._seams.gates[name] = gate

    # -- reading ---------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._runs)

    def worker(self, name: str) -> Worker:
        return self._run(name).worker

    # -- whole pool ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Kill leftovers of a previous run, then start every worker concurrently.

        Returns once the lifecycle tasks run; readiness comes later (see ``wait_for``).
        """
        self._started = True
        await self._seams.launcher.cleanup_stale()
        for run in self._runs.values():
            self._activate(run)

    async def stop(self) -> None:
        """SIGTERM every process group, SIGKILL after ``stop_timeout_s``; all → stopped."""
        await asyncio.gather(*(self._halt(run) for run in self._runs.values()))

    # -- one worker ------------------------------------------------------------------------------

    async def drain(self, name: str, timeout_s: float) -> bool:
        """Stop new traffic and wait for in-flight requests (up to ``timeout_s``; past it they
        go on). The process stays up and warm, so ``undrain`` is instant; stopping it is its
        own action (:meth:`stop_worker`). A member of a swap group is stopped once idle, as
        before: its GPU is shared, and a warm drained process would hold it.

        True when the worker went idle; False when the timeout came first, or ``undrain``
        cancelled the drain (the worker then serves again). Its health watch pauses while it
        is drained and resumes with ``undrain`` (a process that died meanwhile is restarted).
        """
        run = self._run(name)
        await run.cancel()
        if not run.running:
            await self._halt(run)
            return True
        run.transition(WorkerState.draining)
        idle = await self._wait_idle(run.worker, timeout_s)
        if run.worker.state is not WorkerState.draining:
            return False
        if run.worker.swap_group is not None:
            await self._halt(run)
        return idle

    async def stop_worker(self, name: str, timeout_s: float) -> bool:
        """Drain (up to ``timeout_s``), then stop the process (SIGTERM, SIGKILL after
        ``stop_timeout_s``): ``stopped``, its GPU free; ``undrain`` starts it again (a cold
        start). True when it went idle before stopping; False when the timeout cut requests
        off, or ``undrain`` cancelled it (the worker then keeps running)."""
        run = self._run(name)
        idle = await self.drain(name, timeout_s)
        if run.worker.state is WorkerState.draining:
            await self._halt(run)
        return idle and run.worker.state is WorkerState.stopped

    async def undrain(self, name: str) -> None:
        """Back to ``ready`` at once if the drained process still runs, else start it again
        (``starting`` from here; ready once it answers).

        A ``failed`` worker is started again too, with a fresh crash window.
        """
        run = self._run(name)
        state = run.worker.state
        if state is WorkerState.draining and run.running:
            run.transition(WorkerState.ready)
            run.start(resume=True)
        elif state in (WorkerState.draining, WorkerState.stopped, WorkerState.failed):
            run.crashes.clear()
            await run.cancel()
            run.transition(WorkerState.starting)
            run.start()

    async def restart(self, name: str) -> None:
        """Stop (gracefully) and start again with a fresh crash window (also leaves ``failed``):
        ``starting`` from here, ready once it answers."""
        run = self._run(name)
        await self._halt(run)
        run.crashes.clear()
        run.transition(WorkerState.starting)
        run.start()

    async def add(self, cfg: WorkerConfig, model: ModelConfig | None = None) -> None:
        """Supervise a new worker (config reload); started now if the pool is running."""
        if model is not None:
            self._models[model.name] = model
        if cfg.name in self._runs:
            raise WorkerExists(cfg.name)
        if cfg.launch is None:
            raise LaunchConfigError([f"workers.{cfg.name}: has no `launch` section"])
        run = self._runs[cfg.name] = self._new_run(cfg)
        gate = self._gate_of(cfg.name) if self._gate_of is not None else None
        if gate is not None:
            self._seams.gates[cfg.name] = gate
        if self._started:
            self._activate(run)

    async def remove(self, name: str) -> None:
        """Stop a worker and forget it (config reload). Drain first for a graceful removal."""
        run = self._run(name)
        del self._runs[name]
        await self._halt(run)
        self._seams.registry.remove(name)

    async def wait_for(
        self, name: str, states: Iterable[WorkerState], timeout_s: float
    ) -> WorkerState:
        """Wait until the worker is in one of ``states``; TimeoutError after ``timeout_s``."""
        wanted, worker, clock = set(states), self.worker(name), self._seams.clock
        deadline = clock.now() + timeout_s
        while worker.state not in wanted:
            if clock.now() >= deadline:
                raise TimeoutError(f"worker {name} is {worker.state}, not {sorted(wanted)}")
            await clock.sleep(_POLL_S)
        return worker.state

    # -- internals -------------------------------------------------------------------------------

    def _run(self, name: str) -> WorkerRun:
        try:
            return self._runs[name]
        except KeyError:
            raise UnknownWorker(name) from None

    def _new_run(self, cfg: WorkerConfig) -> WorkerRun:
        if cfg.launch is None:
            raise LaunchConfigError([f"workers.{cfg.name}: has no `launch` section"])
        problems = check_launch(cfg.launch)
        if problems:
            raise LaunchConfigError([f"workers.{cfg.name}.{p}" for p in problems])
        worker = self._seams.registry.get(cfg.name) or _new_worker(cfg)
        worker.supervised = True
        worker.gpus = cfg.launch.gpus
        cache_key = self._cache_keys.get(cfg.name)
        model = self._models.get(cfg.model)
        return WorkerRun(cfg, cfg.launch, worker, self._seams, cache_key, model)

    def _activate(self, run: WorkerRun) -> None:
        self._seams.registry.add(run.worker)
        run.start()

    async def _halt(self, run: WorkerRun) -> None:
        await run.cancel()
        await run.stop_process(graceful=True)
        run.worker.url = None
        run.transition(WorkerState.stopped)

    async def _wait_idle(self, worker: Worker, timeout_s: float) -> bool:
        clock = self._seams.clock
        deadline = clock.now() + timeout_s
        while worker.inflight > 0 and worker.state is WorkerState.draining:
            if clock.now() >= deadline:
                return False
            await clock.sleep(_POLL_S)
        return worker.inflight == 0


def _new_worker(cfg: WorkerConfig) -> Worker:
    """A registry entry for a worker the caller did not register (it may register its own,
    for example with media limits from the model's configuration; those are kept)."""
    worker = Worker(name=cfg.name, model=cfg.model, max_model_len_override=cfg.max_model_len)
    worker.media = media_limits_of(cfg)
    worker.capacity = capacity_of(cfg) or worker.capacity
    return worker
