"""What fault tests need around `procs.py`: clients that say exactly what they saw, and the
checks every fault scenario ends with (nothing executed twice, nothing lost, capacity back).

A client's view of one request is an :class:`Outcome` with a short ``label``:

    "200"               a complete answer (a JSON body, or a stream ending in ``data: [DONE]``)
    "200+error-event"   a stream that ended with vLLM's in-stream error event, then [DONE]
    "<status>"          an error status with the OpenAI envelope (429 also needs Retry-After)
    "left"              the client hung up on purpose after its first bytes
    "conn-error"        no HTTP answer at all (the process the client talked to is gone)
    "conn-cut"          a 200 whose body the connection cut short: the client's HTTP library
                        raises (an incomplete chunked body), so it is an error, not a silence
    "timeout"           no answer within the client's timeout: a hang
    "LOST:<why>"        anything else: a truncated stream, a bare 5xx, a 429 without Retry-After

Only the last two count as a request lost without an error; ``conn-error`` and ``conn-cut`` are
honest only where the test killed the process the client was talking to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import Proc

MODEL = "m"
DONE = b"data: [DONE]"


@dataclass(slots=True)
class Outcome:
    rid: str
    label: str
    status: int | None = None
    worker: str | None = None
    elapsed_s: float = 0.0
    ended: float = 0.0  # time.monotonic() when the client was done
    detail: str = ""

    @property
    def lost(self) -> bool:
        return self.label.startswith("LOST") or self.label == "timeout"


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def body(prompt: str = "hello", *, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


# ---- classifying what a client saw ------------------------------------------------------------


def _envelope_ok(status: int, raw: bytes, headers: httpx.Headers) -> str | None:
    """None when ``raw`` is the OpenAI error envelope for ``status``; else why not."""
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return "no-envelope"
    if not isinstance(err, dict) or err.get("code") != status or not err.get("message"):
        return "bad-envelope"
    if status == 429 and not headers.get("retry-after", "").isdigit():
        return "429-without-retry-after"
    return None


def classify_whole(status: int, raw: bytes, headers: httpx.Headers) -> str:
    if 200 <= status < 300:
        try:
            json.loads(raw)
        except ValueError:
            return "LOST:200-not-json"
        return "200"
    why = _envelope_ok(status, raw, headers)
    return str(status) if why is None else f"LOST:{status}-{why}"


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` events of an SSE body (comments such as ``: queued`` dropped)."""
    events = [e.strip(b"\r\n") for e in raw.split(b"\n\n")]
    return [e for e in events if e and not e.startswith(b":")]


def classify_stream(raw: bytes) -> str:
    events = sse_events(raw)
    if not events or events[-1] != DONE:
        return "LOST:truncated-stream"
    if len(events) >= 2 and _is_error_event(events[-2]):
        return "200+error-event"
    return "200"


def _is_error_event(event: bytes) -> bool:
    try:
        obj = json.loads(event.removeprefix(b"data: "))
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


# ---- clients -----------------------------------------------------------------------------------


def async_client(n: int, timeout: float = 30.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


async def call(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    request_id: str,
    headers: dict[str, str] | None = None,
    path: str = "/v1/completions",
) -> Outcome:
    """One request, read to the end; never raises for what the server or network did."""
    t0 = time.monotonic()
    out = Outcome(request_id, "LOST:unknown")
    try:
        h = {"x-request-id": request_id, **(headers or {})}
        async with client.stream("POST", url + path, json=payload, headers=h) as r:
            out.status, out.worker = r.status_code, r.headers.get("x-gpupool-worker")
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        out.label = _classify(r, raw)
    except httpx.TimeoutException:
        out.label = "timeout"
    except httpx.TransportError as e:
        out.label = "conn-error" if out.status is None else "conn-cut"
        out.detail = type(e).__name__
    out.ended = time.monotonic()
    out.elapsed_s = out.ended - t0
    return out


def _classify(r: httpx.Response, raw: bytes) -> str:
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        return classify_stream(raw)
    return classify_whole(r.status_code, raw, r.headers)


async def call_and_leave(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], request_id: str
) -> Outcome:
    """Open a stream, wait for its first ``data:`` event, then hang up."""
    t0 = time.monotonic()
    out = Outcome(request_id, "LOST:no-data-before-end")
    try:
        h = {"x-request-id": request_id}
        async with client.stream("POST", url + "/v1/completions", json=payload, headers=h) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.label = _classify(r, await r.aread())
            else:
                async for chunk in r.aiter_raw():
                    if b"data: " in chunk:
                        out.label = "left"
                        break
    except httpx.TimeoutException:
        out.label = "timeout"
    except httpx.TransportError as e:
        out.label, out.detail = "conn-error", type(e).__name__
    out.ended = time.monotonic()
    out.elapsed_s = out.ended - t0
    return out


