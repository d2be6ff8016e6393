"""``/v1/messages`` on a model the gateway splits: what a worker without a reasoning parser
sends (its ``<think>`` in a text block), reshaped as vLLM's Anthropic adapter with a parser
writes it (``transform/messages.py``). The events here are the raw worker's, as vLLM 0.32
writes them; the expected ones follow ``entrypoints/anthropic/serving.py``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gpupool.config.models import ModelConfig
from gpupool.gateway.transform.chat import TransformOptions, has_grammar
from gpupool.gateway.transform.messages import (
    MessagesStreamTransformer,
    budget_refusal,
    thinking_switch,
    transform_messages_body,
)

Json = dict[str, Any]
TEXT = "<think>abc def</think>hello world"


def opts(**body: Any) -> TransformOptions:
    model = ModelConfig.model_validate({"name": "m", "reasoning": "qwen3"})
    return TransformOptions.from_request(model, body)


def message(*content: Json) -> Json:
    return {"id": "chatcmpl-1", "type": "message", "role": "assistant", "content": list(content),
            "model": "m", "stop_reason": "end_turn", "usage": {"input_tokens": 3,
                                                               "output_tokens": 9}}  # fmt: skip


# ---- whole bodies -----------------------------------------------------------------------------


def test_text_with_think_becomes_a_thinking_block_then_the_text() -> None:
    out = transform_messages_body(message({"type": "text", "text": TEXT}), opts())
    thinking, text = out["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "abc def"
    assert len(thinking["signature"]) == 32 and int(thinking["signature"], 16) >= 0  # uuid hex
    assert text == {"type": "text", "text": "hello world"}
    assert out["usage"] == {"input_tokens": 3, "output_tokens": 9}


def test_all_reasoning_keeps_no_text_block_and_tool_use_stays_last() -> None:
    tool = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}
    out = transform_messages_body(message({"type": "text", "text": "<think>only"}, tool), opts())
    assert [b["type"] for b in out["content"]] == ["thinking", "tool_use"]
    assert out["content"][1] is tool


def test_thinking_off_and_worker_split_bodies_are_left_alone() -> None:
    off = message({"type": "text", "text": "\n\nhello"})
    thinking_off = opts(chat_template_kwargs={"enable_thinking": False})
    assert transform_messages_body(off, thinking_off) is off
    split = message({"type": "thinking", "thinking": "a", "signature": "s"},
                    {"type": "text", "text": "b"})  # fmt: skip
    assert transform_messages_body(split, opts()) is split


def test_a_grammar_bound_message_is_not_split() -> None:
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    assert has_grammar(fmt) and opts(**fmt).parser is None


# ---- streams ------------------------------------------------------------------------------------


def raw_stream(text: str, pieces: list[str], tool: bool = False) -> list[tuple[str, Json]]:
    """A worker's events (no parser) for one text block cut into ``pieces``."""
    assert "".join(pieces) == text
    start = {"type": "message_start", "message": {"id": "chatcmpl-1", "type": "message",
             "role": "assistant", "content": [], "model": "m", "stop_reason": None,
             "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}}  # fmt: skip
    out: list[tuple[str, Json]] = [("message_start", start)]
    out.append(("content_block_start", {"type": "content_block_start",
                                        "content_block": {"type": "text", "text": ""},
                                        "index": 0}))  # fmt: skip
    for p in pieces:
        out.append(("content_block_delta", {"type": "content_block_delta",
                                            "delta": {"type": "text_delta", "text": p},
                                            "index": 0}))  # fmt: skip
    out.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    if tool:
        block = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}
        out += [("content_block_start", {"type": "content_block_start", "content_block": block,
                                         "index": 1}),
                ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": "{}"}}),
                ("content_block_stop", {"type": "content_block_stop", "index": 1})]  # fmt: skip
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"input_tokens": 3, "output_tokens": 9}}  # fmt: skip
    return [*out, ("message_delta", delta), ("message_stop", {"type": "message_stop"})]


def reshape(events: list[tuple[str, Json]], o: TransformOptions) -> list[tuple[str, Json]]:
    t = MessagesStreamTransformer(o)
    out = [e for event in events for e in t.feed(*event)]
    return out + t.finish()


def summary(events: list[tuple[str, Json]]) -> list[Any]:
    """Each block as (index, type, text joined, signature seen), and the events around them."""
    out: list[Any] = []
    for kind, obj in events:
        assert obj["type"] == kind
        if kind == "content_block_start":
            block = obj["content_block"]
            out.append([obj["index"], block["type"], "", False])
        elif kind == "content_block_delta":
            current = out[-1]
            assert obj["index"] == current[0]
            delta = obj["delta"]
            if delta["type"] == "signature_delta":
                assert len(delta["signature"]) == 32 and not current[3]
                current[3] = True
            else:
                assert not current[3]  # the signature is the thinking block's last delta
                current[2] += delta.get("thinking") or delta.get("text") or delta["partial_json"]
        elif kind == "content_block_stop":
            assert obj["index"] == out[-1][0]
            out[-1] = tuple(out[-1])
        else:
            out.append(kind)
    return out


