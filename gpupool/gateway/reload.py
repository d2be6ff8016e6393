"""Config reload: add, remove and replace changed workers; unchanged ones are untouched."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.catalog import Catalog

if TYPE_CHECKING:
    from gpupool.gateway.services import Services

DRAIN_ON_RELOAD_S = 60.0


async def apply_reload(svc: Services, new: GpupoolConfig) -> dict[str, list[str]]:
    from gpupool.gateway.services import make_worker

    old = {wc.name: wc for wc in svc.cfg.workers}
    fresh = {wc.name: wc for wc in new.workers}
    removed = [n for n in old if n not in fresh]
    # a launched worker's flags also come from its model (command.model_flags)
    before = {n: (wc, svc.cfg.model(wc.model) if wc.launch else None) for n, wc in old.items()}
    after = {n: (wc, new.model(wc.model) if wc.launch else None) for n, wc in fresh.items()}
    changed = [n for n in fresh if n in old and after[n] != before[n]]
    added = [n for n in fresh if n not in old]
    unchanged = [n for n in fresh if n in old and after[n] == before[n]]

    await asyncio.gather(*(_retire(svc, n) for n in (*removed, *changed)))
    svc.cfg.models = new.models
    svc.cfg.workers = new.workers
    svc.catalog = svc.pipeline.catalog = Catalog(new.models)
    for n in (*changed, *added):
        wc = fresh[n]
        worker = make_worker(wc, new.model(wc.model), new.routing.default_capacity)
        svc.registry.add(worker)
        svc.metrics.worker_state(worker.model, worker.name, worker.state.value)
        if wc.launch is not None:
            await svc.supervisor.add(wc, new.model(wc.model))
        else:
            await svc.poller.check(worker)
    return {"added": added, "removed": removed, "changed": changed, "unchanged": unchanged}


async def _retire(svc: Services, name: str) -> None:
    worker = svc.registry.get(name)
    if worker is None:
        return
    if worker.supervised:
        await svc.supervisor.drain(name, DRAIN_ON_RELOAD_S)
        await svc.supervisor.remove(name)
    else:
        await svc.drain(worker, DRAIN_ON_RELOAD_S)
    svc.registry.remove(name)
    svc.metrics.forget_worker(worker.model, worker.name)
