"""A stored response whose worker has since been put to sleep: its follow-ups and reads wait
for that worker (their wait wakes it, as any request for a sleeping model does) and then reach
it, since a sleeping vLLM keeps its process and the responses stored in it.

Through `gpupool serve` with two launched `gpupool sim` workers taking turns on one simulated
GPU, each storing responses as vLLM does with ``VLLM_ENABLE_RESPONSES_API_STORE=1``. The sims'
ledger proves afterwards that no request (a stored response's route included) reached a
sleeping worker."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.swap.tools import (
    Sampler,
    ledger_of,
    sdk,
    serving,
    sleeps_waited,
    two_model_config,
    wait_states,
    workers,
)
from tests.support.procs import Proc


def _held_nothing(gw: Proc) -> None:
    held = httpx.get(gw.url + "/admin/held", timeout=10).json()
    assert set(held["inflight"].values()) == {0} and set(held["slots"].values()) <= {0}
    assert set(held["queued"].values()) <= {0}


def _put_coder_to_sleep(gw: Proc) -> None:
    done = sdk(gw).completions.create(model="chat", prompt="hi", max_tokens=4)
    assert done.choices[0].text  # chat's turn: coder-w sleeps
    wait_states(gw, {"coder-w": "asleep", "chat-w": "ready"})


def test_a_stored_response_on_a_sleeping_worker_wakes_it_and_is_served(tmp_path: Path) -> None:
    cfg = two_model_config(tmp_path, server={"expose_worker_header": True})
    for w in cfg["workers"]:
        w["launch"]["env"] = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    cfg["workers"][0]["launch"]["args"]["wake-s"] = 2.0  # coder-w takes 2 s to wake
    with serving(cfg, tmp_path) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        client = sdk(gw)
        with Sampler(gw) as sampler:
            raw = client.responses.with_raw_response.create(model="coder", input="remember me")
            assert raw.headers["x-gpupool-worker"] == "coder-w"
            made = raw.parse()
            _put_coder_to_sleep(gw)

            # a client that will not wait through the wake: the queue's honest 429, as for
            # any request for a sleeping model (and its wait already asked for the switch)
            impatient = {"authorization": "Bearer x", "x-gpupool-max-wait": "0.2"}  # the tenant
            r = httpx.get(f"{gw.url}/v1/responses/{made.id}", headers=impatient, timeout=30)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["message"].startswith("No slot for model `coder`")
            _held_nothing(gw)

            got = client.responses.with_raw_response.retrieve(made.id)  # waits for the wake
            assert got.headers["x-gpupool-worker"] == "coder-w" and got.parse().id == made.id
            assert workers(gw)["coder-w"]["state"] == "ready"

            _put_coder_to_sleep(gw)
            follow = client.responses.with_raw_response.create(
                model="coder", input="and then?", previous_response_id=made.id
            )
            assert follow.headers["x-gpupool-worker"] == "coder-w"  # its worker, woken
            _put_coder_to_sleep(gw)
            with pytest.raises(openai.BadRequestError) as e:  # vLLM's own answer: it got there
                client.responses.cancel(made.id)
            assert "Cannot cancel a synchronous response" in e.value.message
            assert e.value.response.headers["x-gpupool-worker"] == "coder-w"
        _held_nothing(gw)
        assert sampler.most_awake == 1
    ledger = ledger_of(tmp_path)  # no request reached a sleeping worker; never two awake
    assert ledger["violations"] == [] and ledger["peak_awake"] <= 1.0
    assert set(sleeps_waited(ledger).values()) <= {0}  # nor a running one: nothing cut
