"""Sleep and wake verified, not trusted (workers/swap/verify.py), with the simulator playing
vLLM's two known lies: a /sleep that answers 200 but frees nothing (vllm#32714, #47654), and a
level-2 wake whose reload leaves garbage weights (vllm#29341).

Each test proves the outcome from the sims' own ledger after the fact: no wake or start while
another member held the GPU (the ledger records a "CUDA out of memory" there), no request to a
sleeping worker; and, while it runs, never two members awake (/admin/workers), and nothing held
at the end."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.gateway.swap.tools import (
    Sampler,
    ledger_of,
    sdk,
    serving,
    two_model_config,
    wait_states,
    workers,
)
from tests.support.procs import Proc


def _ask(gw: Proc, model: str, stream: bool = False) -> str:
    client = sdk(gw)
    if stream:
        chunks = client.completions.create(model=model, prompt="hi", max_tokens=6, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=model, prompt="hi", max_tokens=6).choices[0].text


def _nothing_held(url: str, tmp: Path) -> None:
    held = httpx.get(url + "/admin/held", timeout=10).json()
    assert set(held["inflight"].values()) <= {0} and set(held["queued"].values()) <= {0}
    ledger = ledger_of(tmp)
    assert ledger["violations"] == [] and ledger["peak_awake"] <= 1.0


def test_a_sleep_that_frees_nothing_restarts_the_worker_before_the_other_wakes(
    tmp_path: Path,
) -> None:
    with serving(two_model_config(tmp_path), tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        coder = workers(gw)["coder-w"]
        knob = {"sleep_fail": "keep_memory"}  # /sleep says 200 and "asleep"; memory stays
        httpx.post(coder["url"] + "/sim/sleep", json=knob).raise_for_status()
        with Sampler(gw) as sampler:
            assert _ask(gw, "chat")  # coder-w is seen holding its memory, and restarted
            after = workers(gw)["coder-w"]
            assert "still holds" in (after["swap"]["verify_failure"] or ""), after
            assert after["restarts"] >= 1 or after["pid"] != coder["pid"]
            assert after["swap"]["verify_restarts"] == 1
            assert _ask(gw, "coder", stream=True)  # its turn: relaunched, served
            chat = workers(gw)["chat-w"]["swap"]
            assert chat["sleep_check"] == "freed", chat  # a sleep that frees: seen freed
        assert sampler.most_awake == 1
        _nothing_held(gw.url, tmp_path)  # chat-w's wake never met coder-w's memory


def test_a_garbage_level_2_wake_fails_its_canary_and_is_restarted(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path)
    cfg["workers"][1]["sleep"] = {"level": 2}  # chat-w: weights dropped, reloaded at a wake
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        chat = workers(gw)["chat-w"]
        knob = {"reload_fail": "garbage"}  # its next reload_weights leaves wrong weights
        httpx.post(chat["url"] + "/sim/sleep", json=knob).raise_for_status()
        with Sampler(gw) as sampler:
            answer = _ask(gw, "chat")
            assert answer and "!" not in answer  # served by the restarted, correct process
            after = workers(gw)["chat-w"]
            assert "canary" in (after["swap"]["verify_failure"] or ""), after
            assert after["pid"] != chat["pid"] and after["swap"]["verify_restarts"] == 1
            assert _ask(gw, "coder")
            assert _ask(gw, "chat")  # a level-2 wake of the fresh process: canary matches
            assert workers(gw)["chat-w"]["swap"]["canary"] == "matched"
        assert sampler.most_awake == 1
        _nothing_held(gw.url, tmp_path)
