"""The four workloads of issue 15, each one async function run against one router at a time.

Every request is a streamed chat completion with ``ignore_eos`` and a fixed ``max_tokens``, so the
work per request does not depend on the random weights; TTFT is the time to the first ``data:``
event (vLLM sends its first event with the first token). Prompts are pseudo-words sized in tokens
with a ratio measured on the workers' ``/tokenize``; a round's ``seed`` makes its prompts, so every
router of one round gets the same prompts and the next round new ones (no cache carried over).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pool

_SYL = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pra", "gel", "dor", "fin", "wex", "bu"]


@dataclass
class Sizes:
    """Everything a workload's size depends on; the command line sets each (see run.py)."""

    tokens_per_word: float = 1.0
    # 1: multi-turn conversations
    conversations: int = 12  # with the default --kv-blocks: more than one worker's cache holds
    turns: int = 4
    system_tokens: int = 1000
    turn_tokens: int = 120
    reply_tokens: int = 60
    think_s: float = 2.0
    stagger_s: float = 0.2
    # 2: mixed context lengths
    mixed_requests: int = 32
    mixed_long_every: int = 4
    # 0: from the long worker's measured prefill (run.py's calibrate), so that the long
    # prompts' prefills take mixed_long_load of its time on any machine
    mixed_gap_s: float = 0.0
    mixed_long_load: float = 0.5
    mixed_short_max: int = 1500  # its short prompts: short_tokens to this many, evenly
    short_tokens: int = 300
    long_tokens: int = 2600
    # 3: batch flood and an interactive tenant
    flood: int = 48
    flood_tokens: int = 200
    flood_max_tokens: int = 48
    interactive: int = 8
    interactive_tokens: int = 100
    interactive_gap_s: float = 0.3
    # 4: one slowed worker
    hogs: int = 3
    hog_tokens: int = 1500
    uneven_requests: int = 24
    uneven_gap_s: float = 0.3
    # 5: many tenants, each a long shared prefix and short questions (llm-d's shape)
    tenants: int = 12  # with the default --kv-blocks: more prefixes than one worker's cache holds
    tenant_prefix_tokens: int = 1500
    question_tokens: int = 40
    tenants_s: float = 40.0  # arrivals for this long; a request unanswered tenants_grace_s
    tenants_grace_s: float = 30.0  # after the last arrival is cut off (no first token: inf)
    # 0: from run.py's calibrate_tenants, so that the requests' work on the idle workers, half
    # of them finding their prefix cached, is tenants_load of the pool's time
    tenants_gap_s: float = 0.0
    tenants_load: float = 1.0
    tenants_max_tokens: int = 4  # short answers: the prefill, cached or not, is most of the work
    max_tokens: int = 16


@dataclass
class Call:
    status: int
    ttft: float
    latency: float
    error: str = ""


@dataclass
class Ctx:
    session: aiohttp.ClientSession
    workers: list[pool.Worker]
    sizes: Sizes
    seed: int
    slow_worker: str
    extra: dict[str, Any] = field(default_factory=dict)


def text(rng: random.Random, tokens: int, tpw: float) -> str:
    words = max(1, round(tokens / tpw))
    return " ".join(
        "".join(rng.choice(_SYL) for _ in range(rng.randint(1, 3))) for _ in range(words)
    )


