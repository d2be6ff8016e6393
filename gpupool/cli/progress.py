"""What `gpupool serve` shows while workers load: each state change with its elapsed time,
then, once every worker has settled (ready or failed), a one-screen summary."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from gpupool.config.models import GpupoolConfig
from gpupool.workers.registry import Registry, Worker, WorkerState

_SETTLED = (WorkerState.ready, WorkerState.failed, WorkerState.stopped, WorkerState.asleep)
_STYLE = {"ready": "green", "failed": "red", "warming": "yellow", "starting": "cyan"}


class StartupProgress:
    def __init__(self, cfg: GpupoolConfig, registry: Registry, console: Console | None = None):
        self.cfg = cfg
        self.registry = registry
        self.console = console or Console(file=sys.stderr)
        self.t0 = time.monotonic()
        self.ready_after: dict[str, float] = {}
        self.summarized = False

    def on_change(self, worker: Worker, old: WorkerState) -> None:
        elapsed = time.monotonic() - self.t0
        style = _STYLE.get(worker.state.value, "white")
        self.console.print(
            f"[dim]{elapsed:7.1f}s[/dim]  {worker.name:<16} {old.value} → "
            f"[{style}]{worker.state.value}[/{style}]"
            + (f"  [red]{worker.last_error}[/red]" if worker.state is WorkerState.failed else "")
        )
        if worker.state is WorkerState.ready:
            self.ready_after.setdefault(worker.name, elapsed)
        if not self.summarized and all(w.state in _SETTLED for w in self.registry):
            self.summarized = True
            self.console.print(self.summary())

    def summary(self) -> Table:
        s = self.cfg.server
        t = Table(title=f"gpupool serving http://{s.host}:{s.port}/v1", title_justify="left")
        for col in ("worker", "model", "state", "window", "capacity", "gpus", "ready after"):
            t.add_column(col)
        for w in self.registry:
            style = _STYLE.get(w.state.value, "white")
            after = self.ready_after.get(w.name)
            t.add_row(
                w.name,
                w.model,
                f"[{style}]{w.state.value}[/{style}]",
                str(w.window or "-"),
                str(w.capacity),
                ",".join(map(str, w.gpus or [])) or "-",
                f"{after:.1f}s" if after is not None else "-",
            )
        return t
