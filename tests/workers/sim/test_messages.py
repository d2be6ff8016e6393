"""The simulator serves vLLM's Anthropic ``/v1/messages`` (and ``count_tokens``), so Claude-style
clients work against it: the official ``anthropic`` SDK, whole and streamed, with and without
a reasoning parser; a thinking budget refused as vLLM refuses it (``workers/sim/messages.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.procs import Proc, running, sim

SCRIPT = "<think>Let me see.</think>It is 4."
ASK: Any = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("sim-messages")
    plain = sim(model="m", tmp=tmp, mode="echo")
    parsed = sim(model="p", tmp=tmp, mode="script", script=SCRIPT, reasoning_parser="qwen3")
    with running(plain, parsed):
        yield {"plain": plain, "parsed": parsed}


def _claude(p: Proc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=p.url, api_key="x", max_retries=0, timeout=30)


def test_a_message_whole_and_streamed(sims: dict[str, Proc]) -> None:
    claude = _claude(sims["plain"])
    whole = claude.messages.create(model="m", max_tokens=8, messages=ASK)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    with claude.messages.stream(model="m", max_tokens=8, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_thinking_blocks_with_a_parser(sims: dict[str, Proc]) -> None:
    claude = _claude(sims["parsed"])
    whole = claude.messages.create(model="p", max_tokens=64, messages=ASK)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "Let me see."  # type: ignore[union-attr]
    with claude.messages.stream(model="p", max_tokens=64, messages=ASK) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "It is 4."  # type: ignore[union-attr]
    off = claude.messages.create(model="p", max_tokens=64, messages=ASK,
                                 thinking={"type": "disabled"})  # fmt: skip
    assert [b.type for b in off.content] == ["text"]


def test_a_budget_without_a_reasoning_config_is_refused_as_vllm_does(
    sims: dict[str, Proc],
) -> None:
    url = sims["plain"].url + "/v1/messages"
    body = {"model": "m", "max_tokens": 1030, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    assert "thinking_token_budget is set but reasoning_config" in r.json()["error"]["message"]
    r = httpx.post(url, json={**body, "stream": True}, timeout=30)  # 200, then its error
    assert r.status_code == 200
    assert r.text.startswith("event: error\n") and "internal_error" in r.text


def test_count_tokens_and_errors_in_anthropic_shape(sims: dict[str, Proc]) -> None:
    claude = _claude(sims["plain"])
    counted = claude.messages.count_tokens(model="m", messages=ASK)
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="nope", max_tokens=8, messages=ASK)
    assert e.value.body["type"] == "error"  # type: ignore[index]
