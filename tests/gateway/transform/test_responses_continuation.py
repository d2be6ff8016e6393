"""A Responses answer's continuation, without HTTP: vLLM's chat messages, the refusals, what
went out, and the completion's chunks re-framed as Responses events (issue 36)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gpupool.gateway.transform.responses_continuation import (
    RESPONSES,
    AsResponses,
    ResponsesProgress,
    chat_messages,
    completion_body,
    event,
    responses_refusal,
)

BODY: dict[str, Any] = {"model": "m", "input": "Hi", "max_output_tokens": 20}
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": "m", "output": [],
            "status": "in_progress", "usage": None, "max_output_tokens": 20}  # fmt: skip


def _events(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def _chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _text(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": None}
    return _chunk({"id": "cmpl-2", "object": "text_completion", "choices": [choice]})


def _usage(made: int, cached: int = 0) -> bytes:
    usage = {"prompt_tokens": 50, "completion_tokens": made, "total_tokens": 50 + made,
             "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    return _chunk({"id": "cmpl-2", "object": "text_completion", "choices": [], "usage": usage})


def _progress(*texts: str, item_done: bool = False) -> ResponsesProgress:
    p = ResponsesProgress()
    item = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
            "status": "in_progress"}  # fmt: skip
    objs: list[dict[str, Any]] = [
        {"type": "response.created", "response": RESPONSE},
        {"type": "response.in_progress", "response": RESPONSE},
        {"type": "response.output_item.added", "item": item, "output_index": 0},
        {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "part": {"type": "output_text", "text": ""}},
    ]  # fmt: skip
    for t in texts:
        objs.append({"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
                     "content_index": 0, "delta": t, "logprobs": []})  # fmt: skip
    if item_done:
        done = {**item, "status": "completed",
                "content": [{"type": "output_text", "text": "".join(texts)}]}  # fmt: skip
        objs.append({"type": "response.output_text.done", "item_id": "msg_1",
                     "output_index": 0, "content_index": 0, "text": "".join(texts)})  # fmt: skip
        objs.append({"type": "response.output_item.done", "item": done, "output_index": 0})
    out = b"".join(event({**o, "sequence_number": i}) for i, o in enumerate(objs))
    assert p.feed(out[:-3]) == out[: out.rfind(b"\n\n", 0, len(out) - 3) + 2]  # held back
    p.feed(out[-3:])
    return p


def test_chat_messages_as_vllm_makes_them() -> None:
    body = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": "Rules."},
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "one"},
                                              {"type": "output_text", "text": "two"}]},
            {"role": "user", "content": "c", "name": "n"},
        ],
    }  # fmt: skip
    assert responses_refusal(body) is None
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "one"},  # vLLM reads an assistant's first part only
        {"role": "user", "content": "c", "name": "n"},
    ]
    assert chat_messages({"input": "Hi"}) == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"include": ["message.output_text.logprobs"]}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"previous_response_id": "resp_0"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "media"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
         "messages"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "messages"),
        ({"input": [{"role": "assistant", "content": "Par", "status": "incomplete"}]},
         "messages"),
        ({"input": []}, "messages"),
    ],
)  # fmt: skip
def test_refusals(extra: dict[str, Any], why: str) -> None:
    assert responses_refusal({**BODY, **extra}) == why


def test_plain_text_format_is_continued() -> None:
    assert responses_refusal({**BODY, "text": {"format": {"type": "text"}}}) is None


def test_completion_body() -> None:
    body = {**BODY, "temperature": 0.5, "seed": 3, "stop": "x", "instructions": "I",
            "store": True, "request_id": "resp_1"}  # fmt: skip
    out = completion_body(body, [1, 2, 3], sent=5, room=100)
    assert out == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 15, "stream": True,
                   "stream_options": {"include_usage": True}, "temperature": 0.5, "seed": 3,
                   "stop": "x"}  # fmt: skip
    assert completion_body(body, [1], sent=20, room=100) is None
    unbounded = completion_body({"model": "m", "input": "Hi"}, [1], sent=5, room=9)
    assert unbounded is not None and unbounded["max_tokens"] == 9  # vLLM's default: the window


def test_progress_reads_what_went_out() -> None:
    p = _progress("Hel", "lo")
    assert (p.text, p.tokens, p.seq, p.begun, p.broken) == ("Hello", 2, 5, True, None)
    assert p.response["id"] == "resp_1" and p.item is not None and p.item["id"] == "msg_1"


def test_reasoning_or_tool_items_break_it() -> None:
    p = ResponsesProgress()
    p.feed(event({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                  "item": {"id": "rs_1", "type": "reasoning"}}))  # fmt: skip
    assert p.broken == "reasoning"
    q = ResponsesProgress()
    q.feed(event({"type": "response.output_item.added", "sequence_number": 2, "output_index": 0,
                  "item": {"id": "fc_1", "type": "function_call"}}))  # fmt: skip
    assert q.broken == "tool_call"


def test_continuation_goes_on_as_one_stream() -> None:
    p = _progress("Hel", "lo")
    r = AsResponses(p, prompt=30)
    out = _events(r.rewrite(_text(" wor") + _text("ld", "stop") + _usage(2, cached=40)))
    out += _events(r.rewrite(b"data: [DONE]\n\n"))
    assert [e["sequence_number"] for e in out] == list(range(6, 6 + len(out)))
    assert [e["type"] for e in out] == [
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert {e["item_id"] for e in out[:4]} == {"msg_1"}
    assert out[2]["text"] == out[3]["part"]["text"] == "Hello world"
    assert out[4]["item"]["content"][0]["text"] == "Hello world"
    final = out[5]["response"]
    assert (final["id"], final["status"], final["incomplete_details"]) == ("resp_1", "completed",
                                                                           None)  # fmt: skip
    assert [i["id"] for i in final["output"]] == ["msg_1"]
    assert final["usage"]["input_tokens"] == 30 and final["usage"]["output_tokens"] == 4
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 30
    assert final["max_output_tokens"] == 20  # the first response's fields stay


def test_length_ends_incomplete() -> None:
    r = AsResponses(_progress("a"), prompt=3)
    out = _events(r.rewrite(_text("b", "length") + _usage(1)))
    final = out[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_cut_after_the_item_ended_ends_by_the_gateway() -> None:
    p = _progress("Hi", item_done=True)
    out = _events(RESPONSES.end(BODY, p) or b"")  # its text was done: only the end is left
    assert [e["type"] for e in out] == ["response.completed"]
    assert out[0]["sequence_number"] == 7
    assert out[0]["response"]["output"][0]["content"][0]["text"] == "Hi"


def test_cut_before_any_item_opens_one() -> None:
    p = ResponsesProgress()
    p.feed(event({"type": "response.created", "response": RESPONSE, "sequence_number": 0}))
    assert p.begun and RESPONSES.end(BODY, p) is None
    r = AsResponses(p, prompt=3)
    out = _events(r.rewrite(_text("Hi", "stop") + _usage(1)))
    kinds = [e["type"] for e in out]
    assert kinds == ["response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(1, 8))
    assert out[0]["output_index"] == 0 and out[0]["item"]["id"].startswith("msg_")
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"


def test_every_token_out_ends_by_the_gateway() -> None:
    p = _progress(*["x"] * 20)
    out = _events(RESPONSES.end(BODY, p) or b"")
    assert [e["type"] for e in out][-1] == "response.completed"
    assert out[-1]["response"]["status"] == "incomplete"
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == "x" * 20


def test_worker_error_is_the_stream_error_event() -> None:
    r = AsResponses(_progress("a"), prompt=3)
    out = _events(r.rewrite(_chunk({"error": {"message": "boom"}}) + b"data: [DONE]\n\n"))
    assert [e["type"] for e in out] == ["error"]
    assert out[0]["message"] == "boom" and out[0]["sequence_number"] == 5
