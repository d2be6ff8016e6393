"""Admin routes: worker status and control, queue status, config reload.

Query parameters are checked like a client's: a route names the ones it takes and how each is
read (``_query``); a value that does not parse, is not finite or is out of range, and a name the
route does not take, get a 400 naming the parameter, never a 500.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from gpupool.config.swap import no_reload
from gpupool.gateway.api.endpoint import Endpoint, services
from gpupool.gateway.api.responses import ReplyResponse
from gpupool.gateway.errors import BadRequest, InvalidBody, NotFound, ServiceUnavailable
from gpupool.gateway.kvroute.predict import KvRouting
from gpupool.gateway.kvroute.predict import status as kv_status
from gpupool.gateway.reload import reload_config
from gpupool.gateway.reply import Reply
from gpupool.gateway.security.keys import key_name
from gpupool.gateway.services import Services
from gpupool.workers.registry import Worker
from gpupool.workers.swap.controller import SwapController


def worker_status(
    w: Worker, swap: SwapController | None = None, kv: KvRouting | None = None
) -> dict[str, Any]:
    """One worker as ``/admin/workers`` shows it; ``swap``: a group member's checks too;
    ``kv``: whether it is routed on its KV-cache events (docs/routing-kv-events.md)."""
    uptime = w.uptime_s()
    out = {
        "name": w.name,
        "model": w.model,
        "state": w.state.value,
        "supervised": w.supervised,
        "url": w.url,
        "pid": w.pid,
        "gpus": w.gpus,
        "max_model_len": w.window,
        "inflight": w.inflight,
        "capacity": w.capacity,
        "requests_total": w.requests_total,
        "restarts": w.restarts,
        "last_error": w.last_error,
        "last_log_lines": w.last_log_lines,
        "uptime_s": round(uptime, 1) if uptime is not None else None,
        "swap_group": w.swap_group,
        "asleep_s": round(w.time_asleep_s(), 1) if w.swap_group else None,
        "paused": w.paused,  # of ``inflight``: kept asleep by a switch until its next wake
        "vllm": {"kv_cache_usage": w.kv_usage, "waiting": w.vllm_waiting,
                 "running": w.vllm_running},
        "swap": swap.member_view(w.name) if swap is not None and w.swap_group else None,
    }  # fmt: skip
    if kv is not None:
        out["kv"] = kv_status(kv, w)  # precise prefix routing (docs/routing-kv-events.md)
    return out


MAX_DRAIN_S = 24 * 3600.0
Reader = Callable[[str, str], Any]


def seconds(maximum: float) -> Reader:
    """A reader of a finite number of seconds from 0 to ``maximum``."""

    def read(name: str, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not 0 <= value <= maximum:
            raise InvalidBody(
                f"Query parameter `{name}` must be a number of seconds from 0 to {maximum:g}.",
                param=name,
            )
        return value

    return read


def _query(request: Request, readers: Mapping[str, Reader]) -> dict[str, Any]:
    """The route's query parameters, each read by its reader; 400 for any other name."""
    values: dict[str, Any] = {}
    for name, text in request.query_params.multi_items():
        reader = readers.get(name)
        if reader is None:
            known = ", ".join(f"`{n}`" for n in readers) or "none"
            raise InvalidBody(
                f"Unknown query parameter `{name}` (this route takes: {known}).", param=name
            )
        if name in values:
            raise InvalidBody(f"Query parameter `{name}` is given twice.", param=name)
        values[name] = reader(name, text)
    return values


def _worker(request: Request) -> Worker:
    name = request.path_params["name"]
    w = services(request).registry.get(name)
    if w is None:
        raise NotFound(f"No worker named `{name}`.", param="name")
    return w


def count(minimum: int, maximum: int) -> Reader:
    """A reader of a whole number from ``minimum`` to ``maximum``."""

    def read(name: str, text: str) -> int:
        # ASCII digits, few enough for ``int`` (``"²".isdigit()``; 4,300 digits raise)
        whole = text.isascii() and text.isdigit() and len(text) <= 18
        if not whole or not minimum <= int(text) <= maximum:
            raise InvalidBody(
                f"Query parameter `{name}` must be a whole number from {minimum} to {maximum}.",
                param=name,
            )
        return int(text)

    return read


