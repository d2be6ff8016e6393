"""Swap policies against each other: `gpupool serve` with two simulated models in one swap group,
vLLM-like switch times, the same load under ``swap.policy: turns`` (gpupool's first policy) and
``weighed`` (today's default), printed as ratios from one run.

    .venv/bin/python bench/swap_policy.py [--trickle-s 90] [--agents 4] [--loops 4] [--spread-s 15]
                                          [--out bench/results/swap_policy.json]

Workloads:

- **trickle** (issue 37): 8 closed-loop clients stream from the awake model (`chat`, 100 tokens
  each) while one request every 3 s comes for the sleeping one (`coder`, 20 tokens). Also run
  with no trickle at all, which is what the busy model completes alone: its *loss* is how many
  fewer it completes with the trickle. Each run lasts ``--trickle-s``.
- **agent** (llama-swap #611): ``--agents`` agents, each ``--loops`` times: the orchestrator
  model (`chat`, 20 to 60 tokens) twice, the coder model (`coder`, 60 to 200 tokens) three
  times, each call followed by a tool call (0.2 to 1.5 s); drawn from a seed per agent, the same
  under each policy. Agents start up to ``--spread-s`` apart: 15 s (about one loop), so that
  independent agents (sessions, sub-agents) are out of step, as they are on a workstation. With
  ``--spread-s 2`` they run in step, all on one model then all on the other, and any policy
  needs ``2 * loops - 1`` switches, the fewest one agent's own turns allow: no policy can switch
  less there, only slower. The run lasts until every agent is done.

Per run: switches (``gpupool_swap_switches_total``) per 100 requests, the busy model's completed
requests (trickle), the worst wait (a request's time to its first byte: a switch it waited for
included), the total time (agent). The workers are `gpupool sim --gpu` (continuous batching,
20 ms a step), asleep in 0.3 s and awake in 0.8 s: vLLM level 1 on an H200 measured 0.3 s
sleeps and 1.16 s from request to first token through a switch (docs/benchmarks.md). Times are
real: the machine's load moves them; compare the ratios, from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
PY = Path(os.environ.get("GPUPOOL_BENCH_PYTHON") or ROOT / ".venv" / "bin" / "python")
SIM = {"gpu": True, "max-num-seqs": 16, "sleep-s": 0.3, "wake-s": 0.8,
       "gpu-memory-utilization": 0.85, "output-tokens": 400}  # fmt: skip


@dataclass
class Run:
    name: str
    policy: str
    seconds: float = 0.0
    requests: int = 0
    switches: int = 0
    busy_completed: int = 0  # trickle: the awake model's completed requests in the window
    other_completed: int = 0
    failures: int = 0
    worst_wait_s: float = 0.0
    waits: list[float] = field(default_factory=list, repr=False)

    @property
    def switches_per_100(self) -> float:
        return 100.0 * self.switches / max(self.requests, 1)


def config(tmp: Path, port: int, policy: str, min_awake_s: float | None) -> dict[str, Any]:
    ledger = str(tmp / "ledger.json")

    def worker(name: str, model: str) -> dict[str, Any]:
        args = {**SIM, "sleep-ledger": ledger}
        return {"name": name, "model": model,
                "launch": {"gpus": [0], "model_path": "sim", "args": args,
                           "command": [str(PY), "-m", "gpupool.workers.sim"],
                           "startup_timeout_s": 120}}  # fmt: skip

    return {
        "server": {"port": port, "state_dir": str(tmp / "state")},
        "models": [{"name": "chat"}, {"name": "coder"}],
        "workers": [worker("chat-w", "chat"), worker("coder-w", "coder")],
        "routing": {"health_interval_s": 1.0, "metrics_interval_s": 3600},
        # each policy with its defaults, or both with one `min_awake_s` (the shipped example
        # configs, config/two-models-one-gpu*.yaml, say 2)
        "swap": {"policy": policy} | ({} if min_awake_s is None else {"min_awake_s": min_awake_s}),
    }


class Gateway:
    def __init__(self, policy: str, min_awake_s: float | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"swap-bench-{policy}-"))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = self.tmp / "gpupool.yaml"
        path.write_text(yaml.safe_dump(config(self.tmp, self.port, policy, min_awake_s)))
        log = (self.tmp / "gateway.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [str(PY), "-m", "gpupool", "serve", "--config", str(path)]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)  # fmt: skip

    def ready(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                states = {w["name"]: w["state"] for w in self.workers()}
                if states == {"chat-w": "ready", "coder-w": "asleep"}:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"gateway never ready; see {self.tmp / 'gateway.log'}")

    def workers(self) -> list[dict[str, Any]]:
        reply = httpx.get(f"{self.url}/admin/workers", timeout=5).json()
        data: list[dict[str, Any]] = reply["data"]
        return data

    def switches(self) -> int:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return int(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                       if line.startswith("gpupool_swap_switches_total{")))  # fmt: skip

    def violations(self) -> list[str]:
        path = self.tmp / "ledger.json"
        return list(json.loads(path.read_text()).get("violations", [])) if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ask(client: httpx.AsyncClient, run: Run, model: str, tokens: int) -> bool:
    """One streamed completion; its wait (to the first byte) recorded. True when it finished."""
    body = {"model": model, "prompt": "hi", "max_tokens": tokens, "stream": True}
    t0 = time.monotonic()
    first = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                run.failures += 1
                return False
            async for chunk in r.aiter_bytes():  # (": queued" comments are not an answer)
                if first is None and b"data:" in chunk:
                    first = time.monotonic() - t0
    except httpx.HTTPError:
        run.failures += 1
        return False
    run.requests += 1
    wait = first if first is not None else time.monotonic() - t0
    run.waits.append(wait)
    run.worst_wait_s = max(run.worst_wait_s, wait)
    return True


async def trickle(url: str, run: Run, seconds: float, with_trickle: bool) -> None:
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def busy() -> None:
            while time.monotonic() < end:
                if await ask(client, run, "chat", 100) and time.monotonic() <= end:
                    run.busy_completed += 1

        async def sleeper() -> None:
            tasks = []
            while with_trickle and time.monotonic() < end:
                tasks.append(asyncio.create_task(ask(client, run, "coder", 20)))
                await asyncio.sleep(3.0)
            done = await asyncio.gather(*tasks)
            run.other_completed = sum(done)

        await asyncio.gather(*(busy() for _ in range(8)), sleeper())


async def agents(url: str, run: Run, n: int, loops: int, spread_s: float) -> None:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def agent(i: int) -> None:
            rng = random.Random(i)  # the same draws under each policy
            await asyncio.sleep(rng.uniform(0, spread_s))  # agents start apart, as users do
            for _ in range(loops):
                for _ in range(2):  # the orchestrator: a tool call, then it decides again
                    await ask(client, run, "chat", rng.randint(20, 60))
                    await asyncio.sleep(rng.uniform(0.2, 1.5))  # the tool runs
                for _ in range(3):  # the coder: reads, edits, runs the tests
                    await ask(client, run, "coder", rng.randint(60, 200))
                    await asyncio.sleep(rng.uniform(0.2, 1.5))

        await asyncio.gather(*(agent(i) for i in range(n)))


def measure(policy: str, name: str, work: Any, min_awake_s: float | None = None) -> Run:
    gw = Gateway(policy, min_awake_s)
    run = Run(name, policy)
    try:
        gw.ready()
        before = gw.switches()
        t0 = time.monotonic()
        asyncio.run(work(gw.url, run))
        run.seconds = time.monotonic() - t0
        run.switches = gw.switches() - before
        if gw.violations():
            raise RuntimeError(f"ledger violations under {policy}: {gw.violations()}")
    finally:
        gw.stop()
    print(f"  {name:<16} {policy:<8} {run.seconds:6.1f} s  requests {run.requests:4d}  "
          f"switches {run.switches:3d}  busy done {run.busy_completed:4d}  "
          f"worst wait {run.worst_wait_s:5.1f} s  failures {run.failures}", flush=True)  # fmt: skip
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trickle-s", type=float, default=90.0)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument(
        "--min-awake-s",
        type=float,
        default=None,
        help="swap.min_awake_s for both policies (default: each policy's own)",
    )
    ap.add_argument("--only", choices=("trickle", "agent"), default=None)
    ap.add_argument(
        "--spread-s",
        type=float,
        default=15.0,
        help="agents start up to this far apart (2: in step, where no policy switches less)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "swap_policy.json")
    a = ap.parse_args()
    s, awake = a.trickle_s, a.min_awake_s
    print(f"swap policy bench: trickle {s:g} s, agent {a.agents} x {a.loops} loops "
          f"started up to {a.spread_s:g} s apart, "
          f"min_awake_s {awake if awake is not None else 'default'}", flush=True)  # fmt: skip
    alone, runs, agent = None, {}, {}
    if a.only != "agent":
        alone = measure("weighed", "busy alone", lambda u, r: trickle(u, r, s, False), awake)
        runs = {p: measure(p, "trickle", lambda u, r: trickle(u, r, s, True), awake)
                for p in ("turns", "weighed")}  # fmt: skip
    if a.only != "trickle":
        work = lambda u, r: agents(u, r, a.agents, a.loops, a.spread_s)  # noqa: E731
        agent = {p: measure(p, "agent", work, awake) for p in ("turns", "weighed")}
    report = summarize(alone, runs, agent)
    print(report)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    every = [r for r in (alone, *runs.values(), *agent.values()) if r is not None]
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    out = {"commit": _commit(), "args": args, "runs": [_row(r) for r in every], "report": report}
    a.out.write_text(json.dumps(out, indent=2))


def _commit() -> str:
    git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    done = subprocess.run(git, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def _row(r: Run) -> dict[str, Any]:
    row = {k: v for k, v in asdict(r).items() if k != "waits"}
    row["switches_per_100"] = round(r.switches_per_100, 2)
    return row


def ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}" if y else "n/a"


def summarize(alone: Run | None, trickle_runs: dict[str, Run], agent: dict[str, Run]) -> str:
    lines = ["", "| | turns (before) | weighed (now) | weighed / turns |", "|---|---|---|---|"]
    if alone is not None:
        lines += _trickle_rows(alone, trickle_runs["turns"], trickle_runs["weighed"])
    if agent:
        lines += _agent_rows(agent["turns"], agent["weighed"])
    return "\n".join(lines)


def _trickle_rows(alone: Run, old: Run, new: Run) -> list[str]:
    def loss(r: Run) -> float:
        return 1 - r.busy_completed / max(alone.busy_completed, 1)

    return [
        f"| trickle: switches per 100 requests | {old.switches_per_100:.1f} | "
        f"{new.switches_per_100:.1f} | {ratio(new.switches_per_100, old.switches_per_100)} |",
        f"| trickle: busy model's completed requests (alone: {alone.busy_completed}) | "
        f"{old.busy_completed} | {new.busy_completed} | "
        f"{ratio(new.busy_completed, old.busy_completed)} |",
        f"| trickle: busy model's loss against alone | {loss(old):.1%} | {loss(new):.1%} | |",
        f"| trickle: worst wait (s) | {old.worst_wait_s:.1f} | {new.worst_wait_s:.1f} | "
        f"{ratio(new.worst_wait_s, old.worst_wait_s)} |",
        f"| trickle: sleeping model's requests completed | {old.other_completed} | "
        f"{new.other_completed} | |",
        f"| trickle: failures | {old.failures} | {new.failures} | |",
    ]


def _agent_rows(ao: Run, an: Run) -> list[str]:
    return [
        f"| agent: switches per 100 requests | {ao.switches_per_100:.1f} | "
        f"{an.switches_per_100:.1f} | {ratio(an.switches_per_100, ao.switches_per_100)} |",
        f"| agent: total time (s) | {ao.seconds:.1f} | {an.seconds:.1f} | "
        f"{ratio(an.seconds, ao.seconds)} |",
        f"| agent: worst wait (s) | {ao.worst_wait_s:.1f} | {an.worst_wait_s:.1f} | "
        f"{ratio(an.worst_wait_s, ao.worst_wait_s)} |",
        f"| agent: failures | {ao.failures} | {an.failures} | |",
    ]


if __name__ == "__main__":
    main()
