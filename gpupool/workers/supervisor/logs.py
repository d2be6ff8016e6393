"""Worker log files: ``<state_dir>/logs/<worker>.log``, appended across restarts.

Each launch appends a marker line, so the tail of *this* run is found after the last marker.
A log past ``max_bytes`` is moved to ``<worker>.log.1`` (one generation kept) before a launch.
Every function blocks: call them via ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import BinaryIO

MARKER = "===== gpupool: launching "
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
_TAIL_BYTES = 64 * 1024


def open_for_launch(path: Path, argv: list[str], max_bytes: int = DEFAULT_MAX_BYTES) -> BinaryIO:
    """Rotate if large, append a launch marker, and return the file opened for appending."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > max_bytes:
        os.replace(path, path.with_name(path.name + ".1"))
    log = path.open("ab")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    log.write(f"\n{MARKER}{stamp}: {shlex.join(argv)}\n".encode())
    log.flush()
    return log


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines written since the last launch marker."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    run = text.rpartition(MARKER)[2] if MARKER in text else text
    body = run.splitlines()[1:] if MARKER in text else run.splitlines()
    return [line for line in body if line.strip()][-lines:]
