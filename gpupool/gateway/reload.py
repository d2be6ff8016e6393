"""Config reload: the whole file is read and checked first, then what may change at run time is
swapped in one step, then workers are added, removed and replaced.

    POST /admin/reload (or SIGHUP, under ``gpupool serve``) → reload_config(svc), one at a time
      1. read and validate the file, and the keys file it names, under the reload lock (two
         overlapping reloads: the later one reads the files last, so the newest files win);
         any problem refuses the whole reload (400 naming the file, the field or the line)
         and nothing changes;
      2. build everything the new settings need (``build_live``: the keys, the read limits);
      3. swap it all without an ``await`` in between (``_swap``): a request sees the old
         settings or the new ones, never a mix; the queued requests of removed keys are refused;
      4. workers: the changed and removed ones drain and go, new ones start (``_workers``).

Which settings change at run time is one table, :data:`LIVE`; every other field that differs
is listed in the reply as needing a restart and keeps its old value, so the next reload reports
it again until the gateway restarts. A section this module does not know (one added later)
needs a restart as a whole until it is added to the table.

This module depends on ``services`` (never the other way round).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gpupool.config import ConfigError, load_config
from gpupool.config.models import ApiKey, GpupoolConfig, unauthenticated_exposure
from gpupool.config.swap import sleeps
from gpupool.gateway.admission.base import LIVE_QUEUE
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.errors import BadRequest
from gpupool.gateway.parse import ReadLimits
from gpupool.gateway.security.keys import KeysFileError, key_name
from gpupool.gateway.security.middleware import AuthState
from gpupool.gateway.services import Services, discovery_hooks, make_worker
from gpupool.gateway.tenancy.cache import CacheScope
from gpupool.gateway.tenancy.secret import build_scope
from gpupool.workers.discovery import Discovery

log = logging.getLogger("gpupool.reload")

DRAIN_ON_RELOAD_S = 60.0

# Section -> the fields a reload applies (None: all of them). ``models`` and ``workers`` are
# the worker diff's (``_workers``). Everything else needs a restart: the listening socket and
# its protocol limits (server.host, port, ssl_*, header_*), the upstream client's timeouts and
# bounds, the queue backend and its Redis connection, the health checks'.
_READ = ("max_json_depth", "max_n", "max_sequences", "max_json_containers")  # the pipeline's
_FRONT = ("max_body_bytes", "body_timeout_s", "log_prompts")  # the front door's (reload_hooks)
_ROUTING = frozenset(
    {
        *("retries", "exact_count_margin", "prefix_affinity", "affinity_max_load"),
        *("affinity_max_lead", "affinity_wait_s", "window_reserve_s"),
        *("prefill_gate_tokens", "prefill_gate_max_wait_s"),
    }
)
LIVE: dict[str, frozenset[str] | None] = {
    "auth": None,
    "server": frozenset({*_READ, *_FRONT, "expose_worker_header"}),
    "queue": frozenset(LIVE_QUEUE),  # ``Admission.configure``
    "routing": _ROUTING,  # ``Router.configure``, the prefill gate, the dispatcher
    "tenancy": frozenset({"cache", "salt_secret"}),
}
_WORKER_SECTIONS = frozenset({"models", "workers"})


@dataclass(frozen=True, slots=True)
class Live:
    """What a reload swaps in, all built before anything changes."""

    cfg: GpupoolConfig  # the new file, its restart-only fields set back to the running values
    auth: AuthState
    read_limits: ReadLimits
    applied: list[str]  # changed fields applied now ("queue.max_wait_s")
    restart: list[str]  # changed fields only a restart applies


async def reload_config(svc: Services) -> dict[str, Any]:
    """Re-read the config file (and its keys file) and apply it; ``BadRequest`` if invalid."""
    if svc.config_path is None:
        raise BadRequest("This gateway was not started from a config file.")
    # One reload at a time, each comparing with the last one. The files are read inside the
    # lock: read before it, a reload that waited could apply an older read over a newer one.
    async with svc.reload_lock:
        new, auth = await _read(svc, svc.config_path)
        live = build_live(svc.cfg, new, auth)
        # the new auth on the address actually bound (the file's own was checked as it loaded;
        # ``serve --host`` may have bound another, and a reload keeps the running one)
        exposed = unauthenticated_exposure(live.cfg)
        if exposed is not None:
            raise BadRequest(f"The new configuration is refused; nothing changed: {exposed}.")
        keys = _key_changes(svc.auth.state, auth)
        # isolated or not, by the tenants now; a generated secret is kept (``tenancy/secret.py``)
        cache = await build_scope(live.cfg.tenancy, live.cfg.auth, auth.store.keys.values(),
                                  svc.pipeline.salt_secret)  # fmt: skip
        refused = _swap(svc, live, keys["removed_hashes"], cache)
        workers = await _workers(svc, new)
    return {
        "workers": workers,
        "settings": {"applied": live.applied, "restart_required": live.restart},
        "keys": {k: v for k, v in keys.items() if k != "removed_hashes"},
        "queued_refused": refused,
    }


async def _read(svc: Services, path: str | Path) -> tuple[GpupoolConfig, AuthState]:
    """The config file and its keys file, read now and checked against the running config."""
    try:
        new = await asyncio.to_thread(load_config, path)
        auth = await asyncio.to_thread(AuthState.build, new.auth)
    except ConfigError as e:
        raise BadRequest(f"The new configuration is invalid; nothing changed: {e}") from None
    except KeysFileError as e:
        raise BadRequest(f"The keys file is invalid; nothing changed: {e}") from None
    if _swap_members(svc.cfg) != _swap_members(new):
        raise BadRequest(
            "The new configuration adds, removes or regroups sleep-mode workers (`sleep:` / "
            "`swap_group:`), which takes a restart of gpupool (a worker the swap groups do not "
            "know could be awake beside another on one GPU); nothing changed."
        )
    return new, auth


def reload_on_sighup(svc: Services) -> Callable[[], None]:
    """Reload on SIGHUP as on ``POST /admin/reload`` (the reply is logged); returns the undo.

    Only where the loop can take signals (the main thread) and the gateway has a config file;
    elsewhere it does nothing. Without it a SIGHUP would end the process.
    """
    if svc.config_path is None:
        return lambda: None
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()

    def fire() -> None:
        task = loop.create_task(_logged_reload(svc))
        running.add(task)
        task.add_done_callback(running.discard)

    try:
        loop.add_signal_handler(signal.SIGHUP, fire)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
        return lambda: None

    def undo() -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGHUP)

    return undo


async def _logged_reload(svc: Services) -> None:
    try:
        summary = await reload_config(svc)
    except BadRequest as e:
        log.error("reload (SIGHUP) refused: %s", e.message)
    except Exception:
        log.exception("reload (SIGHUP) failed")
    else:
        log.info("reload (SIGHUP): %s", json.dumps(summary, sort_keys=True))


def build_live(old: GpupoolConfig, new: GpupoolConfig, auth: AuthState) -> Live:
    """The settings to swap in: ``new``'s live fields, ``old``'s values for the rest."""
    applied: list[str] = []
    restart: list[str] = []
    merged = new.model_copy()
    for section in type(new).model_fields:
        if section in _WORKER_SECTIONS:
            continue
        before, after = getattr(old, section), getattr(new, section)
        kept = _merge_section(section, before, after, applied, restart)
        setattr(merged, section, kept)
    s = merged.server
    limits = ReadLimits(s.max_json_depth, s.max_n, s.max_sequences, s.max_json_containers)
    return Live(merged, auth, limits, applied, restart)


def _merge_section(
    section: str, before: Any, after: Any, applied: list[str], restart: list[str]
) -> Any:
    """``after`` with the fields a reload cannot apply set back to ``before``'s values; the
    changed field paths are appended to ``applied`` or ``restart``."""
    if not isinstance(before, BaseModel) or not isinstance(after, BaseModel):
        if before != after:
            (applied if section in LIVE else restart).append(section)
        return after if section in LIVE else before
    live = LIVE.get(section, frozenset())
    kept = after.model_copy()
    for name in type(after).model_fields:
        old_value, new_value = getattr(before, name), getattr(after, name)
        if old_value == new_value:
            continue
        if live is None or name in live:
            applied.append(f"{section}.{name}")
        else:
            restart.append(f"{section}.{name}")
            setattr(kept, name, old_value)
    return kept


def _key_changes(before: AuthState, after: AuthState) -> dict[str, list[str]]:
    """Client keys added, removed and changed (by name; hashes of removed ones for revoking)."""
    old, new = before.store.keys, after.store.keys
    if before.cfg.enabled and not after.cfg.enabled:
        new = old  # auth turned off: no key is refused
    removed = sorted(d for d in old if d not in new)
    return {
        "added": sorted(key_name(new[d]) for d in new if d not in old),
        "removed": sorted(key_name(old[d]) for d in removed),
        "changed": sorted(key_name(new[d]) for d in new if d in old and _differs(old[d], new[d])),
        "removed_hashes": removed,
    }


def _differs(a: ApiKey, b: ApiKey) -> bool:
    return a.model_dump() != b.model_dump()


def _swap_members(cfg: GpupoolConfig) -> set[tuple[str, str | None]]:
    """The workers in swap groups, each with its group (formed at load for shared GPUs)."""
    return {(w.name, w.swap_group) for w in cfg.workers if sleeps(w)}


def _swap(svc: Services, live: Live, removed: list[str], cache: CacheScope) -> int:
    """Every run-time setting at once (no ``await``); returns the queued requests refused."""
    svc.auth.swap(live.auth)
    svc.key_limits.default_reserve_tokens = live.cfg.auth.tpm_reserve_tokens
    svc.pipeline.read_limits = live.read_limits
    svc.pipeline.relay.worker_header = live.cfg.server.expose_worker_header
    svc.pipeline.dispatcher.routing = routing = live.cfg.routing
    svc.pipeline.dispatcher.gate.configure(
        routing.prefill_gate_tokens, routing.prefill_gate_max_wait_s
    )
    svc.pipeline.candidates.router.configure(routing)
    svc.admission.configure(live.cfg.queue)
    svc.pipeline.cache = cache
    for section in type(live.cfg).model_fields:
        if section not in _WORKER_SECTIONS:
            setattr(svc.cfg, section, getattr(live.cfg, section))
    for hook in svc.reload_hooks:
        hook(live.cfg)
    return svc.key_requests.revoke(removed)


async def _workers(svc: Services, new: GpupoolConfig) -> dict[str, list[str]]:
    """Add, remove and replace changed workers; unchanged ones are untouched."""
    old = {wc.name: wc for wc in svc.cfg.workers}
    fresh = {wc.name: wc for wc in new.workers}
    removed = [n for n in old if n not in fresh]
    # a launched worker's flags also come from its model (command.model_flags)
    before = {n: (wc, svc.cfg.model(wc.model) if wc.launch else None) for n, wc in old.items()}
    after = {n: (wc, new.model(wc.model) if wc.launch else None) for n, wc in fresh.items()}
    changed = [n for n in fresh if n in old and after[n] != before[n]]
    added = [n for n in fresh if n not in old]
    unchanged = [n for n in fresh if n in old and after[n] == before[n]]

    # discover: entries have no registry worker of their own name: discovery diffs them itself
    retiring = [n for n in (*removed, *changed) if old[n].discover is None]
    await asyncio.gather(*(_retire(svc, n) for n in retiring))
    svc.cfg.models = new.models
    svc.cfg.workers = new.workers
    svc.catalog = svc.pipeline.catalog = Catalog(new.models)
    for n in (*changed, *added):
        wc = fresh[n]
        if wc.discover is not None:
            continue
        worker = make_worker(wc, new.model(wc.model), svc.cfg.routing.default_capacity)
        svc.registry.add(worker)
        svc.metrics.worker_state(worker.model, worker.name, worker.state.value)
        if wc.launch is not None:
            await svc.supervisor.add(wc, new.model(wc.model))
        else:
            await svc.poller.check(worker)
    await _rediscover(svc, new)
    return {"added": added, "removed": removed, "changed": changed, "unchanged": unchanged}


async def _rediscover(svc: Services, new: GpupoolConfig) -> None:
    """``discover:`` entries: gone or changed ones stop (their workers drain and go), new and
    changed ones start resolving; unchanged ones keep their workers."""
    entries = [wc for wc in new.workers if wc.discover is not None]
    if svc.discovery is None and entries:
        svc.discovery = Discovery(svc.registry, [], discovery_hooks(svc))
    if svc.discovery is not None:
        await svc.discovery.replace(entries)


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
    if svc.kv is not None:  # its KV-event subscription ends, its index goes
        svc.kv.pool.remove(name)