def cuts(text: str) -> list[list[str]]:
    """``text`` in pieces of one, two and three characters, and cut at every point."""
    sizes = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3)]
    return sizes + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize("pieces", cuts(TEXT), ids=lambda p: "|".join(p))
def test_stream_gets_a_thinking_block_then_text_in_vllms_order(pieces: list[str]) -> None:
    assert summary(reshape(raw_stream(TEXT, pieces), opts())) == [
        "message_start",
        (0, "thinking", "abc def", True),
        (1, "text", "hello world", False),
        "message_delta",
        "message_stop",
    ]


def test_stream_deltas_keep_the_workers_pieces() -> None:
    """No text is held back but a possible tag: each piece goes out with its own event."""
    pieces = ["<think>", "abc", " def", "</think>", "hello", " world"]
    deltas = [o["delta"] for k, o in reshape(raw_stream(TEXT, pieces), opts())
              if k == "content_block_delta"]  # fmt: skip
    texts = [d.get("thinking") or d.get("text") for d in deltas if "signature" not in d]
    assert texts == ["abc", " def", "hello", " world"]


def test_stream_all_reasoning_then_a_tool_use_block_moves_up_one() -> None:
    events = reshape(raw_stream("<think>abc", ["<th", "ink>a", "bc"], tool=True), opts())
    assert summary(events) == [
        "message_start",
        (0, "thinking", "abc", True),
        (1, "tool_use", "{}", False),
        "message_delta",
        "message_stop",
    ]


def test_stream_with_thinking_off_is_text_only() -> None:
    o = opts(chat_template_kwargs={"enable_thinking": False})
    events = reshape(raw_stream("\n\nhi", ["\n", "\nh", "i"]), o)
    assert summary(events) == ["message_start", (0, "text", "\n\nhi", False),
                               "message_delta", "message_stop"]  # fmt: skip


def test_stream_of_a_worker_that_splits_passes_untouched() -> None:
    events = [("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": {"type": "thinking", "thinking": ""}}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                       "delta": {"type": "thinking_delta",
                                                 "thinking": "<think>"}})]  # fmt: skip
    t = MessagesStreamTransformer(opts())
    assert [e for event in events for e in t.feed(*event)] == events


def test_stream_cut_inside_the_text_block_is_closed_by_finish() -> None:
    events = raw_stream(TEXT[:12], [TEXT[:12]])[:3]  # the start, the block, "<think>abc d"
    assert summary(reshape(events, opts())) == ["message_start", (0, "thinking", "abc d", True)]


# ---- the request ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("thinking", "kwargs", "expected"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, None, {"enable_thinking": True}),
        ({"type": "disabled"}, None, {"enable_thinking": False}),
        ({"type": "disabled"}, {"x": 1}, {"x": 1, "enable_thinking": False}),
        ({"type": "disabled"}, {"enable_thinking": True}, {"enable_thinking": True}),  # theirs
        ({"type": "adaptive"}, None, None),
    ],
)
def test_thinking_maps_to_the_templates_switch(
    thinking: Json, kwargs: Json | None, expected: Json | None
) -> None:
    body: Json = {"thinking": thinking}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    changed = thinking_switch(body, "qwen3")
    assert body.get("chat_template_kwargs") == expected
    assert changed == (expected != kwargs)


def test_a_parser_that_ignores_the_switch_leaves_the_request_alone() -> None:
    body: Json = {"thinking": {"type": "disabled"}}
    assert not thinking_switch(body, "deepseek_r1") and "chat_template_kwargs" not in body


def test_the_budget_a_worker_cannot_honour_is_refused_in_plain_words() -> None:
    vllm = (b'{"type":"error","error":{"type":"BadRequestError","message":"thinking_token_budget'
            b" is set but reasoning_config is not configured. Please set --reasoning-parser "
            b'and/or --reasoning-config to use thinking_token_budget."}}')  # fmt: skip
    out = budget_refusal("tiny", vllm)
    assert out is not None
    body = orjson.loads(out)
    assert body["type"] == "error" and body["error"]["type"] == "BadRequestError"
    assert "thinking.budget_tokens cannot be honoured for model `tiny`" in body["error"]["message"]
    assert budget_refusal("tiny", b'{"type":"error","error":{"message":"other"}}') is None
