"""The route-shaped half of migration (``transform/continuation.py``), without HTTP: what the
next worker is asked, what cannot be continued, and how its events join the client's stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpupool.gateway.transform.continuation import (
    Progress,
    Resume,
    continuation,
    end_events,
    refusal,
)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chat_chunk(content: str | None = None, role: bool = False, **extra: Any) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": extra.pop("finish", None)}
    return _event({"id": extra.pop("id", "chatcmpl-a"), "created": extra.pop("created", 1),
                   "object": "chat.completion.chunk", "model": "m", "choices": [choice],
                   **extra})  # fmt: skip


def _objects(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
        "temperature": 0, "seed": 7, "stream": True}  # fmt: skip


def test_a_chat_continues_from_the_partial_assistant_message() -> None:
    p = Progress(chat=True)
    p.feed(_chat_chunk(role=True) + _chat_chunk("Hel") + _chat_chunk("lo"))
    body = continuation(CHAT, True, p)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 8  # two tokens went out
    assert body["seed"] == 7 and body["temperature"] == 0  # sampling as it was
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the original untouched


def test_a_completion_continues_from_its_prompt_and_text() -> None:
    p = Progress(chat=False)
    p.feed(_event({"id": "cmpl-a", "choices": [{"index": 0, "text": " once"}]}))
    body = continuation({"model": "m", "prompt": "Tell", "stream": True}, False, p)
    assert body == {"model": "m", "prompt": "Tell once", "stream": True, "max_tokens": 15}


def test_half_an_event_is_held_back_until_it_ends() -> None:
    p = Progress(chat=True)
    whole = _chat_chunk("ab")
    assert p.feed(whole[:10]) == b""
    assert p.feed(whole[10:]) == whole
    assert p.text == "ab" and p.tokens == 1


def test_nothing_sent_is_the_same_request_again() -> None:
    assert continuation(CHAT, True, Progress(chat=True)) is CHAT


def test_no_token_left_ends_the_stream_instead() -> None:
    p = Progress(chat=True)
    for _ in range(10):
        p.feed(_chat_chunk("x"))
    assert continuation(CHAT, True, p) is None
    ends = _objects(end_events(p, True))
    assert ends[0]["choices"][0]["finish_reason"] == "length" and ends[0]["id"] == "chatcmpl-a"
    assert end_events(p, True).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "n>1"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ({"tool_choice": "required", "tools": []}, "structured_outputs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_what_cannot_be_continued_exactly_says_why(extra: dict[str, Any], why: str) -> None:
    assert refusal({**CHAT, **extra}, chat=True) == why


def test_completions_refusals() -> None:
    base = {"model": "m", "prompt": "a"}
    assert refusal(base, chat=False) is None
    assert refusal({**base, "logprobs": 0}, chat=False) == "logprobs"
    assert refusal({**base, "prompt": ["a", "b"]}, chat=False) == "prompt"
    assert refusal({**base, "echo": True}, chat=False) == "echo"
    assert refusal({**CHAT, "response_format": {"type": "text"}}, chat=True) is None


def test_a_streamed_tool_call_or_reasoning_breaks_continuation() -> None:
    p = Progress(chat=True)
    p.feed(_event({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "t"}]}}]}))
    assert p.broken == "tool_call"
    q = Progress(chat=True)
    q.feed(_event({"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "hm"}}]}))
    assert q.broken == "reasoning"


def test_the_continuation_goes_on_as_the_first_stream() -> None:
    p = Progress(chat=True)
    p.feed(_chat_chunk(role=True, system_fingerprint="fp") + _chat_chunk("Hel"))
    r = Resume(p, prompt=9)
    usage = {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}
    raw = r.rewrite(
        _chat_chunk(role=True, id="chatcmpl-b", created=5)
        + _chat_chunk("lo", id="chatcmpl-b", created=5)
        + _chat_chunk(finish="stop", id="chatcmpl-b", created=5)
        + _event({"id": "chatcmpl-b", "created": 5, "choices": [], "usage": usage})
        + b"data: [DONE]\n\n"
    )
    objs = _objects(raw)
    assert len(objs) == 3  # the second role delta is gone
    assert {o["id"] for o in objs} == {"chatcmpl-a"} and {o["created"] for o in objs} == {1}
    assert all(o["system_fingerprint"] == "fp" for o in objs)
    assert objs[0]["choices"][0]["delta"] == {"content": "lo"}
    # the prompt once (9, the new worker's count of the original), completion as received
    assert objs[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert raw.endswith(b"data: [DONE]\n\n") and p.text == "Hello"


def test_usage_without_a_count_is_the_prompt_less_what_was_fed_back() -> None:
    p = Progress(chat=False)
    p.feed(_event({"id": "cmpl-a", "choices": [{"index": 0, "text": "x"}]}))
    r = Resume(p)
    assert r.usage({"prompt_tokens": 5, "completion_tokens": 3})["prompt_tokens"] == 4
