"""``/v1/responses`` reasoning normalisation on recorded vLLM-shaped bodies and events.

The events below are what vLLM 0.32 without ``--reasoning-parser`` sends for one message
(``entrypoints/openai/responses/streaming_events.py``, simple path); the expected events are what
it sends with the parser: a ``reasoning`` item (``rs_…``) first, then the message.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from gpupool.gateway.transform.chat import TransformOptions
from gpupool.gateway.transform.responses import (
    ResponsesStreamTransformer,
    reasoning_texts,
    transform_responses_body,
)

Json = dict[str, Any]
QWEN = TransformOptions(parser="qwen3")


def message(text: str, item_id: str = "msg_1") -> Json:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
    return {"id": item_id, "type": "message", "role": "assistant", "status": "completed",
            "content": [part]}  # fmt: skip


def response(*output: Json, status: str = "completed") -> Json:
    usage = {"input_tokens": 5, "output_tokens": 9, "total_tokens": 14,
             "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0}}  # fmt: skip
    return {"id": "resp_1", "object": "response", "model": "m", "status": status,
            "output": list(output), "usage": usage}  # fmt: skip


def upstream_events(deltas: list[str], tail: list[Json] | None = None) -> list[tuple[str, Json]]:
    """vLLM's event sequence for one streamed message made of ``deltas``."""
    text = "".join(deltas)
    base = {"output_index": 0, "item_id": "msg_1", "content_index": 0}
    item0 = {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
             "status": "in_progress"}  # fmt: skip
    events: list[Json] = [
        {"type": "response.created", "response": response(status="in_progress")},
        {"type": "response.in_progress", "response": response(status="in_progress")},
        {"type": "response.output_item.added", "output_index": 0, "item": item0},
        {"type": "response.content_part.added", **base,
         "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}},
        *({"type": "response.output_text.delta", **base, "delta": d, "logprobs": []}
          for d in deltas),
        {"type": "response.output_text.done", **base, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **base, "part": message(text)["content"][0]},
        {"type": "response.output_item.done", "output_index": 0, "item": message(text)},
        *(tail or []),
        {"type": "response.completed", "response": response(message(text))},
    ]  # fmt: skip
    for n, e in enumerate(events):
        e["sequence_number"] = n
    return [(e["type"], e) for e in events]


def run(t: ResponsesStreamTransformer, events: list[tuple[str, Json]]) -> list[tuple[str, Json]]:
    out = list(itertools.chain.from_iterable(t.feed(k, v) for k, v in events))
    return out + t.finish()


def types(events: list[tuple[str, Json]]) -> list[str]:
    return [k.removeprefix("response.") for k, _ in events]


# ---- whole bodies ---------------------------------------------------------------------------


def test_body_reasoning_item_comes_first_and_text_leaves_the_message() -> None:
    body = response(message("<think>plan it</think>\n\nHi"))
    out = transform_responses_body(body, QWEN)
    reasoning, msg = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"text": "plan it", "type": "reasoning_text"}]
    assert reasoning["summary"] == [] and reasoning["status"] is None
    assert msg["content"][0]["text"] == "\n\nHi" and msg["id"] == "msg_1"
    assert reasoning_texts(out) == ["plan it"]


def test_body_cut_mid_thought_has_no_message() -> None:
    out = transform_responses_body(response(message("still thinking")), QWEN)
    assert [i["type"] for i in out["output"]] == ["reasoning"]


def test_body_include_reasoning_false_and_no_parser() -> None:
    body = response(message("r</think>answer"))
    hidden = transform_responses_body(
        body, TransformOptions(parser="qwen3", include_reasoning=False)
    )
    assert [i["type"] for i in hidden["output"]] == ["message"]
    assert hidden["output"][0]["content"][0]["text"] == "answer"
    assert transform_responses_body(body, TransformOptions()) is body


def test_body_worker_split_and_tool_calls_untouched() -> None:
    split = response({"type": "reasoning", "id": "rs_w", "summary": [], "content": []},
                     message("<think>literal"))  # fmt: skip
    assert transform_responses_body(split, QWEN) is split
    call = {"type": "function_call", "id": "fc_1", "call_id": "c", "name": "f", "arguments": "{}"}
    body = response(message("a</think>b"), call)
    before = copy.deepcopy(body)
    out = transform_responses_body(body, QWEN)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][2] is call and body == before


def test_body_reasoning_tokens_counted_with_a_tokenizer() -> None:
    opts = TransformOptions(parser="qwen3", count_tokens=lambda s: len(s.split()))
    out = transform_responses_body(response(message("one two three</think>x")), opts)
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


