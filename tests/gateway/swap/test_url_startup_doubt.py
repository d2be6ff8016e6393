"""``url:`` members that may be awake at start-up, other than the one that keeps the GPU: one
that does not answer, and one whose /sleep fails. Neither was ever read as asleep, so no other
member is woken until it is (it is read again at the health pace, and put to sleep if awake).

Two `gpupool sim` workers share one simulated GPU through a ledger; each case is checked from
the sims themselves (/is_sleeping, the ledger's violations and peak), and nothing is held
afterwards."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.swap.test_url_holder_faults import ask, clean, queued, sleeping, until
from tests.gateway.swap.tools import wait_states, workers
from tests.support.procs import Proc, gateway, running, sim


@contextmanager
def url_members(tmp: Path, share: float, b_asleep: bool) -> Iterator[tuple[Proc, Proc]]:
    """``a`` (coder, awake) and ``b`` (chat), each holding ``share`` of the GPU while awake."""
    opts: dict[str, Any] = {"tmp": tmp, "enable_sleep_mode": True, "itl_ms": 5,
                            "gpu_memory_utilization": share,
                            "sleep_ledger": str(tmp / "gpu0-ledger.json")}  # fmt: skip
    a, b = sim(model="coder", **opts), sim(model="chat", **opts)
    with running(b):
        if b_asleep:
            httpx.post(b.url + "/sleep?level=1", timeout=10).raise_for_status()
        with running(a):
            yield a, b


@contextmanager
def serving_group(tmp: Path, a: Proc, b: Proc) -> Iterator[Proc]:
    """`gpupool serve` with ``a`` and ``b`` as ``url:`` members of one swap group (up once it
    answers /health: a model may have no ready worker yet)."""
    cfg: dict[str, Any] = {
        "models": [{"name": "coder"}, {"name": "chat"}],
        "workers": [
            {"name": "a", "model": "coder", "url": a.url, "swap_group": "shared"},
            {"name": "b", "model": "chat", "url": b.url, "swap_group": "shared"},
        ],
        "routing": {"health_interval_s": 0.3, "health_timeout_s": 2, "metrics_interval_s": 3600},
        "swap": {"min_awake_s": 0, "sleep_timeout_s": 1},
        "queue": {"max_wait_s": 60},
    }
    gw = gateway(cfg, tmp)
    with running(gw, timeout=90):
        yield gw


def test_a_member_unreachable_at_start_up_keeps_the_others_asleep(tmp_path: Path) -> None:
    with url_members(tmp_path, 0.85, b_asleep=True) as (a, b):
        a.kill(signal.SIGSTOP)  # awake, its weights on the GPU, answering nothing
        try:
            with serving_group(tmp_path, a, b) as gw, ThreadPoolExecutor(1) as pool:
                patient = pool.submit(ask, gw, "chat")
                until("chat queued", lambda: queued(gw, "chat"))
                until("b waiting for a", lambda: "waits for a" in (
                    workers(gw)["b"]["last_error"] or ""))  # fmt: skip
                time.sleep(3)  # a few more reads of a, each unanswered
                assert sleeping(b) and workers(gw)["b"]["state"] == "asleep"
                a.kill(signal.SIGCONT)
                assert patient.result(timeout=90)  # a answered, was put to sleep, b woke
                assert (sleeping(a), sleeping(b)) == (True, False)
                wait_states(gw, {"a": "asleep", "b": "ready"})
                assert workers(gw)["b"]["last_error"] is None
                assert ask(gw, "coder") and ask(gw, "chat")
                clean(gw, tmp_path)
        finally:
            a.kill(signal.SIGCONT)


def test_a_second_awake_member_whose_start_up_sleep_fails_is_put_to_sleep_later(
    tmp_path: Path,
) -> None:
    with url_members(tmp_path, 0.45, b_asleep=False) as (a, b):  # (both awake at start-up)
        httpx.post(b.url + "/sim/sleep", json={"sleep_fail": "error"}).raise_for_status()
        with serving_group(tmp_path, a, b) as gw:
            seen = wait_states(gw, {"a": "ready", "b": "asleep"})  # b read again, put to sleep
            assert seen["b"]["last_error"] is None
            assert (sleeping(a), sleeping(b)) == (False, True)
            assert "sleep failed: POST sleep?level=1&mode=wait answered 500" in (
                gw.log_path.read_text())  # fmt: skip
            assert ask(gw, "chat") and ask(gw, "coder")
            assert (sleeping(a), sleeping(b)) == (False, True)
            clean(gw, tmp_path)
