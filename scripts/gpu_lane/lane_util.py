"""The lane's shared state: paths, the time budget, the log, the results written as they come."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Lane:
    """One phase of the check: where things live, how long is left, what was found."""

    phase: str
    out: Path
    work: Path
    deadline: float
    python: str = sys.executable
    results: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    @property
    def log_path(self) -> Path:
        return self.out / f"log-{self.phase}.txt"

    @property
    def result_path(self) -> Path:
        return self.out / f"result-{self.phase}.json"

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, *parts: object) -> None:
        line = f"[{self.elapsed():6.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def put(self, key: str, value: Any) -> None:
        self.results[key] = value
        self.save()

    def save(self) -> None:
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        os.replace(tmp, self.result_path)


def sh(argv: list[str], timeout: float = 60, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a command; its exit code and output (never raises for a failing command)."""
    try:
        p = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"rc": None, "out": f"{type(e).__name__}: {e}"}
    return {"rc": p.returncode, "out": (p.stdout + p.stderr)[-20000:]}


def pct(a: float, b: float) -> float | None:
    """``a`` relative to ``b`` in per cent (``(a - b) / b``), or None when ``b`` is 0."""
    return round((a - b) / b * 100, 2) if b else None


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]