PAGE_WORKERS = 500  # workers per page of GET /admin/workers (`?limit=` up to MAX_PAGE_WORKERS)
MAX_PAGE_WORKERS = 5000


async def list_workers(request: Request) -> ASGIApp:
    """The workers, in pages: state, url, pid, GPUs, window, in-flight and capacity, restarts,
    last error and log lines, vLLM's KV usage and waiting count. ``?offset=`` and ``?limit=``
    (default 500, at most 5,000) page through a large pool; ``total`` and ``has_more`` say how
    many there are."""
    q = _query(request, {"offset": count(0, 10**9), "limit": count(1, MAX_PAGE_WORKERS)})
    svc = services(request)
    offset, limit = q.get("offset", 0), q.get("limit", PAGE_WORKERS)
    workers = list(svc.registry)
    page = workers[offset : offset + limit]
    data = [worker_status(w, svc.swap, svc.kv) for w in page]
    groups = svc.swap.groups_view() if svc.swap is not None else []  # holder, waiting, switches
    body = {"object": "list", "data": data, "total": len(workers), "offset": offset,
            "has_more": offset + len(page) < len(workers), "groups": groups}  # fmt: skip
    return ReplyResponse(Reply.json(200, body))


async def get_worker(request: Request) -> ASGIApp:
    """One worker, as in the list."""
    _query(request, {})
    svc = services(request)
    return ReplyResponse(Reply.json(200, worker_status(_worker(request), svc.swap, svc.kv)))


async def drain(request: Request) -> ASGIApp:
    """Stop sending the worker new requests; its running ones finish, or at ``?timeout_s=``
    (300 by default) move to another worker (docs/migration.md). A launched worker's process
    stays up, warm: Resume (``undrain``) is instant; ``stop`` ends it."""
    w, svc = _worker(request), services(request)
    timeout = _query(request, {"timeout_s": seconds(MAX_DRAIN_S)}).get("timeout_s", 300.0)
    await svc.drain(w, timeout)
    return ReplyResponse(Reply.json(200, worker_status(w, svc.swap)))


async def stop(request: Request) -> ASGIApp:
    """Drain, then stop: a launched worker's process ends (its GPU is free; Resume is then a
    cold start). ``?timeout_s=`` (300 by default) bounds the wait for its running requests."""
    w, svc = _worker(request), services(request)
    timeout = _query(request, {"timeout_s": seconds(MAX_DRAIN_S)}).get("timeout_s", 300.0)
    await svc.stop(w, timeout)
    return ReplyResponse(Reply.json(200, worker_status(w, svc.swap)))


async def undrain(request: Request) -> ASGIApp:
    """Take a drained worker back into service."""
    _query(request, {})
    w, svc = _worker(request), services(request)
    await svc.undrain(w)
    return ReplyResponse(Reply.json(200, worker_status(w, svc.swap)))


async def restart(request: Request) -> ASGIApp:
    """Restart a launched worker, drained first: its running requests finish within
    ``?timeout_s=`` (0 by default: at once) or then move to another worker
    (docs/migration.md); 400 for a ``url:`` worker."""
    timeout = _query(request, {"timeout_s": seconds(MAX_DRAIN_S)}).get("timeout_s", 0.0)
    w, svc = _worker(request), services(request)
    if not w.supervised:
        raise BadRequest(f"Worker `{w.name}` is not launched by gpupool; it cannot be restarted.")
    await svc.restart(w, timeout)
    return ReplyResponse(Reply.json(200, worker_status(w, svc.swap)))


async def sleep(request: Request) -> ASGIApp:
    """Put a sleep-mode worker to sleep (its running requests finish first), at ``?level=1|2``
    this time if given; its group may wake it again for requests waiting for its model."""
    level = _query(request, {"level": sleep_level}).get("level")
    w, svc = _worker(request), services(request)
    swap = _controlled(_swap(svc, w), w)
    wc = next((c for c in svc.cfg.workers if c.name == w.name), None)
    why = no_reload(wc) if level == 2 and wc is not None else None
    if why:
        raise InvalidBody(f"Level 2 is refused: {why}.", param="level")
    await swap.sleep(w.name, level)
    return ReplyResponse(Reply.json(200, _with_reversal(worker_status(w, swap), swap, w)))


