"""Every swap group of the configuration, and the seams the rest of gpupool uses.

- the supervisor asks :meth:`SwapController.gate` for a launched worker's launch gate;
- the remote poller asks :meth:`SwapController.may_ready` before it checks a ``url:`` worker that
  is out or marks it ready: a member of a group is marked ready by its group only, which asks
  ``/is_sleeping`` too (the poller only takes a ready member out when its checks fail);
- the pipeline's ``Slots`` records waiting requests in :attr:`SwapController.demand`;
- the admin API calls :meth:`sleep` and :meth:`wake`.

A worker with ``sleep:`` but no ``swap_group`` is a group of its own (idle sleep, woken on
demand). One gateway controls a group: its sleep and wake calls are not shared through Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

import aiohttp

from gpupool.config.models import SwapConfig, WorkerConfig
from gpupool.config.swap import memory_share, sleeps
from gpupool.workers.registry import Registry, Worker, WorkerState
from gpupool.workers.swap.demand import Demand
from gpupool.workers.swap.group import SwapGroup
from gpupool.workers.swap.member import GroupSeams, Member, SwapEvents
from gpupool.workers.swap.memory import GIB, DeviceMemory, DeviceWatch, GpuMemory, MemoryWatch
from gpupool.workers.swap.policy import Turns
from gpupool.workers.swap.verify import Verification, Verifier


class NotSwappable(Exception):
    """The worker runs without sleep mode (no ``sleep:``, no ``swap_group``)."""


class SwapController:
    def __init__(
        self,
        registry: Registry,
        session: aiohttp.ClientSession,
        workers: Sequence[WorkerConfig],
        cfg: SwapConfig,
        events: SwapEvents,
        restart: Callable[[str], Awaitable[None]] | None = None,
        *,
        probe_timeout_s: float = 10.0,
        tick_s: float = 0.1,
        read_s: float = 2.0,
        memory: Callable[[WorkerConfig], GpuMemory | None] = lambda _wc: None,
    ) -> None:
        self.registry = registry
        self.demand = Demand()
        turns = Turns(cfg.min_awake_s, cfg.priority_weight_s, cfg.policy.value, cfg.max_wait_s,
                      cfg.max_switch_share)  # fmt: skip
        verifier = Verifier(session, cfg.canary, probe_timeout_s)
        seams = GroupSeams(registry, session, self.demand, events, restart, turns,
                           cfg.sleep_timeout_s, cfg.wake_timeout_s, probe_timeout_s,
                           tick_s, read_s, cfg.pause_after_s, verifier)  # fmt: skip
        members: dict[str, list[Member]] = {}
        devices = _device_watches(workers, memory, cfg)
        for wc in workers:
            worker = registry.get(wc.name)
            if worker is None or not sleeps(wc):
                continue
            group = wc.swap_group or wc.name
            worker.swap_group = group
            level = int(wc.sleep.level) if wc.sleep else 1
            idle = wc.sleep.idle_s if wc.sleep else None
            member = Member(worker, level, idle, wc.launch is not None)
            watch = _watch(wc, memory(wc), cfg) if wc.launch else devices.get(group)
            member.verify = Verification(watch)
            members.setdefault(group, []).append(member)
        self.groups = {name: SwapGroup(name, ms, seams) for name, ms in members.items()}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _find(self, name: str) -> tuple[SwapGroup, Member]:
        for group in self.groups.values():
            member = group.member(name)
            if member is not None:
                return group, member
        raise NotSwappable(name)

    # -- seams ----------------------------------------------------------------------------------

    def gate(self, name: str) -> Callable[[], Awaitable[None]] | None:
        """The launch gate of a launched worker in a group (None: launch at once)."""
        try:
            group, member = self._find(name)
        except NotSwappable:
            return None
        return lambda: group.before_launch(member)

    def may_ready(self, worker: Worker) -> bool:
        """False for a member of a group (by name: a reload's new entry is one before its
        group follows it): only its group knows whether it may use the GPU and sleeps."""
        try:
            self._find(worker.name)
        except NotSwappable:
            return True
        return False

    def groups_view(self) -> list[dict[str, object]]:
        """Every group: holder, waiting per model, switches (``SwapGroup.view``)."""
        return [g.view() for g in self.groups.values()]

    def _asleep(self, model: str) -> SwapGroup | None:
        """The group that holds ``model`` while no member serves it (None: served, or none)."""
        found = None
        for group in self.groups.values():
            models = {m.worker.model for m in group.members}
            if model not in models:
                continue
            if group.awake_model() == model:
                return None
            found = found or group
        ready = any(w.model == model and w.state is WorkerState.ready for w in self.registry)
        return None if ready else found

    def waiting_note(self, model: str) -> str | None:
        """The keep-alive of a stream waiting for ``model`` to be woken (None: not asleep)."""
        group = self._asleep(model)
        if group is None:
            return None
        how = "measured" if group.last_switch_s is not None else "estimated"
        held = group.awake_model()
        by = f", held by `{held}`" if held else ""
        return (f"waking model `{model}` (swap group {group.name}{by}); a switch takes "
                f"{group.switch_s:.1f} s ({how})")  # fmt: skip

    def expected_wait(self, model: str) -> float | None:
        """Seconds until ``model``, asleep, may serve (an estimate); None when it is awake."""
        group = self._asleep(model)
        return None if group is None else group.expected_wait(model)

    def reversal(self, name: str) -> str | None:
        """What the policy will undo of an admin's sleep or wake of ``name`` (None: nothing)."""
        group, member = self._find(name)
        return group.reversal(member)

    def member_view(self, name: str) -> dict[str, object] | None:
        """A member's checks (``verify.py``) for the admin API; None outside any group."""
        try:
            _group, member = self._find(name)
        except NotSwappable:
            return None
        return member.verify.view()

    # -- life -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Run every group (start-up in turn, then the loop); returns at once."""
        self._tasks = {
            g.name: asyncio.create_task(g.run(), name=f"gpupool-swap-{g.name}")
            for g in self.groups.values()
        }

    def fence(self, may_act: Callable[[], bool]) -> None:
        """Every group acts only while ``may_act()`` (this gateway's Redis claims are fresh)."""
        for group in self.groups.values():
            group.fence = may_act

    async def stop_group(self, name: str) -> None:
        """Stop running one group's turns (another gateway controls it now): its members stay
        as they are, and no switch of this gateway touches them again."""
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def lost_group(self, name: str, holder: str) -> None:
        """Another gateway replica controls group ``name`` now: stop its turns, and route
        nothing more to its ``url:`` members (the other may put them to sleep at any time):
        they are marked failed, saying whose they are. (Launched members are this gateway's
        processes: left as they are.)"""
        await self.stop_group(name)
        group = self.groups.get(name)
        for m in group.members if group is not None else []:
            if m.launched:
                continue
            m.worker.last_error = f"swap group {name} is controlled by replica {holder}"
            self.registry.transition(m.worker, WorkerState.failed)

    async def close(self) -> None:
        for name in list(self._tasks):
            await self.stop_group(name)

    # -- admin ----------------------------------------------------------------------------------

    def controls(self, name: str) -> bool:
        """Whether this gateway may act on ``name``'s group now (not fenced: with Redis, its
        claim is fresh and no other replica took it)."""
        try:
            group, _ = self._find(name)
        except NotSwappable:
            return True  # (not a member: the call says so as before)
        return group.fence()

    async def sleep(self, name: str, level: int | None = None) -> bool:
        """Put ``name`` to sleep now if it holds its GPU (its running requests finish first),
        at ``level`` this time (default: its configured level). The group's policy may wake it
        again for requests waiting for its model."""
        group, member = self._find(name)
        async with group.lock:
            member.next_level = level
            try:
                return await group.put_to_sleep(member)
            finally:
                member.next_level = None

    async def wake(self, name: str) -> bool:
        """Give ``name`` its group's GPU now: a switch like any other (the holder's running
        requests finish first, or are paused after ``swap.pause_after_s``)."""
        group, member = self._find(name)
        async with group.lock:
            if member.worker.state in (WorkerState.draining, WorkerState.stopped):
                return False
            return await group.switch_to(member)


