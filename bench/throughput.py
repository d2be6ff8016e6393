"""Does routing cost throughput? gpupool against clients pinned evenly, on GPU-shaped simulators.

    .venv/bin/python bench/throughput.py [--rounds 2] [--window 3] [--only same,chats] [--json F]

Two ``gpupool sim --gpu`` workers of one model, a 32K and a 4K window (the GPU lane's dense
pair, scaled down in time), run at saturation: as many closed-loop clients as the workers have
``max-num-seqs`` together. Each workload runs in rounds of two windows, one with the clients
pinned evenly to the workers (``direct``: client k on worker k mod 2) and one through
``gpupool serve`` in front of both; the order alternates (ABBA). Tokens/s are the workers' own
``vllm:generation_tokens_total`` over a window after a warm-up; the split is each worker's
``vllm:request_success_total`` in it. One gateway serves every round, as on the lane, so what it
learns in one round (pace, affinity, footprint, load scrapes of the direct clients' work) is
there in the next.

Workloads (half the clients stream, half take whole bodies, in both modes alike):
``distinct`` a new prompt every request; ``system`` one long system prompt shared by every
client, a new question each; ``chats`` multi-turn conversations, all opening together at the
window's start, a new one after a few turns; ``same`` the lane's own: one prompt for every
request. ``together`` (not saturated) opens a few conversations at one instant on idle workers,
through gpupool and pinned; the split of its requests is what it measures.

The throughput guard (``tests/gateway/routing/test_throughput_guard.py``) runs this in
``make test``; ``make bench-throughput`` prints the same figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
MODEL = "m"
WORKERS = (("big", 32768), ("small", 4096))
GEN = "vllm:generation_tokens_total{"
DONE = 'vllm:request_success_total{engine="0",finished_reason="'
VOCAB = [
    "able", "acid", "aged", "also", "area", "army", "away", "baby", "back", "ball", "band",
    "bank", "base", "bath", "bear", "beat", "been", "beer", "bell", "belt", "best", "bill",
    "bird", "blow", "blue", "boat", "body", "bomb", "bond", "bone", "book", "boom", "born",
    "boss", "both", "bowl", "bulk", "burn", "bush", "busy", "call", "calm", "came", "camp",
    "card", "care", "case", "cash", "cast", "cell", "chat", "chip", "city", "club", "coal",
    "coat", "code", "cold", "come", "cook", "cool", "cope", "copy", "core", "cost", "crew",
]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    """Both workers' engine (``gpupool sim --gpu``) and the requests' sizes.

    Steps are long against the gateway's per-request cost (a millisecond or two) so the ratio
    measures placement, not the host: a request that finishes is replaced within the next step
    whether it went through gpupool or not."""

    max_num_seqs: int = 16
    step_ms: float = 40.0
    seq_step_ms: float = 1.0
    tokens_per_step: int = 4
    prefill_ms_per_1k: float = 10.0
    max_num_batched_tokens: int = 2048
    min_tokens: int = 16
    max_tokens: int = 64
    # The gateway's /metrics scrape period, scaled with the steps (a request here takes about a
    # fifth of the GPU lane's): a scrape taken while the pinned clients ran is gone within a
    # round's warm-up, as the lane's 1 s scrapes are within its 4 s warm-up.
    metrics_interval_s: float = 0.25

    def sim_args(self) -> list[str]:
        return [
            "--gpu", "--max-num-seqs", str(self.max_num_seqs), "--step-ms", str(self.step_ms),
            "--seq-step-ms", str(self.seq_step_ms), "--tokens-per-step",
            str(self.tokens_per_step), "--prefill-ms-per-1k", str(self.prefill_ms_per_1k),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--mode", "lorem",
            "--output-tokens", str(self.max_tokens),  # max_tokens cuts every answer
        ]  # fmt: skip


# ---- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pool:
    """The two simulated workers (``direct``: their URLs by name) and the gateway in front."""

    direct: dict[str, str]
    gateway: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def _spawn(
    argv: list[str], log: Path, tree: Path = ROOT, extra: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (``python -m ...``) in ``tree``, importing that tree's gpupool."""
    env = {**os.environ, "PYTHONPATH": str(tree), **(extra or {})}
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=tree, env=env, start_new_session=True
        )


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def gateway_config(
    direct: dict[str, str], shape: Shape, port: int, state: Path,
    kv: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """gpupool's defaults but the scrape period, two ``url:`` workers whose capacity is their
    ``max-num-seqs`` (what a launched worker gets from its ``--max-num-seqs``); with ``kv``, each
    worker's KV-event endpoints (precise prefix routing)."""
    capacity = shape.max_num_seqs
    workers = [{"name": n, "model": MODEL, "url": u, "max_inflight": capacity}
               for n, u in direct.items()]  # fmt: skip
    for w in workers:
        if kv is not None:
            w["kv_events"] = kv[str(w["name"])]
    return {
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "expose_worker_header": True,
            "state_dir": str(state),
        },
        "models": [{"name": MODEL}],
        "workers": workers,
        "routing": {"metrics_interval_s": shape.metrics_interval_s},
    }