async def wake(request: Request) -> ASGIApp:
    """Give a sleep-mode worker its swap group's GPU now: a switch like a request's (the awake
    one's running requests finish, or are paused after ``swap.pause_after_s``; it is put to
    sleep, then this one is woken)."""
    _query(request, {})
    w, svc = _worker(request), services(request)
    swap = _controlled(_swap(svc, w), w)
    await swap.wake(w.name)
    return ReplyResponse(Reply.json(200, _with_reversal(worker_status(w, swap), swap, w)))


def _with_reversal(status: dict[str, Any], swap: SwapController, w: Worker) -> dict[str, Any]:
    """``policy_note``: what the group's policy will undo of this admin action, and why."""
    return {**status, "policy_note": swap.reversal(w.name)}


def sleep_level(name: str, text: str) -> int:
    if text not in ("1", "2"):
        raise InvalidBody(f"Query parameter `{name}` must be 1 or 2.", param=name)
    return int(text)


def _swap(svc: Services, w: Worker) -> SwapController:
    if svc.swap is None or w.swap_group is None:
        raise BadRequest(
            f"Worker `{w.name}` does not use sleep mode (give it `sleep:` or a `swap_group`)."
        )
    return svc.swap


def _controlled(swap: SwapController, w: Worker) -> SwapController:
    """``swap``, once this replica controls ``w``'s group (an admin switch of a group another
    replica may control would sleep its holder, or wake a second model beside it)."""
    if not swap.controls(w.name):
        raise ServiceUnavailable(
            f"Swap group `{w.swap_group}` is not controlled by this gateway replica now (its "
            "Redis claim is stale or another replica took it): ask the replica that controls it."
        )
    return swap


async def reload(request: Request) -> ASGIApp:
    """Re-read the whole config (``reload.py``): what changed, and what needs a restart."""
    _query(request, {})
    summary = await reload_config(services(request))
    return ReplyResponse(Reply.json(200, summary))


async def queue(request: Request) -> ASGIApp:
    """Queue depth per model, the oldest wait, per-tenant counts and the slots each replica
    holds."""
    _query(request, {})
    return ReplyResponse(Reply.json(200, await services(request).admission.snapshot()))


async def held(request: Request) -> ASGIApp:
    """Everything requests hold right now: in-flight per worker, admission's slots and queue
    depth, and per-key concurrency slots. All zero when no request is in the gateway (the
    fault and hostile-client suites check exactly that after every case)."""
    _query(request, {})
    svc = services(request)
    snap = await svc.admission.snapshot()
    # the keys file's too, and removed keys whose running requests still hold slots here
    names = sorted({key_name(k) for k in svc.auth.store.keys.values()} | svc.key_limits.holders())
    keys = {name: await svc.key_limits.in_use(name) for name in names}
    return ReplyResponse(
        Reply.json(
            200,
            {
                "inflight": {w.name: w.inflight for w in svc.registry},
                "slots": {n: v.get("held", 0) for n, v in snap.get("workers", {}).items()},
                "queued": {n: v.get("depth", 0) for n, v in snap.get("models", {}).items()},
                "key_slots": keys,
            },
        )
    )


def routes() -> list[Route]:
    return [
        Route("/admin/workers", Endpoint(list_workers), methods=["GET"]),
        Route("/admin/workers/{name}", Endpoint(get_worker), methods=["GET"]),
        Route("/admin/workers/{name}/drain", Endpoint(drain), methods=["POST"]),
        Route("/admin/workers/{name}/undrain", Endpoint(undrain), methods=["POST"]),
        Route("/admin/workers/{name}/stop", Endpoint(stop), methods=["POST"]),
        Route("/admin/workers/{name}/restart", Endpoint(restart), methods=["POST"]),
        Route("/admin/workers/{name}/sleep", Endpoint(sleep), methods=["POST"]),
        Route("/admin/workers/{name}/wake", Endpoint(wake), methods=["POST"]),
        Route("/admin/reload", Endpoint(reload), methods=["POST"]),
        Route("/admin/queue", Endpoint(queue), methods=["GET"]),
        Route("/admin/held", Endpoint(held), methods=["GET"]),
    ]
