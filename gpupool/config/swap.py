"""Swap groups formed from the configuration: workers that take turns on one GPU.

A ``launch:`` worker holds ``gpu-memory-utilization`` (vLLM's default 0.9) of each GPU it names.
Where the workers naming one GPU hold more than all of it together they cannot all be awake, so
they are put in one swap group (named ``gpu<ids>`` unless one of them names a group already) and
get sleep mode (level 1 unless they say otherwise). Pure arithmetic on the configuration; run by
the configuration's own validation, so every part of gpupool sees the same groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpupool.config.models import WorkerConfig

VLLM_DEFAULT_SHARE = 0.92  # as the planner (planner/plan.py VLLM_DEFAULT_UTILIZATION)
_OVER = 1.0 + 1e-9


@dataclass(frozen=True, slots=True)
class AutoGroup:
    """A group gpupool formed, and why (``gpupool check`` prints it)."""

    name: str
    workers: tuple[str, ...]
    gpu: int
    shares: tuple[float, ...]

    def explain(self) -> str:
        parts = " + ".join(f"{w} {s:g}" for w, s in zip(self.workers, self.shares, strict=True))
        return (
            f"swap group `{self.name}`: {', '.join(self.workers)} share GPU {self.gpu} and hold "
            f"{parts} = {sum(self.shares):g} of it (more than all of it), so they take turns "
            "through vLLM's sleep mode: one awake at a time"
        )


def memory_share(worker: WorkerConfig) -> float:
    """The share of each of its GPUs a launched worker takes (vLLM's default when not set)."""
    launch = worker.launch
    if launch is None:
        return 0.0
    for key, value in launch.args.items():
        if key.lstrip("-").replace("_", "-") == "gpu-memory-utilization":
            try:
                return float(value)
            except (TypeError, ValueError):
                return VLLM_DEFAULT_SHARE
    return VLLM_DEFAULT_SHARE


def crowded_gpus(workers: Sequence[WorkerConfig]) -> list[AutoGroup]:
    """Each GPU whose launched workers together hold more than all of it."""
    by_gpu: dict[int, list[WorkerConfig]] = {}
    for w in workers:
        for gpu in (w.launch.gpus or []) if w.launch else []:
            by_gpu.setdefault(gpu, []).append(w)
    out = []
    for gpu, members in sorted(by_gpu.items()):
        shares = tuple(memory_share(w) for w in members)
        if len(members) > 1 and sum(shares) > _OVER:
            named = next((w.swap_group for w in members if w.swap_group), None)
            out.append(AutoGroup(named or f"gpu{gpu}", tuple(w.name for w in members), gpu, shares))
    return out


def form_swap_groups(workers: Sequence[WorkerConfig]) -> list[AutoGroup]:
    """Put the workers of each crowded GPU in one swap group, with sleep mode; returns the
    groups formed (a worker already in a group keeps its name)."""
    from gpupool.config.models import SleepConfig

    groups = crowded_gpus(workers)
    by_name = {w.name: w for w in workers}
    for group in groups:
        for name in group.workers:
            w = by_name[name]
            if w.swap_group is None:
                w.swap_group = group.name
    for w in workers:
        if w.swap_group is not None and w.sleep is None:
            w.sleep = SleepConfig()
    return groups


def no_reload(worker: WorkerConfig) -> str | None:
    """Why a level-2 wake of this worker cannot work, or None. A level-2 wake calls vLLM's
    ``reload_weights``, which reads the checkpoint again through the model loader; with
    ``--load-format dummy`` there is nothing to read (vLLM 0.26: ``NotImplementedError: Model
    reloading with `dummy` format``), so every wake would fail and restart the worker."""
    launch = worker.launch
    if launch is None:
        return None
    given = [(k.lstrip("-").replace("_", "-"), str(v)) for k, v in launch.args.items()]
    command = launch.command or []  # `--load-format dummy` or `--load-format=dummy` in it
    for i, word in enumerate(command):
        key, eq, value = word.partition("=")
        if key == "--load-format":
            given.append(("load-format", value if eq else "".join(command[i + 1 : i + 2])))
    for key, value in given:
        if key == "load-format" and value == "dummy":
            return (
                f"worker `{worker.name}` loads `load-format: dummy` weights, which vLLM cannot "
                "reload: a level-2 wake would fail and restart it; use level 1, or real weights"
            )
    return None


def check_reloadable(workers: Sequence[WorkerConfig]) -> None:
    """Refuse ``sleep: {level: 2}`` where a wake cannot reload the weights (``no_reload``)."""
    from gpupool.config.models import SleepLevel

    for i, w in enumerate(workers):
        why = no_reload(w)
        if why and w.sleep is not None and w.sleep.level is SleepLevel.discard_weights:
            raise ValueError(f"workers[{i}].sleep.level: 2, but {why}")


def sleeps(worker: WorkerConfig) -> bool:
    """Whether the worker runs with vLLM's sleep mode."""
    return worker.sleep is not None or worker.swap_group is not None
