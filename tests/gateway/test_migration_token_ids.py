"""A stream that moves goes on from the token ids its worker generated (issue 36).

A real `gpupool serve` in front of two fake workers (``support/template_worker.py``: one
character a token, ids its code points) that return token ids as vLLM 0.32 does when asked.
The first to take a stream sends part of the answer and dies; the other gets one
``/v1/completions`` whose prompt is the first worker's prompt ids and generated ids (no
``/tokenize``, no chat template), and the official ``openai`` client reads one stream: the
whole answer, nothing repeated or lost, one id, usage counted once (the ids as completion
tokens). What the client reads before the cut is, byte for byte, what the worker writes
without ``return_token_ids``; a client that asks for the ids gets them as they came.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, running
from tests.support.template_tools import asked, survivor_of, template_worker
from tests.support.template_worker import ANSWER, FULL, render

pytestmark = [pytest.mark.timeout(60)]

MESSAGES = [{"role": "user", "content": "What is it?"}]
DIE_AFTER = 9  # the cut comes after "</think>" (no template to cut it any more) and " me"
PARTIAL = "".join(ANSWER[:DIE_AFTER])
PROMPT = "What is it?<|assistant|>"  # the fake's completions answer follows its marker


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    a, b = (
        template_worker(tmp_path, die_after=DIE_AFTER),
        template_worker(tmp_path, die_after=DIE_AFTER),
    )
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    gw = gateway(cfg, tmp_path)
    with running(a, b, gw):
        yield gw, a, b


def test_a_chat_stream_goes_on_from_its_token_ids(pair: tuple[Proc, Proc, Proc]) -> None:
    gw, a, b = pair
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, max_tokens=60, temperature=0.7, seed=11,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    survivor = survivor_of(a, b)
    seen = asked(survivor)
    assert_nothing_held(gw.url, {})
    log = gw.logs()

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == FULL  # nothing lost or repeated at the cut, </think> and all
    assert {c.id for c in chunks} == {"chatcmpl-first"}
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    prompt = [ord(ch) for ch in render(MESSAGES, True)]
    usage = chunks[-1].usage
    assert usage is not None
    rest = len(ANSWER) - DIE_AFTER  # the fake counts a piece a token
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), len(PARTIAL) + rest)
    # the survivor got one completion of the ids: nothing tokenized, no template
    assert [s["path"] for s in seen] == ["/v1/completions"]
    sent = seen[0]["body"]
    assert sent["prompt"] == prompt + [ord(ch) for ch in PARTIAL]
    assert sent["max_tokens"] == 60 - len(PARTIAL)  # the ids sent, one a character here
    assert (sent["seed"], sent["temperature"], sent["return_token_ids"]) == (11, 0.7, True)
    assert "messages" not in sent and "continue_final_message" not in sent
    assert "generated token ids" in log and "returned no token ids" not in log


def test_a_completion_stream_goes_on_from_its_token_ids(pair: tuple[Proc, Proc, Proc]) -> None:
    gw, a, b = pair
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    usage_too = {"include_usage": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            max_tokens=60, stream_options=usage_too))  # fmt: skip
    seen = asked(survivor_of(a, b))
    assert_nothing_held(gw.url, {})

    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL
    assert {c.id for c in chunks} == {"cmpl-first"}
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(PROMPT)
    assert usage.completion_tokens == len(PARTIAL) + len(ANSWER) - DIE_AFTER
    assert [s["path"] for s in seen] == ["/v1/completions"]
    sent = seen[0]["body"]
    assert sent["prompt"] == [ord(ch) for ch in PROMPT + PARTIAL]
    assert sent["max_tokens"] == 60 - len(PARTIAL)
    # the client's chunks carry no ids, as the worker writes them without the flag
    extras = [c.choices[0].model_extra or {} for c in chunks if c.choices]
    assert all((e["prompt_token_ids"], e["token_ids"]) == (None, None) for e in extras)


def _events(url: str, path: str, body: dict[str, Any]) -> list[bytes]:
    """The SSE events a stream gave until it ended or its connection broke."""
    raw = b""
    try:
        with httpx.stream("POST", url + path, json=body, timeout=30) as r:
            for part in r.iter_raw():
                raw += part
    except httpx.HTTPError:
        pass  # the fake dies mid-body
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_before_the_cut_the_client_reads_the_bytes_vllm_writes_without_the_flag(
    tmp_path: Path, pair: tuple[Proc, Proc, Proc], path: str
) -> None:
    """The ids are taken out at the byte level: every event before the cut is the one the
    worker writes when nobody asks for ids (each list ``null``, the held piece's chunk gone)."""
    gw, _, _ = pair
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 60}
    body |= {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    alone = template_worker(tmp_path, die_after=DIE_AFTER)
    with running(alone):
        direct = _events(alone.url, path, body)
    through = _events(gw.url, path, body)
    assert_nothing_held(gw.url, {})
    assert len(direct) == DIE_AFTER + (1 if "chat" in path else 0)  # the fake dies after
    assert through[: len(direct)] == direct
    assert b'token_ids":[' not in b"".join(through)


def test_a_client_that_asks_for_the_ids_gets_them_as_they_came(
    pair: tuple[Proc, Proc, Proc],
) -> None:
    gw, _, _ = pair
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 60,
            "return_token_ids": True}  # fmt: skip
    events = _events(gw.url, "/v1/chat/completions", body)
    assert_nothing_held(gw.url, {})
    assert events[0].endswith(b',"prompt_token_ids":%s,"prompt_text":null}' % str(
        [ord(ch) for ch in render(MESSAGES, True)]).replace(" ", "").encode())  # fmt: skip
    assert b'"delta":{},"logprobs":null,"finish_reason":null,"token_ids":[32,109]' in events[3]
    assert events[1].endswith(b'"token_ids":[60,116,104,105,110,107,62]}]}')  # <think>
    # it is not continued (the ids already returned are its state): the error event, as before
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"


def test_a_split_reasoning_goes_on_from_the_ids_mid_thought(tmp_path: Path) -> None:
    """A model whose reasoning the gateway splits (its worker runs no parser): cut inside the
    thought, the ids carry the raw ``<think>`` text on, and the split goes on over it."""
    a, b = template_worker(tmp_path, die_after=3), template_worker(tmp_path, die_after=3)
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    cfg["models"] = [{"name": MODEL, "reasoning": "qwen3"}]
    gw = gateway(cfg, tmp_path)
    with running(a, b, gw):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                                     stream=True, max_tokens=60))  # fmt: skip
        seen = asked(survivor_of(a, b))
        assert_nothing_held(gw.url, {})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    text = "".join(d.content or "" for d in deltas)
    assert (reasoning, text) == ("Let me see.", FULL.split("</think>")[1])
    paths = [s["path"] for s in seen]
    assert paths[0] == "/v1/completions", paths  # from the ids: no /tokenize of the rendering
    assert seen[0]["body"]["prompt"][-len("<think>Let me") :] == [ord(c) for c in "<think>Let me"]
