"""Request migration on real vLLM (issue 36): two CPU workers of the same tiny model, greedy.

The same 24 streamed and 8 whole-answer requests (chat and completions, 900 tokens each with
``ignore_eos``) are answered twice: once undisturbed, once while one worker's vLLM API server is
killed (``kill -9``) as soon as its engine runs ``BUSY`` requests and has generated for them
(its own metrics: the clients, and the gateway relaying 24 fast streams, lag their workers by
seconds on a loaded machine), so every stream on it is cut a few engine steps into its 900
however fast or loaded the machine, and however routing spread them (at least ``CUT_AT_LEAST``
must be). No client may see an error; at least 90 % of the answers must be the undisturbed text
(greedy on identical weights; what differs is reported with the text around it), and every cut
stream's text must be the surviving worker's own greedy first tokens and its continuation from
their ids, asked again directly: nothing repeated or lost at the cut. One FAULT-RESULT line
gives the numbers.

One stack of its own (two workers, about 3 GB each): run it under the machine's heavy-test lock.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import report
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running
from tests.vllm.conftest import MODEL, _paths, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

WINDOW = 1024
STREAMS, WHOLE = 24, 8
# each answer's every token is generated (ignore_eos) and the window nearly filled: the kill
# lands once every stream has text, a few engine steps into its 900, however fast the machine
TOKENS = 900
SLOTS = 16  # a worker's: the 32 requests spread over both, each worker's in one batch
SEAM_CHARS = 32  # a difference this close after the cut is the seam's
CUT_AT_LEAST = 4  # streams the kill must cut mid-answer (the victim holds about 12)
BUSY = 10  # requests the killed worker holds (of its 16: about 12 streams, 4 whole answers)
ENGINE_METRICS = "/metrics/?name[]=vllm:num_requests_running&name[]=vllm:generation_tokens_total"
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", re.M)
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


def _worker(name: str, model_dir: Path, py: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "max_inflight": SLOTS,
        "launch": {
            # a port from the tests' own lock (below the ephemeral range, held 300 s): a port
            # gpupool picks by bind(0) stays free only until vLLM binds it, 30 s and more later
            "port": free_port(),
            "model_path": str(model_dir),
            "command": [
                str(py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "{model_path}",
            ],
            "args": {
                "dtype": "bfloat16",
                "max-model-len": WINDOW,
                "max-num-seqs": SLOTS,
                "max-num-batched-tokens": 2048,
                "enforce-eager": True,  # no torch.compile: minutes of a start on 2 cores
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 400,
            "max_restarts": 0,  # the killed one stays down: the machine is small
        },
        "warmup": [{"prompt": "warm up", "max_tokens": 2}],
    }


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("migration")
    dense = models / "qwen3-dense"
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": [_worker("a", dense, py), _worker("b", dense, py)],
        "routing": {
            "prefix_affinity": False,
            "health_interval_s": 1.0,
            "fail_threshold": 2,
            "health_timeout_s": 30,
        },
        "queue": {"max_wait_s": 300},
    }
    gw = gateway(cfg, tmp)
    with running(gw):
        wait_ready(gw, timeout=600, names=("a", "b"))
        yield gw


def _requests() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(STREAMS + WHOLE):
        stream = i < STREAMS
        common = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "stream": stream,
                  "ignore_eos": True}  # fmt: skip
        if stream and i % 3 == 0:
            common["stream_options"] = {"include_usage": True}
        if i % 2:
            chat = [{"role": "user", "content": f"Tell me about the number {i}."}]
            out.append(("/v1/chat/completions", {**common, "messages": chat}))
        else:
            out.append(("/v1/completions", {**common, "prompt": f"The number {i} is"}))
    return out


class Read:
    """What one client read: its text (and, streamed, the text of each event), errors, the
    ``[DONE]`` count, the ids its chunks carried and its usage. A stream's lines are kept as
    they come and read once it ends: a client that parsed each event as it came would fall
    behind 24 streams of a fast worker."""

    def __init__(self) -> None:
        self.lines: list[str] = []  # a stream's data lines, as they came
        self.pieces: list[str] = []  # a stream's text, one entry per event with text
        self.whole = ""  # a whole answer's text
        self.errors: list[str] = []
        self.done = 0
        self.status = 0
        self.began = asyncio.Event()
        self.ended = False  # its [DONE] came, or its connection ended
        self.worker = ""  # the x-gpupool-worker header: the worker it began on
        self.ids: set[str] = set()
        self.usage: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return self.whole or "".join(self.pieces)

    def line(self, line: str) -> None:
        self.lines.append(line)
        if not self.began.is_set() and _has_text(line):
            self.began.set()
        self.ended = self.ended or line == "data: [DONE]"

    def read_lines(self) -> None:
        for line in self.lines:
            self.event(line)

    def event(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done += 1
            return
        obj = json.loads(line[6:])
        if "error" in obj:
            self.errors.append(str(obj["error"]))
        self.ids.add(str(obj.get("id")))
        self.usage = obj.get("usage") or self.usage
        for c in obj.get("choices", []):
            piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
            if piece:
                self.pieces.append(piece)


def _has_text(line: str) -> bool:
    """Whether a data line carries text, read as vLLM writes it (without parsing)."""
    return ('"content":"' in line and '"content":""' not in line) or (
        '"text":"' in line and '"text":""' not in line
    )


async def _one(c: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], i: int,
               read: Read) -> None:  # fmt: skip
    try:
        headers = {"x-request-id": f"req-{i}"}
        async with c.stream("POST", url + path, json=body, headers=headers) as r:
            read.status = r.status_code
            read.worker = r.headers.get("x-gpupool-worker", "")
            if r.status_code != 200 or not body["stream"]:
                raw = await r.aread()
                if r.status_code != 200:
                    read.errors.append(raw[:300].decode(errors="replace"))
                else:
                    read.whole = _answer(json.loads(raw))
                    read.done = 1
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        read.line(line)
    except httpx.HTTPError as e:
        read.errors.append(f"{type(e).__name__}: {e}")
    finally:
        read.ended = True
        read.read_lines()
        read.began.set()


def _answer(obj: dict[str, Any]) -> str:
    choice = obj["choices"][0]
    return str(choice.get("text") or choice["message"]["content"] or "")


async def _run(url: str, kill: Any = None) -> list[Read]:
    reqs = _requests()
    reads = [Read() for _ in reqs]
    async with httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)) as c:
        engines = {w["name"]: w["url"] for w in _workers(url).values()} if kill else {}
        before = {name: (await _engine(c, u))[1] for name, u in engines.items()}
        tasks = [asyncio.create_task(_one(c, url, p, b, i, reads[i]))
                 for i, (p, b) in enumerate(reqs)]  # fmt: skip
        if kill is not None:
            victim = await _busiest(c, engines, before, reads[:STREAMS])
            if victim:
                await asyncio.to_thread(kill, victim)
        await asyncio.gather(*tasks)
    return reads


async def _busiest(
    c: httpx.AsyncClient, engines: dict[str, str], before: dict[str, float], streams: list[Read]
) -> str:
    """The worker whose engine runs ``BUSY`` requests and has generated two tokens for each
    since the round began (``before``: its count then): its streams are a few engine steps into
    their TOKENS. Asked of the workers themselves: on a loaded machine the gateway relays (and
    answers a poll) seconds behind them. "" when every stream ended first. Polled: nothing
    waits on time."""
    while not all(r.ended for r in streams):
        for name, engine in engines.items():
            running, made = await _engine(c, engine)
            if running >= BUSY and made - before[name] >= 2 * BUSY:
                return name
        await asyncio.sleep(0.005)
    return ""


async def _engine(c: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """A vLLM worker's requests running and tokens generated so far (its own metrics)."""
    text = (await c.get(url + ENGINE_METRICS)).text
    running = sum(float(v) for v in RUNNING.findall(text))
    return running, sum(float(v) for v in GENERATED.findall(text))


