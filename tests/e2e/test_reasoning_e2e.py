"""Reasoning through the gateway: workers that return raw `<think>` text (the simulator in script
mode, cut into 1-3 character pieces) and workers that split it themselves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.procs import gateway, running, sim

SCRIPT = "<think>Let me see: 2+2.\n</think>\n\nIt is 4."


@pytest.fixture(scope="module")
def urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("reasoning")
    raw = sim(model="raw", tmp=tmp, mode="script", script=SCRIPT, script_chunking="chars")
    raw.env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # stored responses, as vLLM with it
    raw2 = sim(model="raw-both", tmp=tmp, mode="script", script=SCRIPT, script_chunking="chars")
    split = sim(model="split", tmp=tmp, mode="script", script=SCRIPT, reasoning_parser="qwen3")
    cfg = {
        "models": [
            {"name": "raw", "reasoning": "qwen3"},
            {"name": "raw-both", "reasoning": "qwen3", "reasoning_field": "both"},
            {"name": "split", "reasoning_field": "reasoning_content"},
        ],
        "workers": [
            {"name": "raw", "model": "raw", "url": raw.url},
            {"name": "raw-both", "model": "raw-both", "url": raw2.url},
            {"name": "split", "model": "split", "url": split.url},
        ],
    }
    gw = gateway(cfg, tmp)
    with running(raw, raw2, split), running(gw, ready_path="/ready"):
        yield {"gw": gw.url}


def _client(urls: dict[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=urls["gw"] + "/v1", api_key="x", max_retries=0)


def _ask(urls: dict[str, str], model: str, stream: bool, **extra: Any) -> tuple[str, str, dict]:
    msgs = [{"role": "user", "content": "2+2?"}]
    c = _client(urls)
    if not stream:
        r = c.chat.completions.create(model=model, messages=msgs, extra_body=extra)  # type: ignore[arg-type]
        m = r.choices[0].message
        return (m.model_extra or {}).get("reasoning") or "", m.content or "", m.model_extra or {}
    reasoning, content, keys = "", "", {}
    for chunk in c.chat.completions.create(
        model=model,
        messages=msgs,
        stream=True,  # type: ignore[call-overload]
        extra_body=extra,
    ):
        if chunk.choices:
            extra_fields = chunk.choices[0].delta.model_extra or {}
            keys.update(extra_fields)
            reasoning += extra_fields.get("reasoning") or ""
            content += chunk.choices[0].delta.content or ""
    return reasoning, content, keys


@pytest.mark.parametrize("stream", [False, True])
def test_gateway_splits_raw_think_text(urls: dict[str, str], stream: bool) -> None:
    reasoning, content, _ = _ask(urls, "raw", stream)
    assert reasoning == "Let me see: 2+2.\n"
    assert content == "\n\nIt is 4."  # vLLM keeps the whitespace after </think>


@pytest.mark.parametrize("stream", [False, True])
def test_both_field_names_for_old_clients(urls: dict[str, str], stream: bool) -> None:
    reasoning, _, keys = _ask(urls, "raw-both", stream)
    assert reasoning == "Let me see: 2+2.\n"
    assert "reasoning_content" in keys


@pytest.mark.parametrize("stream", [False, True])
def test_worker_split_renamed_to_reasoning_content(urls: dict[str, str], stream: bool) -> None:
    _, content, keys = _ask(urls, "split", stream)
    assert "reasoning" not in keys or keys["reasoning"] is None
    assert content.strip() == "It is 4."


@pytest.mark.parametrize("stream", [False, True])
def test_enable_thinking_false_and_include_reasoning_false(
    urls: dict[str, str], stream: bool
) -> None:
    reasoning, content, _ = _ask(urls, "raw", stream, include_reasoning=False)
    assert reasoning == "" and content == "\n\nIt is 4."
    reasoning, content, _ = _ask(
        urls, "raw", stream, chat_template_kwargs={"enable_thinking": False}
    )
    assert reasoning == "" and "It is 4." in content


def test_assistant_history_with_either_field_name_is_accepted(urls: dict[str, str]) -> None:
    for name in ("reasoning", "reasoning_content"):
        body = {
            "model": "raw",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", name: "greeting"},
                {"role": "user", "content": "2+2?"},
            ],
        }
        r = httpx.post(urls["gw"] + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_counted_when_gateway_splits(urls: dict[str, str], stream: bool) -> None:
    """vLLM cannot count what it did not split: the worker's tokenizer counts it for us."""
    c = _client(urls)
    msgs = [{"role": "user", "content": "2+2?"}]
    if stream:
        chunks = list(
            c.chat.completions.create(
                model="raw", messages=msgs, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        usage = chunks[-1].usage
    else:
        usage = c.chat.completions.create(model="raw", messages=msgs).usage  # type: ignore[arg-type]
    assert usage is not None and usage.completion_tokens_details is not None
    reasoning = usage.completion_tokens_details.reasoning_tokens
    assert reasoning is not None and 0 < reasoning < usage.completion_tokens


@pytest.mark.parametrize("thinking", [True, False])
def test_a_stored_response_read_again_is_split_as_its_create_was(
    urls: dict[str, str], thinking: bool
) -> None:
    """``GET /v1/responses/{id}`` of a model whose reasoning the gateway splits: the reasoning
    item and ``reasoning_tokens`` the create gave, not the worker's raw ``<think>`` text."""
    c = _client(urls)
    extra = {"chat_template_kwargs": {"enable_thinking": thinking}}
    made = c.responses.create(model="raw", input="2+2?", extra_body=extra)
    got = c.responses.retrieve(made.id)
    assert [o.type for o in got.output] == [o.type for o in made.output]
    assert got.output_text == made.output_text
    assert got.usage is not None and made.usage is not None
    assert got.usage.output_tokens_details.reasoning_tokens == (
        made.usage.output_tokens_details.reasoning_tokens
    )
    if thinking:
        assert [o.type for o in got.output] == ["reasoning", "message"]
        assert got.output_text.strip() == "It is 4."
        assert got.usage.output_tokens_details.reasoning_tokens > 0
