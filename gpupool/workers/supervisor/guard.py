"""The guard: a tiny process between gpupool and a worker that ties the worker's life to gpupool's.

Run by path (stdlib only, imports nothing from gpupool)::

    python guard.py -- vllm serve MODEL --port 8101 ...

The guard is started as the leader of a new process group (``start_new_session=True``). It asks
the kernel for a parent-death signal (``prctl(PR_SET_PDEATHSIG)``) on *itself*, then runs the
worker as its child in the same group. If gpupool dies, even by SIGKILL, the guard receives that
signal and SIGKILLs its whole group: the vLLM API server *and* the EngineCore process it forked.
A parent-death signal set on the vLLM process directly would not be enough: the kernel clears it
on fork, so EngineCore would outlive gpupool holding GPU memory.

SIGTERM/SIGINT sent to the group reach the worker directly; the guard ignores them and waits, so
the worker can shut down gracefully. The guard exits as its worker did (same code, or the same
signal), so gpupool sees the worker's exit status.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from types import FrameType

PARENT_ENV = "GPUPOOL_GUARD_PARENT"
PARENT_DEATH_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1


def _kill_group(signum: int = 0, frame: FrameType | None = None) -> None:
    os.killpg(0, signal.SIGKILL)


def _wait_for_worker(signum: int, frame: FrameType | None) -> None:
    """SIGTERM/SIGINT: the worker got it too (same group); the guard stays to report its exit."""


def _arm_parent_death_signal() -> None:
    signal.signal(PARENT_DEATH_SIGNAL, _kill_group)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: stale pid files still let the next run clean up
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit() and os.getppid() != int(parent):
        _kill_group()  # gpupool died before the signal was armed


def _exit_like(returncode: int) -> int:
    if returncode >= 0:
        return returncode
    with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its default anyway
        signal.signal(-returncode, signal.SIG_DFL)
    os.kill(os.getpid(), -returncode)
    return 128 - returncode


def main(argv: list[str]) -> int:
    command = argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("gpupool guard: no command given", file=sys.stderr)
        return 2
    _arm_parent_death_signal()
    signal.signal(signal.SIGTERM, _wait_for_worker)
    signal.signal(signal.SIGINT, _wait_for_worker)
    try:
        child = subprocess.Popen(command)
    except OSError as e:
        print(f"gpupool guard: cannot start `{command[0]}`: {e}", file=sys.stderr, flush=True)
        return 127
    return _exit_like(child.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