def _child_pids(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _workers(url: str) -> dict[str, dict[str, Any]]:
    return {w["name"]: w for w in httpx.get(url + "/admin/workers", timeout=30).json()["data"]}


def _difference(i: int, got: str, want: str, cut: int | None) -> dict[str, Any]:
    """Where an answer first differs from the undisturbed one, and the text around it."""
    pairs = zip(got, want, strict=False)
    at = next((k for k, (x, y) in enumerate(pairs) if x != y), min(len(got), len(want)))
    start = max(0, at - 10)
    return {"i": i, "cut_after_tokens": cut, "first_difference_at_char": at,
            "read": got[start : at + 30], "undisturbed": want[start : at + 30]}  # fmt: skip


def _cut_tokens(log: str, victim: str) -> dict[int, int]:
    """Client index -> tokens it had when its worker died (the migration log lines, whose
    prefix names the client's x-request-id)."""
    found = re.findall(rf"client=req-(\d+)\] request \S+: worker {victim} failed mid-answer "
                       r"\(\w+\); continued after (\d+) tokens", log)  # fmt: skip
    return {int(i): int(n) for i, n in found}


def _replay(url: str, i: int, sent: int) -> tuple[str, str]:
    """The surviving worker's greedy answer to stream ``i``, asked directly: its first ``sent``
    tokens, and its continuation from their ids (a completion of the prompt's ids and those,
    as the gateway asks after a cut): what the client must have read, nothing repeated or
    lost at the cut."""
    path, body = _requests()[i]
    body = {**body, "stream": False, "max_tokens": sent, "return_token_ids": True}
    body.pop("stream_options", None)
    r = httpx.post(url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    head = r.json()
    choice = head["choices"][0]
    ids = (head.get("prompt_token_ids") or choice["prompt_token_ids"]) + choice["token_ids"]
    rest = {"model": MODEL, "prompt": ids, "max_tokens": TOKENS - sent, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=rest, timeout=300)
    assert r.status_code == 200, r.text
    return _answer(head), _answer(r.json())


# Not yet strict (2026-12-06). Since a move goes on from the token ids (145eea3), every run
# whose kill cut streams was 32/32 identical with every seam exact (10, 11, 12 and 14 streams
# cut); the text path's failures (21-22/32 under load: newlines fed back re-tokenized into
# longer tokens) are gone with it. What keeps it xfail: beside two CPU burners its kill has not
# yet landed mid-answer (four runs, four ways of waiting: the workers end 900 tokens in ~2 s,
# and the harness polls from the event loop that also reads the 24 streams, which the burners
# starve until the round is over: a watcher of its own, a thread or a process, is the next
# step), and the 6 refused continuations seen once at 782f836 are not explained. Its
# FAULT-RESULT line is the measurement.
@pytest.mark.xfail(strict=False, reason="not yet reliable: see the comment above")
def test_kill_9_under_24_streams_and_8_whole_answers(twins: Proc) -> None:
    url = twins.url
    reference = asyncio.run(_run(url))
    assert all(not r.errors for r in reference), [r.errors for r in reference if r.errors]
    assert_nothing_held(url, within_s=10)
    killed: list[str] = []

    def kill(name: str) -> None:
        # the busy worker: routing may place more on one (a pace penalty after a slow first
        # answer, docs: routing) or start one's later, so a fixed name can miss
        killed.append(name)
        for child in _child_pids(int(_workers(url)[name]["pid"])):  # the API server, guarded
            os.kill(child, signal.SIGKILL)

    t0 = time.monotonic()
    reads = asyncio.run(_run(url, kill))
    took = time.monotonic() - t0
    assert_nothing_held(url, within_s=30)
    log = Path(twins.log_path).read_text()
    metrics = httpx.get(url + "/metrics", timeout=30).text
    moved = [ln for ln in metrics.splitlines() if ln.startswith("gpupool_migrations_total{")]
    errors = [(i, r.errors) for i, r in enumerate(reads) if r.errors]
    same = [
        i for i, (r, ref) in enumerate(zip(reads, reference, strict=True)) if r.text == ref.text
    ]
    cuts = _cut_tokens(log, killed[0]) if killed else {}
    differ = [_difference(i, r.text, ref.text, cuts.get(i))
              for i, (r, ref) in enumerate(zip(reads, reference, strict=True))
              if r.text != ref.text]  # fmt: skip
    # what each cut stream read after its cut is the survivor's own continuation of the text
    # before it: nothing repeated or lost at the cut
    seams = {i: _seam(url, i, reads[i], n) for i, n in cuts.items()}
    report(
        "real vLLM CPU: kill -9 of one of two workers under 24 streams + 8 whole answers",
        client_errors=len(errors),
        identical=f"{len(same)}/{len(reads)}",
        migrated_streams=len(cuts),
        migrated_identical=sum(1 for i in cuts if i in same),
        seams_exact=f"{sum(1 for ok in seams.values() if ok is None)}/{len(seams)}",
        seam_differences=[v for v in seams.values() if v is not None],
        migrations=moved,
        differences=differ,
        seconds=round(took, 1),
    )
    assert not errors, errors
    assert all(r.done == 1 for r in reads)
    assert all(len(r.ids) <= 1 for r in reads), "one id in every chunk"
    assert len(cuts) >= CUT_AT_LEAST, (killed, cuts, moved)
    assert len(same) >= 0.9 * len(reads), differ
    # nothing repeated or lost at the cut: that would part the two within its first tokens.
    # Far past it they may part (seen once at character 868 of 3,600, on a quiet machine):
    # vLLM's greedy on CPU is not batch-invariant, and the replay runs alone where the continued
    # stream ran in the survivor's full batch; such differences are reported, not failed
    assert all(v is None or v["first_difference_at_char"] >= SEAM_CHARS for v in seams.values()), (
        seams
    )


def _seam(url: str, i: int, read: Read, sent: int) -> dict[str, Any] | None:
    """None when stream ``i``'s text is the survivor's greedy text of its first ``sent``
    tokens (those fed back) and its continuation from their ids; else where they part, in
    characters after the cut (negative: before it)."""
    head, rest = _replay(url, i, sent)
    if read.text == head + rest:
        return None
    out = _difference(i, read.text, head + rest, sent)
    out["first_difference_at_char"] -= len(head)
    return out