@contextlib.contextmanager
def pool(
    shape: Shape, tmp: Path | None = None, gateway_tree: Path = ROOT, kv: Path | None = None,
    routing: dict[str, Any] | None = None,
) -> Iterator[Pool]:  # fmt: skip
    """Start both simulators and ``gpupool serve`` (``gateway_tree``'s: another checkout or a
    ``git archive`` of a commit, for a baseline); stop all of them on every exit. ``kv``: a model
    directory: the simulators publish KV-cache events, hashing prompts with its tokenizer, and
    the gateway routes precisely on them; ``routing``: settings over the gateway's defaults."""
    tmp = tmp or Path(tempfile.mkdtemp(prefix="gpupool-tput-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        direct: dict[str, str] = {}
        events: dict[str, dict[str, str]] = {}
        for name, window in WORKERS:
            port = free_port()
            argv = [sys.executable, "-m", "gpupool.workers.sim", "--port", str(port),
                    "--served-model-name", MODEL, "--max-model-len", str(window),
                    *shape.sim_args()]  # fmt: skip
            if kv is not None:
                ends = {"endpoint": f"ipc://{tmp}/{name}.pub",
                        "replay_endpoint": f"ipc://{tmp}/{name}.replay"}  # fmt: skip
                argv += ["--tokenizer", str(kv), "--kv-events-config", json.dumps(ends)]
                events[name] = {**ends, "hash_seed": "0", "tokenizer": str(kv)}
            log = tmp / f"sim-{name}.log"
            procs.append(_spawn(argv, log, extra={"PYTHONHASHSEED": "0"} if kv else None))
            direct[name] = f"http://127.0.0.1:{port}"
            _wait_ready(direct[name] + "/health", procs[-1], log)
        port = free_port()
        cfg = gateway_config(direct, shape, port, tmp / "state", events if kv else None)
        cfg["routing"].update(routing or {})
        path = tmp / "gpupool.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = tmp / "gateway.log"
        argv = [sys.executable, "-m", "gpupool", "serve", "--config", str(path)]
        procs.append(_spawn(argv, log, gateway_tree))
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url + "/ready", procs[-1], log)
        yield Pool(direct, url, procs)
    finally:
        for p in reversed(procs):
            _stop(p)


# ---- workloads ---------------------------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


SYSTEM = "You are a careful assistant. " + words(random.Random(-1), 700)
SAME = words(random.Random(-2), 150)


class Client:
    """One closed-loop client's requests: seeded by its index and the round, so both modes of
    a round send the same sequence."""

    def __init__(self, kind: str, k: int, seed: int, shape: Shape) -> None:
        self.kind, self.k = kind, k
        self.rng = random.Random(seed * 100_003 + k)
        self.shape = shape
        self.stream = (k // 2) % 2 == 1  # both workers get as many streamed clients directly
        self.turns: list[dict[str, str]] = []
        self.turns_left = 0

    def body(self) -> dict[str, Any]:
        rng = self.rng
        max_tokens = rng.randint(self.shape.min_tokens, self.shape.max_tokens)
        body = {"model": MODEL, "messages": self._messages(), "max_tokens": max_tokens,
                "stream": self.stream, "temperature": 0.8}  # fmt: skip
        return body

    def answered(self) -> None:
        if self.kind in ("chats", "together"):
            self.turns.append({"role": "assistant", "content": words(self.rng, 30)})

    def _messages(self) -> list[dict[str, str]]:
        rng = self.rng
        if self.kind == "distinct":
            return [{"role": "user", "content": f"{self.k}: " + words(rng, 150)}]
        if self.kind == "system":
            return [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": words(rng, 20)}]  # fmt: skip
        if self.kind == "same":
            return [{"role": "user", "content": SAME}]
        if self.turns_left <= 0:  # a new conversation
            self.turns, self.turns_left = [], rng.randint(3, 6)
        self.turns_left -= 1
        self.turns.append({"role": "user", "content": words(rng, 40)})
        return list(self.turns)


async def _send(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str | None:
    """Send one request and read its answer; the worker gpupool names (``None`` direct)."""
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        raw = b"".join([part async for part in r.aiter_raw()])
    if r.status_code != 200:
        raise RuntimeError(f"{url}: {r.status_code} {raw[:300]!r}")
    return r.headers.get("x-gpupool-worker")


async def _loop(http: httpx.AsyncClient, url: str, client: Client) -> None:
    while True:
        await _send(http, url, client.body())
        client.answered()


# ---- measuring ---------------------------------------------------------------------------


@dataclass
class Counters:
    tokens: dict[str, float]
    done: dict[str, float]
    at: float


async def counters(http: httpx.AsyncClient, direct: dict[str, str]) -> Counters:
    tokens: dict[str, float] = {}
    done: dict[str, float] = {}
    for name, url in direct.items():
        text = (await http.get(url + "/metrics")).text
        tokens[name], done[name] = 0.0, 0.0
        for line in text.splitlines():
            if line.startswith(GEN):
                tokens[name] = float(line.rsplit(" ", 1)[1])
            elif line.startswith(DONE) and ('"stop"' in line or '"length"' in line):
                done[name] += float(line.rsplit(" ", 1)[1])
    return Counters(tokens, done, time.monotonic())


async def idle(
    http: httpx.AsyncClient, pool_: Pool, within_s: float = 30, scraped: bool = False
) -> None:
    """Wait until neither worker runs or queues anything and the gateway holds no slot;
    ``scraped``: and the gateway's last scrape of each worker says so too (a scrape taken as a
    window's clients went away shows their work as outside work until the next one)."""
    deadline = time.monotonic() + within_s
    while True:
        busy = []
        for name, url in pool_.direct.items():
            stats = (await http.get(url + "/sim/stats")).json()
            if stats["running"] or stats["waiting"]:
                busy.append(name)
        gw = (await http.get(pool_.gateway + "/admin/workers")).json()["data"]
        seen = scraped and any(w["vllm"]["running"] or w["vllm"]["waiting"] for w in gw)
        if not busy and not seen and not any(w["inflight"] for w in gw):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"still busy after the window: {busy}, gateway {gw}")
        await asyncio.sleep(0.05)


@dataclass
class Window:
    mode: str
    tok_s: float
    tokens: dict[str, float]
    done: dict[str, float]
    seconds: float


async def window(
    http: httpx.AsyncClient, pool_: Pool, mode: str, kind: str, seed: int, shape: Shape,
    warm_s: float, window_s: float,
) -> Window:  # fmt: skip
    """``2 x max_num_seqs`` closed-loop clients for ``warm_s + window_s``; the counters over
    the last ``window_s``."""
    names = list(pool_.direct)
    clients = [Client(kind, k, seed, shape) for k in range(shape.max_num_seqs * len(names))]

    def route(k: int) -> str:
        return pool_.gateway if mode == "gpupool" else pool_.direct[names[k % len(names)]]

    await _warm_shared(http, pool_, clients[0])
    tasks = [asyncio.create_task(_loop(http, route(c.k), c)) for c in clients]
    try:
        await _sleep_watching(warm_s, tasks)
        c0 = await counters(http, pool_.direct)
        await _sleep_watching(window_s, tasks)
        c1 = await counters(http, pool_.direct)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await idle(http, pool_)
    seconds = c1.at - c0.at
    tokens = {n: c1.tokens[n] - c0.tokens[n] for n in names}
    done = {n: c1.done[n] - c0.done[n] for n in names}
    return Window(mode, sum(tokens.values()) / max(seconds, 1e-9), tokens, done, seconds)


async def _warm_shared(http: httpx.AsyncClient, pool_: Pool, client: Client) -> None:
    """Put a prompt every client shares into both caches first, as a steady state holds it:
    else the window opens with every slot prefilling it at once (no prompt hits another's
    blocks before they are computed), a storm longer than the warm-up."""
    if client.kind not in ("system", "same"):
        return
    body = {**Client(client.kind, -1, 0, client.shape).body(), "max_tokens": 1, "stream": False}
    for url in pool_.direct.values():
        await _send(http, url, body)


async def _sleep_watching(seconds: float, tasks: list[asyncio.Task[None]]) -> None:
    """Sleep, but fail at once when a client failed (a non-200 is a broken run, not a figure)."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        t.result()


@dataclass
class Round:
    kind: str
    index: int
    order: list[str]
    direct: Window
    gpupool: Window

    @property
    def ratio(self) -> float:
        return self.gpupool.tok_s / self.direct.tok_s if self.direct.tok_s else 0.0

    def line(self) -> str:
        def split(w: Window) -> str:
            return "/".join(f"{w.done[n]:.0f}" for n in w.done)

        return (
            f"{self.kind:<9} round {self.index} ({'-'.join(self.order)}): "
            f"direct {self.direct.tok_s:7.1f} tok/s split {split(self.direct):>7}  "
            f"gpupool {self.gpupool.tok_s:7.1f} tok/s split {split(self.gpupool):>7}  "
            f"ratio {self.ratio:.3f}"
        )


async def rounds(
    http: httpx.AsyncClient, pool_: Pool, kind: str, count: int, shape: Shape,
    warm_s: float, window_s: float, first: int = 0, say: Callable[[str], None] = print,
    aa: bool = False,
) -> list[Round]:  # fmt: skip
    """``count`` rounds of ``kind``; round i runs direct first when ``first + i`` is even.
    ``aa``: the "gpupool" window is pinned too (the ratio's noise floor, A/A)."""
    out: list[Round] = []
    await reset_caches(http, pool_)  # an unmeasured pass: a kind's first window ran slow
    await window(http, pool_, "direct", kind, count, shape, min(warm_s, 0.5), 0.0)
    for i in range(count):
        order = ["direct", "gpupool"] if (first + i) % 2 == 0 else ["gpupool", "direct"]
        got: dict[str, Window] = {}
        for mode in order:
            await reset_caches(http, pool_)
            routed = "direct" if aa else mode
            got[mode] = await window(http, pool_, routed, kind, i, shape, warm_s, window_s)
        r = Round(kind, i, order, got["direct"], got["gpupool"])
        say(r.line())
        out.append(r)
    return out


async def reset_caches(http: httpx.AsyncClient, pool_: Pool) -> None:
    """Both modes of a round start with empty prefix caches (vLLM's ``/reset_prefix_cache``)."""
    for url in pool_.direct.values():
        (await http.post(url + "/reset_prefix_cache")).raise_for_status()


@dataclass
class Burst:
    mode: str
    done: dict[str, float]  # each worker's completed requests (its own counter)
    seconds: float
    turns: list[dict[str, int]]  # where each turn went, the openings first

    @property
    def spread(self) -> float:
        return max(self.done.values()) - min(self.done.values())

    @property
    def opening_spread(self) -> int:
        opening = self.turns[0]
        return max(opening.values()) - min(opening.values())

    def line(self) -> str:
        def split(d: dict[str, float] | dict[str, int]) -> str:
            return "/".join(f"{v:.0f}" for v in d.values())

        per_turn = " ".join(split(t) for t in self.turns)
        return (f"{self.mode}: requests per worker {split(self.done)} (turn by turn {per_turn})"
                f" in {self.seconds:.2f} s")  # fmt: skip


async def burst(
    http: httpx.AsyncClient, pool_: Pool, mode: str, conversations: int, turns: int,
    shape: Shape, seed: int = 7,
) -> Burst:  # fmt: skip
    """``conversations`` chats of ``turns`` turns each, all opening at one instant on idle
    workers (as the gateway last saw them, too); each worker's completed requests, where each
    turn went and the time the last one took."""
    await idle(http, pool_, scraped=True)
    await reset_caches(http, pool_)
    names = list(pool_.direct)
    go = asyncio.Event()
    placed = [dict.fromkeys(names, 0) for _ in range(turns)]

    async def chat(k: int) -> None:
        client = Client("together", k, seed, shape)
        client.turns_left = turns
        pinned = names[k % len(names)]
        url = pool_.gateway if mode == "gpupool" else pool_.direct[pinned]
        await go.wait()
        for turn in range(turns):
            worker = await _send(http, url, client.body()) or pinned
            placed[turn][worker] += 1
            client.answered()

    c0 = await counters(http, pool_.direct)
    tasks = [asyncio.create_task(chat(k)) for k in range(conversations)]
    await asyncio.sleep(0.05)
    go.set()
    started = time.monotonic()
    await asyncio.gather(*tasks)
    seconds = time.monotonic() - started
    c1 = await counters(http, pool_.direct)
    return Burst(mode, {n: c1.done[n] - c0.done[n] for n in names}, seconds, placed)


# ---- the whole run -----------------------------------------------------------------------

KINDS = ("distinct", "system", "chats", "same")


@dataclass(frozen=True)
class Plan:
    """What one run measures: ``count`` rounds of each of ``kinds`` (``warm_s`` then
    ``window_s`` per mode), and bursts of ``conversations`` chats of ``turns`` turns before and
    after them (``burst_direct``: also pinned, for the time it takes)."""

    kinds: tuple[str, ...] = KINDS
    count: int = 2
    warm_s: float = 1.0
    window_s: float = 3.0
    conversations: int = 6
    turns: int = 4
    burst_direct: bool = True
    aa: bool = False  # both windows of a round pinned: the ratio's own noise
    # A workload below ``floor`` (a burst whose openings end more than one apart) is measured
    # again, up to ``confirm`` more times, and judged by its best attempt: a busy host costs a
    # round now and then (or staggers six openings), a placement fault every time.
    floor: float = 0.97
    confirm: int = 0


@dataclass
class Report:
    rounds: list[Round]
    bursts: list[Burst]
    attempts: dict[str, list[float]] = field(default_factory=dict)  # each kind's ratios

    @property
    def ratio(self) -> float:
        return _ratio(self.rounds)

    def ratio_of(self, kind: str) -> float:
        """gpupool/direct over ``kind``'s rounds together (ABBA: drifts cancel); with
        attempts, the best."""
        return max(self.attempts.get(kind) or [_ratio([r for r in self.rounds if r.kind == kind])])

    def worst(self) -> Round:
        return min(self.rounds, key=lambda r: r.ratio)


def _ratio(rounds: list[Round]) -> float:
    d = sum(r.direct.tok_s for r in rounds)
    return sum(r.gpupool.tok_s for r in rounds) / d if d else 0.0


def http_client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(timeout=60, limits=limits)


async def measure(
    pool_: Pool, shape: Shape, plan: Plan, say: Callable[[str], None] = print
) -> Report:
    """A burst on the fresh gateway, every kind's rounds (the ABBA order continuing across
    kinds), and a burst again with all the gateway learned."""
    report = Report([], [])
    async with http_client() as http:

        async def bursts(when: str) -> None:
            for mode in ("gpupool", "direct") if plan.burst_direct else ("gpupool",):
                for attempt in range(plan.confirm + 1):
                    b = await burst(http, pool_, mode, plan.conversations, plan.turns, shape)
                    say(f"together ({when}) {b.line()}")
                    if b.opening_spread <= 1:
                        break
                    if attempt < plan.confirm:
                        say(f"together: openings {b.turns[0]} are more than one apart: again")
                report.bursts.append(b)  # the last attempt: the first even one, or a fault

        await bursts("fresh gateway")
        for j, kind in enumerate(plan.kinds):
            ratios = report.attempts[kind] = []
            while not ratios or (ratios[-1] < plan.floor and len(ratios) <= plan.confirm):
                if ratios:
                    say(f"{kind}: {ratios[-1]:.3f} is below {plan.floor}: measuring it again")
                got = await rounds(
                    http, pool_, kind, plan.count, shape, plan.warm_s, plan.window_s,
                    first=j * plan.count, say=say, aa=plan.aa,
                )  # fmt: skip
                report.rounds += got
                ratios.append(_ratio(got))
        await bursts("after the rounds")
    per_kind = ", ".join(f"{k} {report.ratio_of(k):.3f}" for k in plan.kinds)
    say(f"gpupool/direct: {per_kind}; overall {report.ratio:.3f}, "
        f"worst round {report.worst().ratio:.3f}")  # fmt: skip
    return report


def run(
    shape: Shape, plan: Plan, say: Callable[[str], None] = print, gateway_tree: Path = ROOT,
    kv: Path | None = None,
) -> Report:  # fmt: skip
    with pool(shape, gateway_tree=gateway_tree, kv=kv) as p:
        say(f"workers {p.direct}, gateway {p.gateway}")
        report = asyncio.run(measure(p, shape, plan, say))
        if kv is not None:
            text = httpx.get(p.gateway + "/metrics", timeout=10).text
            routed = [line for line in text.splitlines()
                      if line.startswith("gpupool_kv_routed_requests_total")]  # fmt: skip
            say("kv routing: " + "; ".join(routed))
        return report


def _shape_field(kv: str) -> tuple[str, float | int]:
    name, _, value = kv.partition("=")
    kind = {f.name: f.type for f in fields(Shape)}.get(name)
    if kind is None:
        raise ValueError(f"no field {name!r}")
    return name, int(value) if kind in ("int", int) else float(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per workload (ABBA)")
    ap.add_argument("--warm", type=float, default=1.0, help="seconds before each window")
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured per mode")
    ap.add_argument("--only", default=",".join(KINDS), help="workloads, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--aa", action="store_true", help="pin both windows: the ratio's noise")
    ap.add_argument(
        "--gateway-tree",
        type=Path,
        default=ROOT,
        help="run this tree's gateway (e.g. `git archive COMMIT gpupool | tar -x -C DIR`); "
        "the simulators stay this checkout's",
    )
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help=f"change the workers' shape ({', '.join(f.name for f in fields(Shape))})",
    )
    ap.add_argument(
        "--kv-events",
        type=Path,
        default=None,
        metavar="MODEL_DIR",
        help="the simulators publish KV-cache events (prompts hashed with this model "
        "directory's tokenizer) and the gateway routes precisely on them",
    )
    args = ap.parse_args()
    try:
        shape = replace(Shape(), **dict(_shape_field(kv) for kv in args.shape))
    except (TypeError, ValueError) as exc:
        ap.error(f"--shape: {exc}")
    kinds = tuple(k for k in args.only.split(",") if k)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(KINDS)}")
    plan = Plan(kinds, args.rounds, args.warm, args.window, aa=args.aa)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the pool on a plain kill
    report = run(shape, plan, gateway_tree=args.gateway_tree, kv=args.kv_events)
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))


if __name__ == "__main__":
    main()