# ---- streams ----------------------------------------------------------------------------------


def test_stream_emits_vllm_reasoning_events_then_the_message() -> None:
    t = ResponsesStreamTransformer(QWEN)
    out = run(t, upstream_events(["<th", "ink>Let", " me</th", "ink>", "\n\n", "Hi"]))
    assert types(out) == [
        "created", "in_progress",
        "output_item.added", "content_part.added",  # the reasoning item
        "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added",  # the message
        "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "completed",
    ]  # fmt: skip
    events = [e for _, e in out]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = events[2]
    assert added["item"]["type"] == "reasoning" and added["output_index"] == 0
    assert events[3]["part"] == {"text": "", "type": "reasoning_text"}
    assert [e["delta"] for e in events[4:6]] == ["Let", " me"]
    assert events[6]["text"] == "Let me"
    assert events[8]["item"]["content"] == [{"text": "Let me", "type": "reasoning_text"}]
    assert events[9]["item"]["type"] == "message" and events[9]["output_index"] == 1
    assert [e["delta"] for e in events[11:13]] == ["\n\n", "Hi"]  # as the worker sent them
    assert events[11]["output_index"] == events[12]["output_index"] == 1
    assert events[13]["text"] == "\n\nHi"
    assert events[15]["item"]["content"][0]["text"] == "\n\nHi"
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"]
    assert final[0]["id"] == added["item"]["id"]  # the ids the events announced
    assert t.reasoning == ["Let", " me"]


def test_stream_concatenation_equals_the_body_transform() -> None:
    deltas = ["<think>", "a", "b</", "think", ">", "c", "d"]
    out = run(ResponsesStreamTransformer(QWEN), upstream_events(deltas))
    reasoning = "".join(e["delta"] for k, e in out if k == "response.reasoning_text.delta")
    content = "".join(e["delta"] for k, e in out if k == "response.output_text.delta")
    body = transform_responses_body(response(message("".join(deltas))), QWEN)
    assert reasoning == body["output"][0]["content"][0]["text"] == "ab"
    assert content == body["output"][1]["content"][0]["text"] == "cd"


def test_stream_all_reasoning_sends_no_message_and_later_items_keep_their_place() -> None:
    call_added = {"type": "response.output_item.added", "output_index": 1,
                  "item": {"type": "function_call", "id": "fc_1"}}  # fmt: skip
    out = run(ResponsesStreamTransformer(QWEN), upstream_events(["thinking", " on"], [call_added]))
    kinds = [(k, e.get("item", {}).get("type")) for k, e in out if k.endswith("item.added")]
    assert kinds == [("response.output_item.added", "reasoning"),
                     ("response.output_item.added", "function_call")]  # fmt: skip
    assert next(e for k, e in out if e.get("item", {}).get("id") == "fc_1")["output_index"] == 1
    assert "response.output_text.delta" not in types(out)


def test_stream_include_reasoning_false_sends_only_the_answer() -> None:
    t = ResponsesStreamTransformer(TransformOptions(parser="qwen3", include_reasoning=False))
    out = run(t, upstream_events(["r", "</think>", "ok"]))
    assert "reasoning_text.delta" not in types(out)
    text = [e for k, e in out if k == "response.output_text.delta"]
    assert [e["delta"] for e in text] == ["ok"] and text[0]["output_index"] == 0
    assert t.reasoning == ["r"]  # still counted


def test_stream_without_split_passes_every_event_through_identical() -> None:
    events = upstream_events(["<think>x</think>y"])
    t = ResponsesStreamTransformer(TransformOptions())
    assert all(t.feed(k, v) == [(k, v)] for k, v in events)


def test_stream_worker_reasoning_items_are_not_split_again() -> None:
    t = ResponsesStreamTransformer(QWEN)
    item = {"type": "response.output_item.added", "sequence_number": 0, "output_index": 0,
            "item": {"type": "reasoning", "id": "rs_w", "summary": []}}  # fmt: skip
    assert t.feed(item["type"], item) == [(item["type"], item)]
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "output_index": 1,
             "item_id": "msg", "content_index": 0, "delta": "<think>"}  # fmt: skip
    assert t.feed(delta["type"], delta) == [(delta["type"], delta)]


def test_stream_cut_off_upstream_is_closed_by_finish() -> None:
    t = ResponsesStreamTransformer(QWEN)
    events = upstream_events(["a</think>b"])[:5]  # up to the first delta: the worker died
    out = run(t, events)
    assert types(out)[-3:] == ["output_text.done", "content_part.done", "output_item.done"]
    assert out[-1][1]["item"]["content"][0]["text"] == "b"
