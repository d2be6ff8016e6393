"""The completion that continues a chat answer its template rewrites, without HTTP."""

from __future__ import annotations

import orjson

from gpupool.gateway.pipeline.continue_completion import (
    AsChat,
    as_chat,
    completion_body,
    cut,
    refused,
    text_only,
)
from gpupool.gateway.transform.continuation import Progress

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "seed": 3, "temperature": 0.5, "chat_template_kwargs": {"enable_thinking": True},
        "continue_final_message": False, "stream_options": {"include_usage": True}}  # fmt: skip


def test_body_keeps_sampling_and_spends_what_was_sent() -> None:
    out = completion_body({**CHAT, "max_completion_tokens": 20, "min_tokens": 5}, [1, 2], 7, 90)
    assert out == {"model": "m", "stream": True, "seed": 3, "temperature": 0.5,
                   "stream_options": {"include_usage": True}, "prompt": [1, 2],
                   "max_tokens": 13, "min_tokens": 0}  # fmt: skip


def test_body_without_a_limit_takes_the_window_as_chat_does() -> None:
    out = completion_body(CHAT, [1, 2, 3], 4, 50)
    assert out is not None and out["max_tokens"] == 50
    capped = completion_body({**CHAT, "max_tokens": 100}, [1], 4, 10)
    assert capped is not None and capped["max_tokens"] == 10
    assert completion_body({**CHAT, "max_tokens": 4}, [1], 4, 10) is None
    assert completion_body(CHAT, [1], 4, 0) is None


def test_markers_refusal_and_media() -> None:
    assert cut("<think>a</think>b") and not cut("<think>a")
    assert refused(b'{"error":{"message":"continue_final_message is set but the final message '
                   b'does not appear in the chat after applying the chat template!"}}')  # fmt: skip
    assert text_only(CHAT)
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert not text_only({"messages": [{"role": "user", "content": [image]}]})
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert not text_only({**CHAT, "tools": tools})
    assert text_only({**CHAT, "tools": tools, "tool_choice": "none"})


def test_completion_chunks_join_the_chat_stream() -> None:
    progress = Progress(chat=True)
    delta = {"role": "assistant", "content": "a</think>"}
    first = {"id": "chatcmpl-1", "created": 5, "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": delta}]}  # fmt: skip
    progress.feed(b"data: " + orjson.dumps(first) + b"\n\n")
    rw = AsChat(progress, prompt=9)
    chunks = [
        {"id": "cmpl-2", "created": 6, "object": "text_completion",
         "choices": [{"index": 0, "text": "b", "finish_reason": "stop", "stop_reason": None}]},
        {"id": "cmpl-2", "created": 6, "object": "text_completion", "choices": [],
         "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}},
    ]  # fmt: skip
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    out = [e for e in rw.rewrite(raw).split(b"\n\n") if e]
    assert out[-1] == b"data: [DONE]"
    text, usage = orjson.loads(out[0][6:]), orjson.loads(out[1][6:])
    assert text["id"] == usage["id"] == "chatcmpl-1" and text["created"] == 5
    assert text["object"] == "chat.completion.chunk"
    assert text["choices"] == [{"index": 0, "delta": {"content": "b"}, "logprobs": None,
                                "finish_reason": "stop", "stop_reason": None}]  # fmt: skip
    assert usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    assert progress.text == "a</think>b" and progress.finished
    assert as_chat({"choices": "x"}) == {"choices": "x"}
