"""Requests the lane sends: prompts of a chosen size, streams with TTFT, load phases, metrics."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "and",
    "keeps",
    "running",
    "far",
    "away",
]
VOCAB = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "paper",
    "window",
    "garden",
    "silver",
    "orange",
    "engine",
    "market",
    "winter",
    "summer",
    "forest",
    "castle",
    "rocket",
    "planet",
    "signal",
    "thunder",
    "copper",
    "velvet",
    "harbor",
]


def text_of(words: int, seed: int | None = None) -> str:
    if seed is None:
        return " ".join(WORDS[i % len(WORDS)] for i in range(words))
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(words))


def chat(model: str, content: str, max_tokens: int, stream: bool = False, **kw: Any) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": stream,
    }
    return {**body, **kw}


async def count_tokens(c: httpx.AsyncClient, url: str, model: str, content: str) -> int:
    """Prompt tokens of a one-message chat (chat template included), by the worker's /tokenize."""
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    r = await c.post(url + "/tokenize", json=body, timeout=60)
    r.raise_for_status()
    return int(r.json()["count"])


async def words_for(c: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    """How many of ``text_of``'s words make a prompt of about ``tokens`` tokens."""
    sample = 2000
    per_word = await count_tokens(c, url, model, text_of(sample)) / sample
    return max(1, int(tokens / per_word))


@dataclass
class Outcome:
    """One streamed request as a client saw it."""

    status: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    chunks: int = 0
    error_event: str | None = None
    done: bool = False
    worker: str | None = None
    exception: str | None = None
    body: str = ""
    max_gap_ms: float = 0.0  # the longest wait between two chunks (a migration's: the next token)
    last_at: float | None = None

    def kind(self) -> str:
        if self.exception:
            return "exception"
        if self.status != 200:
            return f"http {self.status}"
        if self.error_event:
            return "error event" + (" + [DONE]" if self.done else " (no [DONE])")
        return "complete" if self.done else "truncated (no [DONE])"


def _read_line(o: Outcome, line: str, t0: float) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        o.done = True
        return
    now = time.perf_counter()
    if o.ttft_ms is None:
        o.ttft_ms = (now - t0) * 1000
    if o.last_at is not None:
        o.max_gap_ms = max(o.max_gap_ms, (now - o.last_at) * 1000)
    o.last_at = now
    o.chunks += 1
    if data.startswith('{"error"') or '"error":' in data[:20]:
        o.error_event = data[:300]


async def stream(c: httpx.AsyncClient, url: str, body: dict, limit_s: float = 300) -> Outcome:
    o = Outcome()
    t0 = time.perf_counter()
    try:
        async with c.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=limit_s
        ) as r:
            o.status, o.worker = r.status_code, r.headers.get("x-gpupool-worker")
            if r.status_code != 200:
                o.body = (await r.aread()).decode(errors="replace")[:300]
            else:
                async for line in r.aiter_lines():
                    _read_line(o, line, t0)
    except (httpx.HTTPError, OSError) as e:
        o.exception = f"{type(e).__name__}: {e}"[:300]
    o.total_ms = (time.perf_counter() - t0) * 1000
    return o


async def post(c: httpx.AsyncClient, url: str, body: dict, limit_s: float = 300) -> dict:
    """A non-streamed request: status, worker header, usage or the error message."""
    t0 = time.perf_counter()
    try:
        r = await c.post(url + "/v1/chat/completions", json=body, timeout=limit_s)
    except (httpx.HTTPError, OSError) as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}"[:300]}
    out: dict[str, Any] = {
        "status": r.status_code,
        "worker": r.headers.get("x-gpupool-worker"),
        "ms": round((time.perf_counter() - t0) * 1000, 1),
    }
    try:
        data = r.json()
    except ValueError:
        return {**out, "error": r.text[:300]}
    if r.status_code == 200:
        out["usage"] = data.get("usage")
    else:
        out["error"] = json.dumps(data)[:400]
    return out


async def load_phase(
    c: httpx.AsyncClient, urls: list[str], bodies: list[dict], concurrency: int
) -> dict[str, Any]:
    """Send ``bodies`` round-robin over ``urls`` with ``concurrency`` at a time; tokens/s."""
    sem = asyncio.Semaphore(concurrency)

    async def go(i: int, body: dict) -> dict:
        async with sem:
            return await post(c, urls[i % len(urls)], body, limit_s=600)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(go(i, b) for i, b in enumerate(bodies)))
    dt = time.perf_counter() - t0
    ok = [r for r in results if r.get("status") == 200]
    tokens = sum(r["usage"]["completion_tokens"] for r in ok if r.get("usage"))
    workers: dict[str, int] = {}
    for r in ok:
        workers[str(r.get("worker"))] = workers.get(str(r.get("worker")), 0) + 1
    return {
        "requests": len(bodies),
        "ok": len(ok),
        "seconds": round(dt, 2),
        "tokens": tokens,
        "tok_s": round(tokens / dt, 1) if dt else 0.0,
        "by_worker": workers,
        "errors": [r.get("error") for r in results if r.get("status") != 200][:3],
    }


@dataclass
class Background:
    """Streams sent back to back by ``n`` clients until stopped; every outcome kept."""

    client: httpx.AsyncClient
    url: str
    body: dict
    n: int
    t0: float
    outcomes: list[tuple[float, Outcome]] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> Background:
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.n)]
        return self

    async def _client(self) -> None:
        while not self._stop.is_set():
            o = await stream(self.client, self.url, self.body, limit_s=120)
            self.outcomes.append((round(time.monotonic() - self.t0, 2), o))
            if o.kind() not in ("complete",):
                await asyncio.sleep(0.2)

    async def stop(self) -> dict[str, int]:
        """Stop now: streams still running are cancelled (and not counted)."""
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return self.summary()

    def summary(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for _, o in self.outcomes:
            kinds[o.kind()] = kinds.get(o.kind(), 0) + 1
        return kinds


async def metrics(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """A Prometheus text page as ``{name: summed value}`` (labels dropped)."""
    try:
        r = await c.get(url + "/metrics", timeout=20)
    except (httpx.HTTPError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def migrations(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The gateway's ``gpupool_migrations_total`` as ``{"cause/outcome": value}`` (models
    summed): requests moved to another worker after their answer began."""
    try:
        r = await c.get(url + "/metrics", timeout=20)
    except (httpx.HTTPError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.startswith("gpupool_migrations_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        cause = _label(labels, "cause")
        outcome = _label(labels, "outcome")
        key = f"{cause}/{outcome}"
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def kv_series(c: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The gateway's precise-routing series (``gpupool_kv_*``: routed mode, predictions against
    vLLM's ``cached_tokens``, indexed blocks, gaps, resyncs), each line's name and labels as key."""
    try:
        r = await c.get(url + "/metrics", timeout=20)
    except (httpx.HTTPError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line.startswith("gpupool_kv_") or line.endswith("_created"):
            continue
        key, _, value = line.rpartition(" ")
        if "_bucket{" in key or "_created" in key:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _label(labels: str, name: str) -> str:
    start = labels.find(f'{name}="')
    if start < 0:
        return "?"
    start += len(name) + 2
    return labels[start : labels.find('"', start)]


def prefix_counts(m: dict[str, float]) -> tuple[float, float]:
    """(queried tokens, hit tokens) of vLLM's prefix cache."""
    q = m.get("vllm:prefix_cache_queries_total", m.get("vllm:prefix_cache_queries", 0.0))
    h = m.get("vllm:prefix_cache_hits_total", m.get("vllm:prefix_cache_hits", 0.0))
    return q, h
