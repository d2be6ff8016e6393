"""Issue 35 against real vLLM (CPU), on ``test_conformance.py``'s stack: ``tiny-p`` served by a
worker with vLLM's parsers, ``tiny`` by one without (the gateway splits).

* A stream that did not ask for ``stream_options.include_usage``: the gateway asks the worker
  for it (every token reaches ``gpupool_tokens_total``) and takes it out again, so the client
  gets the bytes vLLM sends without it (the fingerprint on the finishing chunk), on
  ``/v1/chat/completions`` and ``/v1/completions``; only the request's id and time differ.
* ``GET /v1/responses/{id}`` of a response the gateway split comes back split, as the create.
* ``/v1/messages`` with ``thinking.budget_tokens`` where the gateway splits: the same 400
  streamed as whole (vLLM itself answers a stream 200, then a pydantic ``internal_error``).

Run it in the lock::

    flock /tmp/gpupool-heavy.lock .venv/bin/pytest -q tests/vllm/test_usage_and_split.py
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.vllm.test_conformance import PARSED, SPLIT, Stack, stack

__all__ = ["stack"]  # the module's stack fixture: test_conformance's gateway and workers

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

Json = dict[str, Any]
ASK = [{"role": "user", "content": "hello there, tell me something"}]


def _stream(url: str, path: str, body: Json) -> bytes:
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return b"".join(r.iter_raw())


def _normalized(raw: bytes) -> bytes:
    raw = re.sub(rb'"id":"[^"]*"', b'"id":""', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


_TEXT = re.compile(rb'"(text|content|reasoning|reasoning_content)":"(?:[^"\\]|\\.)*"')


def _coalesced(raw: bytes) -> tuple[dict[str, str], list[bytes]]:
    """The stream's text, and its events with their text taken out, runs of equal ones as one.
    vLLM merges the deltas of several steps into one chunk when its output lags (beside two CPU
    burners at d3eabe1 one stream gave `" = ="` in one chunk where the other gave `" ="` twice),
    so how the text falls into chunks is not stable between two runs of one request; the text,
    every event's bytes around it and their order are."""
    text: dict[str, str] = {}
    events: list[bytes] = []
    for event in _normalized(raw).split(b"\n\n"):
        if event.startswith(b"data: {"):
            for choice in json.loads(event[6:]).get("choices") or []:
                fields = {**(choice.get("delta") or {}), "text": choice.get("text")}
                for key in ("reasoning", "reasoning_content", "content", "text"):
                    if isinstance(fields.get(key), str):
                        text[key] = text.get(key, "") + fields[key]
            event = _TEXT.sub(rb'"\1":""', event)
        if event and (not events or events[-1] != event):
            events.append(event)
    return text, events


def _tokens_total(url: str, model: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gpupool_tokens_total{") and f'model="{model}"' in line
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": ASK}),
        ("/v1/completions", {"prompt": "hello there, tell me"}),
    ],
)
def test_a_stream_without_usage_is_vllms_bytes_and_every_token_counted(
    stack: Stack, path: str, body: Json
) -> None:
    body = {**body, "model": PARSED, "max_tokens": 12, "temperature": 0, "stream": True}
    before = _tokens_total(stack.gw, PARSED)
    through = _stream(stack.gw, path, body)
    counted = _tokens_total(stack.gw, PARSED) - before
    direct = _stream(stack.parsed, path, body)
    assert b'"usage"' not in direct and b'"system_fingerprint"' in direct
    assert _coalesced(through) == _coalesced(direct)
    with_usage = _stream(stack.parsed, path, {**body, "stream_options": {"include_usage": True}})
    usage = re.search(rb'"prompt_tokens":(\d+),"total_tokens":(\d+)', with_usage)
    assert usage is not None, with_usage[-400:]
    assert counted == int(usage[2])  # prompt and completion, as vLLM counts them


def test_a_stored_response_read_again_is_split_as_its_create(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.gw + "/v1", api_key="x", max_retries=0, timeout=120)
    made = client.responses.create(model=SPLIT, input="hello there, tell me something",
                                   max_output_tokens=24, temperature=0)  # fmt: skip
    assert made.output[0].type == "reasoning"
    got = client.responses.retrieve(made.id)
    assert [o.type for o in got.output] == [o.type for o in made.output]
    assert got.usage is not None and made.usage is not None
    assert got.usage.output_tokens_details.reasoning_tokens == (
        made.usage.output_tokens_details.reasoning_tokens
    )
    assert made.usage.output_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_budget_the_split_cannot_honour_is_one_400_both_ways(stack: Stack, stream: bool) -> None:
    budget = {"type": "enabled", "budget_tokens": 1024}
    body = {"model": SPLIT, "messages": ASK, "max_tokens": 1030, "thinking": budget,
            "stream": stream}  # fmt: skip
    r = httpx.post(stack.gw + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "BadRequestError"
    assert "budget_tokens cannot be honoured for model `tiny`" in error["error"]["message"]
