"""A worker whose streamed `/v1/responses` ends with a final event that has no `response`
object, on a model the gateway splits (its reasoning must be counted into that object): the
client gets the events before it and then the stream's own `error` event, the gateway logs the
worker's name, and nothing stays held. Before, an `assert` in the relay broke the stream.

Through `gpupool serve` and the official SDK; the worker is :class:`RawWorker` (vLLM 0.32
without a reasoning parser) with its last event broken.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.transform.raw_worker import ANSWER, RawWorker
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, running

MODEL = "m"
BROKEN: list[Any] = [None, "completed", ["x"]]  # what the final event's `response` is


class BrokenFinal(RawWorker):
    """Its stream's final ``response.completed`` carries ``response: self.final`` (or none),
    while ``broken``."""

    final: Any = None
    broken = True

    def _responses(self, text: str, stream: bool) -> Any:
        out = super()._responses(text, stream)
        if not stream or not self.broken:
            return out
        last = json.loads(out[-1].split(b"\ndata: ", 1)[1])
        if self.final is None:
            del last["response"]
        else:
            last["response"] = self.final
        return [*out[:-1], f"event: {last['type']}\ndata: {json.dumps(last)}\n\n".encode()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, BrokenFinal]]:
    worker = BrokenFinal(MODEL)
    cfg = {"models": [{"name": MODEL, "reasoning": "qwen3"}],
           "workers": [{"name": "raw", "model": MODEL, "url": worker.url}]}  # fmt: skip
    gw = gateway(cfg, tmp_path_factory.mktemp("broken-final"))
    with worker.running(), running(gw, ready_path="/ready"):
        yield gw, worker


def _events(url: str) -> list[tuple[str, dict[str, Any]]]:
    body = {"model": MODEL, "input": "2+2?", "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=30) as r:
        assert r.status_code == 200
        raw = r.read()
    out = []
    for block in raw.split(b"\n\n"):
        lines = dict(line.split(b": ", 1) for line in block.split(b"\n") if line)
        if lines:
            out.append((lines[b"event"].decode(), json.loads(lines[b"data"])))
    return out


@pytest.mark.parametrize("final", BROKEN, ids=["missing", "a-string", "a-list"])
def test_a_final_event_without_its_response_ends_with_an_error_event(
    stack: tuple[Proc, BrokenFinal], final: Any
) -> None:
    gw, worker = stack
    worker.final, worker.broken = final, True
    events = _events(gw.url)
    kinds = [k for k, _ in events]
    assert "response.reasoning_text.delta" in kinds  # the split ran, events came before
    assert "response.completed" not in kinds
    kind, error = events[-1]
    assert kind == "error" and error["type"] == "error" and error["code"] == "502"
    assert "response.completed without its response object" in error["message"]
    deadline = time.monotonic() + 10
    while "worker raw: worker sent response.completed without" not in gw.logs():
        assert time.monotonic() < deadline, gw.logs()
        time.sleep(0.05)
    assert_nothing_held(gw.url)


def test_the_sdk_sees_the_error_event_and_a_good_stream_still_works(
    stack: tuple[Proc, BrokenFinal],
) -> None:
    gw, worker = stack
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
    worker.final, worker.broken = None, True
    kinds = [e.type for e in client.responses.create(model=MODEL, input="2+2?", stream=True)]
    assert kinds[-1] == "error" and "response.completed" not in kinds
    worker.broken = False
    with client.responses.stream(model=MODEL, input="2+2?") as stream:
        done = stream.get_final_response()
    assert done.output_text == ANSWER
    assert_nothing_held(gw.url)
