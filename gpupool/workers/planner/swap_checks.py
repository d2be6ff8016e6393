"""`gpupool check` on swap groups (issue 28): what each group is and why, whether its sleeping
weights fit the host's RAM, and how slow a wake will be.

A level-1 sleep copies a worker's weights to host RAM (pinned) while it sleeps; every member of
a group but the awake one sleeps, so the group holds all its level-1 members' weights in host
RAM but the smallest (all of them while a level-2 member is the one awake). Over every group that
must fit in the host's RAM (``MemTotal`` less a reserve: an error beyond it; a warning beyond
what ``MemAvailable`` says now): beyond it the host swaps or the OOM killer ends a vLLM. A level-2
sleep holds nothing, but its wake reads the weights from disk again, as a start does without
compiling (tens of seconds for tens of GiB).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpupool.config.models import GpupoolConfig, SleepLevel, WorkerConfig
from gpupool.config.swap import crowded_gpus
from gpupool.workers.planner.errors import PlannerError
from gpupool.workers.planner.findings import Finding, error, warning
from gpupool.workers.planner.launch_args import normalize_args, tensor_parallel_size
from gpupool.workers.planner.memory import GiB, weight_bytes
from gpupool.workers.planner.model_spec import ModelSpec
from gpupool.workers.planner.quant import resolve_scheme

SLOW_WAKE_BYTES = 8 * GiB  # a level-2 wake of more than this reads for seconds or more


HOST_RESERVE_BYTES = 4 * GiB  # the OS, the gateway and each vLLM's own host memory


@dataclass(frozen=True, slots=True)
class HostRam:
    total: int  # MemTotal
    available: int  # MemAvailable, now


def host_ram(meminfo: Path = Path("/proc/meminfo")) -> HostRam | None:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo``; None where it cannot be read."""
    values: dict[str, int] = {}
    try:
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(values) < 2:
        return None
    return HostRam(values["MemTotal"], values["MemAvailable"])


def swap_notes(cfg: GpupoolConfig) -> list[str]:
    """Each swap group in words: the groups gpupool formed say why."""
    formed = {g.name: g for g in crowded_gpus(cfg.workers)}
    groups: dict[str, list[WorkerConfig]] = {}
    for w in cfg.workers:
        if w.swap_group is not None:
            groups.setdefault(w.swap_group, []).append(w)
    notes = []
    for name, members in groups.items():
        levels = ", ".join(
            f"{w.name} level {int(w.sleep.level) if w.sleep else 1}" for w in members
        )
        why = formed[name].explain() if name in formed else f"swap group `{name}` (named)"
        notes.append(f"{why}; sleep: {levels}; awake after start: {members[0].name}")
    if notes and cfg.queue.backend.value == "redis":
        notes.append(
            "queue.backend redis: one gateway replica controls each swap group (a claim in "
            "Redis); a second replica of this configuration on the same Redis stands by, "
            "serving nothing, and takes the groups over once that claim lapses"
        )
    return notes


def weights_of(w: WorkerConfig, spec: ModelSpec | None) -> int | None:
    """The planner's weight bytes per GPU of a launched worker (None: no model config)."""
    if spec is None or w.launch is None:
        return None
    args = normalize_args(w.launch.args)
    try:
        scheme, _ = resolve_scheme(spec, args.get("quantization"))
        return weight_bytes(spec, scheme, tp=tensor_parallel_size(args)).total
    except PlannerError:
        return None


def check_swap(
    cfg: GpupoolConfig, specs: Mapping[str, ModelSpec | None], host: HostRam | None
) -> list[Finding]:
    """Level-1 groups whose sleeping weights exceed the host's RAM less
    ``HOST_RESERVE_BYTES`` (an error) or what is available now (a warning), and level-2 members
    whose wake reads many GiB from disk (warnings)."""
    findings: list[Finding] = []
    index = {w.name: i for i, w in enumerate(cfg.workers)}
    held = 0
    for w in cfg.workers:
        if w.launch is not None and w.launch.gpus is None and w.swap_group is not None:
            findings.append(warning(f"workers[{index[w.name]}].launch.gpus",
                "no GPU: vLLM on CPU refuses --enable-sleep-mode (\"Sleep mode is not supported "
                "on current platform.\"); sleep mode needs CUDA (or ROCm, XPU)"))  # fmt: skip
    for members in _groups(cfg.workers).values():
        sizes = []
        for w in members:
            size = weights_of(w, specs.get(w.name))
            level = w.sleep.level if w.sleep else SleepLevel.weights_to_host
            if level is SleepLevel.discard_weights and size and size > SLOW_WAKE_BYTES:
                findings.append(warning(f"workers[{index[w.name]}].sleep.level",
                    f"level 2: each wake of {w.name} reads {size / GiB:.1f} GiB of weights "
                    "from disk again (seconds to minutes; level 1 wakes in about a second but "
                    "holds them in host RAM)"))  # fmt: skip
            elif level is SleepLevel.weights_to_host and size:
                sizes.append(size)
        if sizes:  # all asleep but one: the smallest level-1 one, unless a level-2 one wakes
            held += sum(sizes) - (min(sizes) if len(sizes) == len(members) else 0)
    if host is not None and held > host.total - HOST_RESERVE_BYTES:
        room = f"the host's {host.total / GiB:.1f} GiB less {HOST_RESERVE_BYTES / GiB:.0f} GiB"
        findings.append(error("workers", _too_much(held, room)))
    elif host is not None and held > host.available:
        room = f"the {host.available / GiB:.1f} GiB available now"
        findings.append(warning("workers", _too_much(held, room)))
    return findings


def _too_much(held: int, room: str) -> str:
    return (
        f"level-1 sleep holds the sleeping workers' weights in host RAM: {held / GiB:.1f} GiB, "
        f"more than {room} (/proc/meminfo); use `sleep: {{level: 2}}` for some (no host RAM, "
        "slower wakes) or fewer models per GPU"
    )


def _groups(workers: Sequence[WorkerConfig]) -> dict[str, list[WorkerConfig]]:
    out: dict[str, list[WorkerConfig]] = {}
    for w in workers:
        if w.swap_group is not None:
            out.setdefault(w.swap_group, []).append(w)
    return out