async def chat(ctx: Ctx, url: str, messages: list[dict[str, str]], max_tokens: int,
               key: str = "sk-bench", session: str | None = None) -> Call:  # fmt: skip
    body = {"model": pool.SERVED, "messages": messages, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if session is not None:  # what vllm-router's consistent_hash keys on (gpupool: the prefix)
        headers["x-session-id"] = session
    t0 = time.perf_counter()
    ttft = float("nan")
    try:
        async with ctx.session.post(url + "/v1/chat/completions", data=orjson.dumps(body),
                                    headers=headers) as r:  # fmt: skip
            if r.status != 200:
                err = (await r.read())[:200].decode(errors="replace")
                return Call(r.status, ttft, time.perf_counter() - t0, err)
            async for line in r.content:
                if ttft != ttft and line.startswith(b"data: {"):
                    ttft = time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError) as e:
        return Call(-1, ttft, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    return Call(200, ttft, time.perf_counter() - t0)


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


# ---- 1: multi-turn conversations --------------------------------------------------------------


async def multi_turn(ctx: Ctx, url: str) -> dict[str, Any]:
    sz = ctx.sizes
    before = pool.snapshot(ctx.workers)
    calls: list[tuple[int, Call]] = []

    async def conversation(i: int) -> None:
        rng = random.Random(f"{ctx.seed}-conv-{i}")
        history = [{"role": "system", "content": text(rng, sz.system_tokens, sz.tokens_per_word)}]
        await asyncio.sleep(i * sz.stagger_s)
        for t in range(sz.turns):
            history.append(_user(text(rng, sz.turn_tokens, sz.tokens_per_word)))
            call = await chat(ctx, url, history, sz.max_tokens, session=f"{ctx.seed}-{i}")
            calls.append((t, call))
            reply = text(rng, sz.reply_tokens, sz.tokens_per_word)
            history.append({"role": "assistant", "content": reply})
            await asyncio.sleep(sz.think_s * rng.uniform(0.5, 1.5))

    await asyncio.gather(*(conversation(i) for i in range(sz.conversations)))
    after = pool.snapshot(ctx.workers)
    hits = sum(pool.delta(before, after, "vllm:prefix_cache_hits_total").values())
    queries = sum(pool.delta(before, after, "vllm:prefix_cache_queries_total").values())
    ok = [c for _, c in calls if c.status == 200]
    return {
        "ttft": [c.ttft for c in ok],
        "ttft_later_turns": [c.ttft for t, c in calls if t > 0 and c.status == 200],
        "errors": len(calls) - len(ok),
        "hit_rate": hits / queries if queries else float("nan"),
        "served": pool.delta(before, after, "vllm:request_success_total"),
    }


# ---- 2: mixed context lengths -----------------------------------------------------------------


async def mixed(ctx: Ctx, url: str) -> dict[str, Any]:
    sz = ctx.sizes
    rng = random.Random(f"{ctx.seed}-mixed")
    # Long ones at random places (a fixed pattern could beat or match a round-robin's parity).
    kinds = ["long" if rng.random() < 1 / sz.mixed_long_every else "short"
             for _ in range(sz.mixed_requests)]  # fmt: skip
    # The short ones range up to what the short window holds with room (prompts of chat and
    # retrieval): work enough that where they go decides whether a long one finds its worker
    # free; 300-token prompts alone cost a CPU worker about 0.1 s, too little to tell.
    sizes = [sz.long_tokens if k == "long" else rng.randint(sz.short_tokens, sz.mixed_short_max)
             for k in kinds]  # fmt: skip
    prompts = [text(rng, n, sz.tokens_per_word) for n in sizes]
    before = pool.snapshot(ctx.workers)
    t0 = time.perf_counter()

    async def one(i: int) -> Call:
        await asyncio.sleep(i * sz.mixed_gap_s)
        return await chat(ctx, url, [_user(prompts[i])], sz.max_tokens)

    calls = await asyncio.gather(*(one(i) for i in range(len(kinds))))
    wall = time.perf_counter() - t0
    after = pool.snapshot(ctx.workers)
    out: dict[str, Any] = {
        "wall": wall,
        "served": pool.delta(before, after, "vllm:request_success_total"),
    }
    for kind in ("long", "short"):
        mine = [c for k, c in zip(kinds, calls, strict=True) if k == kind]
        out[f"{kind}_ttft"] = [c.ttft for c in mine if c.status == 200]
        out[f"{kind}_errors"] = sum(c.status != 200 for c in mine)
        out[f"{kind}_error_sample"] = next((c.error for c in mine if c.status != 200), "")
    # each long request's TTFT in order, None where it failed: routers compared on the same ones
    out["long_each"] = [c.ttft if c.status == 200 else None
                        for k, c in zip(kinds, calls, strict=True) if k == "long"]  # fmt: skip
    out["ok_per_s"] = sum(c.status == 200 for c in calls) / wall
    out["long_worker"] = max(ctx.workers, key=lambda w: w.spec.window).name
    return out


# ---- 3: a batch flood and an interactive tenant -----------------------------------------------


async def _interactive(ctx: Ctx, url: str, rng: random.Random) -> list[Call]:
    sz = ctx.sizes
    out = []
    for _ in range(sz.interactive):
        msg = [_user(text(rng, sz.interactive_tokens, sz.tokens_per_word))]
        out.append(await chat(ctx, url, msg, sz.max_tokens, key="sk-interactive"))
        await asyncio.sleep(sz.interactive_gap_s)
    return out


async def flood(ctx: Ctx, url: str) -> dict[str, Any]:
    sz = ctx.sizes
    rng = random.Random(f"{ctx.seed}-flood")
    idle = await _interactive(ctx, url, rng)
    batch_msgs = [[_user(text(rng, sz.flood_tokens, sz.tokens_per_word))] for _ in range(sz.flood)]
    t0 = time.perf_counter()
    batch = [asyncio.ensure_future(chat(ctx, url, m, sz.flood_max_tokens, key="sk-batch"))
             for m in batch_msgs]  # fmt: skip
    await asyncio.sleep(0.5)
    busy = await _interactive(ctx, url, rng)
    done = await asyncio.gather(*batch)
    return {
        "idle": [c.latency for c in idle if c.status == 200],
        "flood": [c.latency for c in busy if c.status == 200],
        "errors": sum(c.status != 200 for c in [*idle, *busy, *done]),
        "batch_wall": time.perf_counter() - t0,
    }


# ---- 4: one slowed worker ---------------------------------------------------------------------


async def _hog(
    ctx: Ctx, url: str, rng: random.Random, stop: asyncio.Event, count: list[int]
) -> None:
    sz = ctx.sizes
    while not stop.is_set():
        await chat(ctx, url, [_user(text(rng, sz.hog_tokens, sz.tokens_per_word))], sz.max_tokens)
        count[0] += 1


async def uneven(ctx: Ctx, url: str) -> dict[str, Any]:
    sz = ctx.sizes
    rng = random.Random(f"{ctx.seed}-uneven")
    slow = next(w for w in ctx.workers if w.name == ctx.slow_worker)
    prompts = [text(rng, sz.short_tokens, sz.tokens_per_word) for _ in range(sz.uneven_requests)]
    stop, hogged = asyncio.Event(), [0]
    rngs = [random.Random(f"{ctx.seed}-hog-{i}") for i in range(sz.hogs)]
    hogs = [asyncio.ensure_future(_hog(ctx, slow.url, r, stop, hogged)) for r in rngs]
    await asyncio.sleep(3.0)  # the hog is running; scrapers can see it
    before, hogged_before = pool.snapshot(ctx.workers), hogged[0]

    async def one(i: int) -> Call:
        await asyncio.sleep(i * sz.uneven_gap_s)
        return await chat(ctx, url, [_user(prompts[i])], sz.max_tokens)

    calls = await asyncio.gather(*(one(i) for i in range(sz.uneven_requests)))
    after, hog_done = pool.snapshot(ctx.workers), hogged[0] - hogged_before
    stop.set()
    for h in hogs:
        h.cancel()
    await asyncio.gather(*hogs, return_exceptions=True)
    served = pool.delta(before, after, "vllm:request_success_total")
    return {
        "latency": [c.latency for c in calls if c.status == 200],
        "ttft": [c.ttft for c in calls if c.status == 200],
        "errors": sum(c.status != 200 for c in calls),
        "served": served,
        "hog_done": hog_done,
        "slow_worker": slow.name,
    }


# ---- 5: many tenants with long shared prefixes (llm-d's precise-routing benchmark, small) ------


def tenant_prefixes(sz: Sizes, seed: int) -> list[str]:
    rng = random.Random(f"{seed}-tenants")
    return [text(rng, sz.tenant_prefix_tokens, sz.tokens_per_word) for _ in range(sz.tenants)]


async def tenants(ctx: Ctx, url: str) -> dict[str, Any]:
    """Open-loop (Poisson) arrivals every ``tenants_gap_s`` on average for ``tenants_s``, each a
    random tenant's system prompt and a new short question: the prefixes together are more than
    one worker's KV cache holds, so where a tenant's requests go decides whether vLLM finds its
    prefix cached. A request still without its first token ``tenants_grace_s`` after the last
    arrival is cancelled and counts as never answered (TTFT inf)."""
    sz = ctx.sizes
    rng = random.Random(f"{ctx.seed}-tenant-arrivals")
    prefixes = tenant_prefixes(sz, ctx.seed)
    plan: list[tuple[float, int, str]] = []
    at = 0.0
    while at < sz.tenants_s:
        plan.append((at, rng.randrange(sz.tenants), text(rng, sz.question_tokens,
                                                         sz.tokens_per_word)))  # fmt: skip
        at += rng.expovariate(1 / sz.tenants_gap_s)
    before = pool.snapshot(ctx.workers)
    t0 = time.perf_counter()
    finished: list[float] = [math.inf] * len(plan)

    async def one(i: int) -> Call:
        start, tenant, question = plan[i]
        await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
        msgs = [{"role": "system", "content": prefixes[tenant]}, _user(question)]
        call = await chat(ctx, url, msgs, sz.tenants_max_tokens)
        finished[i] = time.perf_counter() - t0
        return call

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(plan))]
    done, pending = await asyncio.wait(tasks, timeout=sz.tenants_s + sz.tenants_grace_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.sleep(1.0)  # the workers abort what was cancelled
    after = pool.snapshot(ctx.workers)
    calls = [t.result() if t in done else None for t in tasks]
    hits = sum(pool.delta(before, after, "vllm:prefix_cache_hits_total").values())
    queries = sum(pool.delta(before, after, "vllm:prefix_cache_queries_total").values())
    ok = [c for c in calls if c is not None and c.status == 200]
    in_window = [f for c, f in zip(calls, finished, strict=True)
                 if c is not None and c.status == 200 and f <= sz.tenants_s]  # fmt: skip
    return {
        # every request sent: inf where no first token came (cancelled or failed)
        "ttft": [c.ttft if c is not None and c.status == 200 else math.inf for c in calls],
        "completed": len(ok),
        "completed_in_window": len(in_window),
        "sent": len(plan),
        "errors": sum(1 for c in calls if c is not None and c.status != 200),
        "cancelled": len(pending),
        "hit_rate": hits / queries if queries else float("nan"),
        "served": pool.delta(before, after, "vllm:request_success_total"),
    }


Workload = Callable[[Ctx, str], Awaitable[dict[str, Any]]]
WORKLOADS: dict[str, Workload] = {
    "multi_turn": multi_turn,
    "mixed": mixed,
    "flood": flood,
    "uneven": uneven,
    "tenants": tenants,
}
