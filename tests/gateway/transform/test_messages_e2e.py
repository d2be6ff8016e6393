"""Through `gpupool serve`, with the official SDKs: a model whose worker has no reasoning
parser (the gateway splits its `<think>`), on ``/v1/messages`` and streamed ``/v1/responses``
(issue 27). The worker is :class:`RawWorker`, which answers as vLLM 0.32 does without a
parser; ``tests/vllm/test_conformance.py`` compares the same against real vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.gateway.transform.raw_worker import ANSWER, THOUGHT, RawWorker
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running

MODEL = "m"
ASK: Any = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RawWorker]]:
    worker = RawWorker(MODEL)
    cfg = {"models": [{"name": MODEL, "reasoning": "qwen3"}],
           "workers": [{"name": "raw", "model": MODEL, "url": worker.url}]}  # fmt: skip
    gw = gateway(cfg, tmp_path_factory.mktemp("messages"))
    with worker.running(), running(gw, ready_path="/ready"):
        yield gw.url, worker


@pytest.fixture
def gw(stack: tuple[str, RawWorker]) -> Iterator[str]:
    url, worker = stack
    worker.bodies.clear()
    yield url
    assert_nothing_held(url)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)


def test_messages_get_a_thinking_block_then_the_text(gw: str) -> None:
    reply = claude(gw).messages.create(model=MODEL, max_tokens=64, messages=ASK)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    thinking, text = reply.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock)
    assert thinking.thinking == THOUGHT and len(thinking.signature) == 32
    assert isinstance(text, anthropic.types.TextBlock) and text.text == ANSWER


def test_streamed_messages_send_thinking_deltas_in_anthropics_order(gw: str) -> None:
    with claude(gw).messages.stream(model=MODEL, max_tokens=64, messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type != "content_block_delta"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    first_text = deltas.index("text_delta")
    assert set(deltas[:first_text - 1]) == {"thinking_delta"}  # fmt: skip
    assert (
        deltas[first_text - 1] == "signature_delta" and "signature_delta" not in deltas[first_text:]
    )
    assert [b.type for b in final.content] == ["thinking", "text"]
    thinking, text = final.content
    assert isinstance(thinking, anthropic.types.ThinkingBlock) and thinking.thinking == THOUGHT
    assert thinking.signature and isinstance(text, anthropic.types.TextBlock)
    assert text.text == ANSWER


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_disabled_turns_the_templates_switch_off(
    stack: tuple[str, RawWorker], gw: str, stream: bool
) -> None:
    client = claude(gw)
    off: Any = {"type": "disabled"}
    reply: Any
    if stream:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK,
                                    thinking=off) as s:  # fmt: skip
            reply = s.get_final_message()
    else:
        reply = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, thinking=off)
    assert [(b.type, getattr(b, "text", None)) for b in reply.content] == [("text", ANSWER)]
    (_, sent), = stack[1].bodies  # fmt: skip
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}


def test_count_tokens_sees_the_same_switch(stack: tuple[str, RawWorker], gw: str) -> None:
    claude(gw).messages.count_tokens(model=MODEL, messages=ASK, thinking={"type": "disabled"})
    (path, sent), = stack[1].bodies  # fmt: skip
    assert path == "/v1/messages/count_tokens"
    assert sent["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_budget_the_worker_cannot_honour_is_refused_clearly(gw: str, stream: bool) -> None:
    budget: Any = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(gw).messages.create(model=MODEL, max_tokens=2048, messages=ASK, thinking=budget,
                                   stream=stream)  # fmt: skip
    assert e.value.status_code == 400
    body: Any = e.value.body
    assert body["type"] == "error"
    assert "thinking.budget_tokens cannot be honoured for model `m`" in body["error"]["message"]


def test_streamed_responses_count_reasoning_tokens_as_the_whole_reply(gw: str) -> None:
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=30)
    whole = client.responses.create(model=MODEL, input="2+2?")
    final = None
    for event in client.responses.create(model=MODEL, input="2+2?", stream=True):
        if event.type == "response.completed":
            final = event.response
    assert final is not None and whole.usage is not None and final.usage is not None
    words = len(THOUGHT.split())  # the worker's /tokenize counts words
    assert whole.usage.output_tokens_details.reasoning_tokens == words
    assert final.usage.output_tokens_details.reasoning_tokens == words
    assert (
        [i.type for i in final.output] == [i.type for i in whole.output] == ["reasoning", "message"]
    )


def test_a_response_cut_inside_its_thought_is_all_reasoning_tokens(gw: str) -> None:
    """Nothing but reasoning came out: every output token is a reasoning token (vLLM counts
    token ids; the gateway's count of the text could split them differently)."""
    client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=30)
    whole = client.responses.create(model=MODEL, input="2+2?", max_output_tokens=6)
    final = None
    for event in client.responses.create(model=MODEL, input="2+2?", max_output_tokens=6,
                                         stream=True):  # fmt: skip
        if event.type == "response.completed":
            final = event.response
    assert final is not None and whole.usage is not None and final.usage is not None
    assert [i.type for i in whole.output] == [i.type for i in final.output] == ["reasoning"]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 6
    assert final.usage.output_tokens_details.reasoning_tokens == 6


def test_gateway_errors_on_messages_routes_are_in_anthropics_shape(gw: str) -> None:
    """As vLLM's Anthropic handler answers (an unknown model), while a body its validator
    refuses keeps the OpenAI envelope there too."""
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(gw + path, json={"model": "nope", "max_tokens": 4, "messages": ASK})
        assert r.status_code == 404
        assert r.json() == {"type": "error", "error": {
            "type": "NotFoundError",
            "message": "The model `nope` does not exist. Valid aliases: m."}}  # fmt: skip
    bad = httpx.post(gw + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": 1})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "Bad Request"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude(gw).messages.create(model="nope", max_tokens=4, messages=ASK)
    assert "does not exist" in str(e.value)
