"""Starting and stopping worker processes, behind the ``Launcher`` seam.

The supervisor only sees ``Launcher.launch(spec) -> WorkerProcess``; a test fake is one class.
The real ``SubprocessLauncher``:

* kills what a previous gpupool run left behind for this worker (pid file + token, see
  ``procfs``) before starting anything, so a restarted gpupool never finds the GPU still held;
* appends stdout and stderr to ``<state_dir>/logs/<worker>.log``;
* starts the command with ``asyncio.create_subprocess_exec(..., start_new_session=True)``, so the
  worker and everything it forks (vLLM's EngineCore) form one process group that stop and kill
  signal as a whole;
* puts ``guard.py`` between gpupool and the command, which SIGKILLs that group when gpupool dies.

Why the guard rather than ``prctl(PR_SET_PDEATHSIG)`` in a ``preexec_fn``: asyncio does accept
``preexec_fn``, but Python documents it as unsafe when the parent has threads (aiohttp's resolver,
``asyncio.to_thread`` and the child watcher all run threads here: the forked child can deadlock
before ``exec``), and a parent-death signal set on the vLLM process would be cleared in the
EngineCore it forks, leaving EngineCore alive with its GPU memory when gpupool is SIGKILLed. The
guard arms the signal on itself after ``exec`` (no ``preexec_fn``) and kills the whole group.
Linux only: it reads ``/proc`` and relies on ``prctl``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpupool.workers.supervisor import logs, procfs
from gpupool.workers.supervisor.guard import PARENT_ENV

logger = logging.getLogger(__name__)

GUARD_SCRIPT = Path(__file__).with_name("guard.py")


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    name: str
    argv: list[str]
    env: dict[str, str]


class WorkerProcess(Protocol):
    """One running worker: its process group, exit status and log."""

    @property
    def pid(self) -> int:
        """Pid of the process-group leader."""
        ...

    @property
    def returncode(self) -> int | None:
        """None while running; negative for death by a signal."""
        ...

    async def wait(self) -> int: ...

    async def terminate(self, timeout_s: float) -> int:
        """SIGTERM the group, wait up to ``timeout_s`` for it to go, then SIGKILL what is left."""
        ...

    async def kill(self) -> int:
        """SIGKILL the whole group now (works on a SIGSTOPped one) and wait for it."""
        ...

    async def log_tail(self, lines: int) -> list[str]:
        """The last lines this launch wrote."""
        ...


class Launcher(Protocol):
    async def launch(self, spec: LaunchSpec) -> WorkerProcess:
        """Start one worker (after killing what a previous run left for the same name)."""
        ...

    async def cleanup_stale(self) -> list[int]:
        """Kill what a previous run left for *any* worker (also ones no longer configured)."""
        ...


class SubprocessLauncher:
    """Real processes, each in its own group, under a guard that dies with gpupool."""

    def __init__(self, state_dir: str | os.PathLike[str], group_exit_timeout_s: float = 10.0):
        root = Path(os.path.abspath(state_dir))
        self._log_dir = root / "logs"
        self._run_dir = root / "run"
        self._group_exit_timeout_s = group_exit_timeout_s

    def log_path(self, name: str) -> Path:
        return self._log_dir / f"{name}.log"

    def pid_path(self, name: str) -> Path:
        return self._run_dir / f"{name}.pid"

    async def launch(self, spec: LaunchSpec) -> WorkerProcess:
        pid_path = self.pid_path(spec.name)
        await self.kill_stale(spec.name)
        log = await asyncio.to_thread(logs.open_for_launch, self.log_path(spec.name), spec.argv)
        token = secrets.token_hex(16)
        try:
            proc = await self._spawn(spec, log.fileno(), token)
        finally:
            log.close()
        handle = _GroupProcess(proc, pid_path, self.log_path(spec.name), self._group_exit_timeout_s)
        record = procfs.PidRecord(proc.pid, proc.pid, token, spec.argv)
        try:
            await asyncio.to_thread(procfs.write_pid_file, pid_path, record)
        except BaseException:
            await handle.kill()
            raise
        return handle

    async def kill_stale(self, name: str) -> list[int]:
        """Kill what a previous run left for ``name`` (verified by token); return the pids."""
        await asyncio.to_thread(self._run_dir.mkdir, parents=True, exist_ok=True)
        killed = await asyncio.to_thread(procfs.kill_stale, self.pid_path(name))
        if killed:
            logger.warning("worker %s: killed %d stale process(es) %s", name, len(killed), killed)
        return killed

    async def cleanup_stale(self) -> list[int]:
        names = await asyncio.to_thread(self._pid_file_names)
        killed: list[int] = []
        for name in names:
            killed += await self.kill_stale(name)
        return killed

    def _pid_file_names(self) -> list[str]:
        if not self._run_dir.is_dir():
            return []
        return sorted(p.stem for p in self._run_dir.glob("*.pid"))

    async def _spawn(self, spec: LaunchSpec, log_fd: int, token: str) -> asyncio.subprocess.Process:
        env = {**spec.env, procfs.TOKEN_ENV: token, PARENT_ENV: str(os.getpid())}
        return await asyncio.create_subprocess_exec(
            sys.executable,
            str(GUARD_SCRIPT),
            "--",
            *spec.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_fd,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


class _GroupProcess:
    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        pid_path: Path,
        log_path: Path,
        group_exit_timeout_s: float,
    ) -> None:
        self._proc = proc
        self._pid_path = pid_path
        self._log_path = log_path
        self._group_exit_timeout_s = group_exit_timeout_s

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        return await self._proc.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    async def terminate(self, timeout_s: float) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        self._signal_group(signal.SIGTERM)
        with suppress(TimeoutError):
            await asyncio.wait_for(self._proc.wait(), timeout_s)
        remaining = deadline - loop.time()
        if remaining > 0:
            await asyncio.to_thread(procfs.wait_group_gone, self.pid, remaining)
        return await self.kill()

    async def kill(self) -> int:
        if self.returncode is None or await self._group_alive():
            self._signal_group(signal.SIGKILL)
        code = await self._proc.wait()
        timeout = self._group_exit_timeout_s
        if not await asyncio.to_thread(procfs.wait_group_gone, self.pid, timeout):
            logger.error("process group %d still alive %.0f s after SIGKILL", self.pid, timeout)
        await asyncio.to_thread(procfs.remove_file, self._pid_path)
        return code

    async def _group_alive(self) -> bool:
        return bool(await asyncio.to_thread(procfs.group_members, self.pid))

    async def log_tail(self, lines: int) -> list[str]:
        return await asyncio.to_thread(logs.tail, self._log_path, lines)