def _device_watches(
    workers: Sequence[WorkerConfig],
    memory: Callable[[WorkerConfig], GpuMemory | None],
    cfg: SwapConfig,
) -> dict[str, DeviceWatch]:
    """Per group with ``url:`` members: the GPU its launched members name, read whole for the
    ``url:`` members' sleeps (``DeviceWatch``: room for the largest launched share of it)."""
    launched: dict[str, list[WorkerConfig]] = {}
    remote: set[str] = set()
    for wc in workers:
        if not sleeps(wc):
            continue
        group = wc.swap_group or wc.name
        if wc.launch is not None and wc.launch.gpus:
            launched.setdefault(group, []).append(wc)
        elif wc.url is not None:
            remote.add(group)
    out = {}
    for group in remote & launched.keys():
        first = launched[group][0]
        device = memory(first)
        if device is None or not hasattr(device, "device_bytes"):
            continue
        need = max(memory_share(wc) for wc in launched[group])
        gpus = tuple(first.launch.gpus or []) if first.launch else ()
        out[group] = DeviceWatch(cast(DeviceMemory, device), gpus, need, cfg.free_timeout_s)
    return out


def _watch(wc: WorkerConfig, memory: GpuMemory | None, cfg: SwapConfig) -> MemoryWatch | None:
    """A launched worker's memory watch on its GPUs (None: not launched, or nothing to read)."""
    if memory is None or wc.launch is None or not wc.launch.gpus:
        return None
    residue = int(cfg.sleep_residue_gib * GIB)
    return MemoryWatch(memory, tuple(wc.launch.gpus), residue, cfg.free_timeout_s)
