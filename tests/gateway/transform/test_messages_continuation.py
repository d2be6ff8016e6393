"""A Messages answer's continuation, without HTTP: the adapter's chat messages, the refusals,
what went out, and the completion's chunks re-framed as Anthropic events (issue 36)."""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.gateway.transform.messages_continuation import (
    AsMessages,
    MessagesProgress,
    chat_messages,
    completion_body,
    event,
    messages_refusal,
)

BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 20,
    "messages": [{"role": "user", "content": "Hi"}],
}


PARTS = [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]


def _events(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def _chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _progress(*texts: str, stop: bool = False) -> MessagesProgress:
    p = MessagesProgress()
    start = {"type": "message_start", "message": {"id": "msg-1", "usage": {"input_tokens": 4}}}
    out = event(start) + event(
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    )
    for t in texts:
        delta = {"type": "text_delta", "text": t}
        out += event({"type": "content_block_delta", "index": 0, "delta": delta})
    if stop:
        out += event({"type": "content_block_stop", "index": 0})
    assert p.feed(out[:-3]) == out[: out.rfind(b"\n\n", 0, len(out) - 3) + 2]  # held back
    p.feed(out[-3:])
    return p


def test_chat_messages_as_the_adapter_makes_them() -> None:
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: 1"},
                   {"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": ""}]},
            {"role": "assistant", "content": []},
            {"role": "user", "content": PARTS},
        ],
    }  # fmt: skip
    assert chat_messages(body) == [
        {"role": "system", "content": "AB"},
        {"role": "assistant"},
        {"role": "user", "content": PARTS},
    ]


def test_refusals() -> None:
    assert messages_refusal(BODY) is None
    assert messages_refusal({**BODY, "tools": [{"name": "f"}]}) == "tools"
    assert messages_refusal({**BODY, "thinking": {"type": "enabled"}}) == "thinking"
    image = {"type": "image", "source": {"type": "url", "url": "u"}}
    assert messages_refusal({**BODY, "messages": [{"role": "user", "content": [image]}]}) == "media"
    inline = [{"role": "system", "content": "s"}, *BODY["messages"]]
    assert messages_refusal({**BODY, "messages": inline}) == "messages"


def test_progress_reads_what_went_out() -> None:
    p = _progress("Hel", "lo")
    assert (p.text, p.tokens, p.begun, p.block, p.broken, p.input_tokens) == (
        "Hello",
        2,
        True,
        0,
        None,
        4,
    )
    p.note({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use"}})
    assert p.broken == "tool_call"


def test_completion_body() -> None:
    body = {**BODY, "temperature": 0.5, "stop_sequences": ["S"], "metadata": {"user_id": "u"}}
    out = completion_body(body, [1, 2, 3], 5, 100)
    assert out == {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 15, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.5, "stop": ["S"],
    }  # fmt: skip
    assert (
        completion_body(body, [1], 5, 3) is not None and completion_body(body, [1], 20, 9) is None
    )


def test_completion_chunks_become_the_message_s_events() -> None:
    p = _progress("Hel", "lo")
    r = AsMessages(p, prompt=7)
    head = {"id": "cmpl-2", "object": "text_completion"}
    out = r.rewrite(
        _chunk({**head, "choices": [{"index": 0, "text": " you", "finish_reason": None}]})
    )
    out += r.rewrite(
        _chunk(
            {
                **head,
                "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": "S"}],
            }
        )
    )
    out += r.rewrite(
        _chunk({**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    )
    out += r.rewrite(b"data: [DONE]\n\n")
    assert _events(out) == [
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "text_delta", "text": " you"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "S"},
         "usage": {"input_tokens": 7, "output_tokens": 4}},
        {"type": "message_stop"},
    ]  # fmt: skip
    assert b"event: message_stop\n" in out and p.text == "Hello you"


def test_text_after_a_stopped_block_opens_a_new_one() -> None:
    p = _progress("Hi", stop=True)
    r = AsMessages(p, prompt=7)
    out = r.rewrite(_chunk({"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}))
    out += r.rewrite(b"data: [DONE]\n\n")
    kinds = [(e["type"], e.get("index")) for e in _events(out)]
    assert kinds == [
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert _events(out)[3]["delta"]["stop_reason"] == "max_tokens"


def test_end_closes_only_what_is_open() -> None:
    p = _progress("Hi")
    out = p.end(("max_tokens", None), {"input_tokens": 4, "output_tokens": 1})
    assert [e["type"] for e in _events(out)] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert p.end(("max_tokens", None), {}) == b""


def test_a_worker_error_is_passed_on_and_ends_the_stream() -> None:
    r = AsMessages(_progress("Hi"), prompt=7)
    out = r.rewrite(_chunk({"error": {"message": "boom", "code": 500}}) + b"data: [DONE]\n\n")
    assert _events(out) == [{"type": "error", "error": {"type": "api_error", "message": "boom"}}]


def test_progress_reads_other_framings() -> None:
    p = MessagesProgress()
    start = b'data: {"type":"message_start","message":{"id":"m"}}'
    delta = b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a"}}'
    p.feed(b"event: message_start\r\n" + start + b"\r\n\r\n")  # CRLF
    p.feed(b": keep-alive\n\nevent: content_block_delta\ndata:" + delta + b"\n\n")  # no space
    assert (p.begun, p.text) == (True, "a")