def labels(outcomes: Iterable[Outcome]) -> dict[str, int]:
    return dict(sorted(Counter(o.label for o in outcomes).items()))


# ---- the state of workers and gateways --------------------------------------------------------


def sim_stats(p: Proc) -> dict[str, Any]:
    return dict(httpx.get(p.url + "/sim/stats", timeout=5).json())


def workers(gw: Proc) -> dict[str, dict[str, Any]]:
    data = httpx.get(gw.url + "/admin/workers", timeout=5).json()["data"]
    return {w["name"]: w for w in data}


def held_slots(gw: Proc) -> int:
    """Slots held according to ``/admin/queue``: Redis's view, and this replica's local one."""
    snap = httpx.get(gw.url + "/admin/queue", timeout=5).json()
    views = [snap.get("workers", {})]
    if isinstance(snap.get("local"), dict):
        views.append(snap["local"].get("workers", {}))
    return max(sum(int(v.get("held", 0)) for v in view.values()) for view in views)


def queue_depth(gw: Proc) -> int:
    snap = httpx.get(gw.url + "/admin/queue", timeout=5).json()
    return sum(int(m.get("depth", 0)) for m in snap.get("models", {}).values())


def wait_until(what: str, check: Callable[[], bool], timeout: float, every: float = 0.05) -> float:
    """Seconds until ``check()`` held; AssertionError naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(every)


def wait_state(gw: Proc, worker: str, state: str, timeout: float = 20) -> float:
    return wait_until(
        f"worker {worker} -> {state}", lambda: workers(gw)[worker]["state"] == state, timeout
    )


def settled(gws: list[Proc], sims: list[Proc], timeout: float = 15) -> float:
    """Seconds until no worker runs anything and no gateway holds a slot or counts in-flight."""

    def idle() -> bool:
        if any(sim_stats(s)["running"] for s in sims):
            return False
        return all(held_slots(g) == 0 and nothing_held(g) for g in gws)

    return wait_until("workers idle, no in-flight, no held slot or key slot", idle, timeout)


def nothing_held(gw: Proc) -> bool:
    """``/admin/held``: in-flight, admission slots, queue and key slots all zero."""
    snap = httpx.get(gw.url + "/admin/held", timeout=5).json()
    return not any(int(v) for part in snap.values() for v in part.values())


def fresh_request(gw: Proc, *, stream: bool = False, timeout: float = 30) -> Outcome:
    async def one() -> Outcome:
        async with async_client(1, timeout) as c:
            return await call(c, gw.url, body("after", stream=stream), rid("after"))

    return asyncio.run(one())


def executed(*sims_or_ids: Proc | list[str]) -> list[str]:
    """Every request id the workers started (lists are ids read before a worker died)."""
    ids: list[str] = []
    for s in sims_or_ids:
        ids += s if isinstance(s, list) else sim_stats(s)["request_ids"]
    return ids


def duplicates(ids: list[str]) -> dict[str, int]:
    return {k: n for k, n in Counter(ids).items() if n > 1}


# ---- process environment and reporting ----------------------------------------------------------


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft fd limit (children started afterwards inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def report(scenario: str, **numbers: Any) -> None:
    """Print one line of results (``pytest -s`` shows it); also append it as JSON to the file
    named by ``GPUPOOL_FAULT_RESULTS`` when set."""
    line = json.dumps({"scenario": scenario, **numbers}, default=str)
    print(f"\nFAULT-RESULT {line}")
    path = os.environ.get("GPUPOOL_FAULT_RESULTS")
    if path:
        with Path(path).open("a") as f:
            f.write(line + "\n")


def gateway_config(
    workers_: list[tuple[str, Proc, int]], *, queue: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """A gateway over ``(name, sim, max_inflight)`` workers, polling health every 0.2 s."""
    routing = {"health_interval_s": 0.2, "fail_threshold": 2, **extra.pop("routing", {})}
    return {
        "server": {"expose_worker_header": True, **extra.pop("server", {})},
        "models": [{"name": MODEL}],
        "workers": [
            {"name": n, "model": MODEL, "url": p.url, "max_inflight": c} for n, p, c in workers_
        ],
        "queue": {"max_wait_s": 30, "keepalive_interval_s": 0.5, **(queue or {})},
        "routing": routing,
        **extra,
    }
