"""Chat response transforms (non-streaming and streaming), request normalisation, SSE framing."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.config.models import ModelConfig, ReasoningField, ReasoningParser
from gpupool.gateway.transform.chat import (
    ChatStreamTransformer,
    TransformOptions,
    chat_reasoning_texts,
    normalize_request_messages,
    transform_chat_response,
)
from gpupool.gateway.transform.sse import EventBuffer, frame, frame_comment, is_comment

Json = dict[str, Any]

QWEN = TransformOptions(parser="qwen3")
R1 = TransformOptions(parser="deepseek_r1")


def model(**kw: Any) -> ModelConfig:
    return ModelConfig(name="m", **kw)


def completion(*messages: Json, usage: Json | None = None) -> Json:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", **m},
            "logprobs": None,
            "finish_reason": "stop",
        }
        for i, m in enumerate(messages)
    ]
    body: Json = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def chunk(index: int = 0, finish: str | None = None, **delta: Any) -> Json:
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


def usage_chunk(**usage: Any) -> Json:
    totals = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return {**head, "choices": [], "usage": {**totals, **usage}}


def run(t: ChatStreamTransformer, chunks: list[Json]) -> list[Json]:
    out = [o for c in chunks for o in t.feed(c)]
    return out + t.finish()


def collect(chunks: list[Json], key: str = "reasoning") -> dict[int, tuple[str, str]]:
    acc: dict[int, tuple[str, str]] = {}
    for c in chunks:
        for ch in c["choices"]:
            r, t = acc.get(ch["index"], ("", ""))
            acc[ch["index"]] = (
                r + ch["delta"].get(key, ""),
                t + (ch["delta"].get("content") or ""),
            )
    return acc


# ---- TransformOptions ----------------------------------------------------------------------


def test_options_without_parser() -> None:
    opts = TransformOptions.from_request(model(), {})
    assert opts.parser is None
    assert opts.start_in_reasoning and opts.include_reasoning and opts.enable_thinking
    assert not opts.needs_transform


def test_options_qwen3_thinking_disabled() -> None:
    cfg = model(reasoning=ReasoningParser.qwen3)
    body = {"chat_template_kwargs": {"enable_thinking": False}}
    opts = TransformOptions.from_request(cfg, body)
    assert opts.parser == "qwen3"
    assert opts.enable_thinking is False and opts.start_in_reasoning is False
    assert opts.needs_transform


@pytest.mark.parametrize(
    ("body", "thinking"),
    [
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, True),
        ({"chat_template_kwargs": {"enable_thinking": None}, "reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": "not a dict"}, True),
        ({}, True),
    ],
)
def test_options_enable_thinking_rules(body: Json, thinking: bool) -> None:
    opts = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), body)
    assert opts.enable_thinking is thinking
    assert opts.start_in_reasoning is thinking


def test_options_template_defaults_are_overridden_by_request() -> None:
    cfg = model(reasoning=ReasoningParser.qwen3)
    defaults = {"enable_thinking": False}
    assert not TransformOptions.from_request(cfg, {}, template_defaults=defaults).enable_thinking
    body = {"chat_template_kwargs": {"enable_thinking": True}}
    assert TransformOptions.from_request(cfg, body, template_defaults=defaults).enable_thinking


def test_options_deepseek_always_starts_in_reasoning() -> None:
    cfg = model(reasoning=ReasoningParser.deepseek_r1)
    opts = TransformOptions.from_request(cfg, {"chat_template_kwargs": {"enable_thinking": False}})
    assert opts.enable_thinking is False and opts.start_in_reasoning is True


def test_options_field_and_include_reasoning() -> None:
    cfg = model(reasoning_field=ReasoningField.both)
    opts = TransformOptions.from_request(cfg, {"include_reasoning": False})
    assert opts.keys == ("reasoning", "reasoning_content")
    assert opts.include_reasoning is False and opts.needs_transform
    assert TransformOptions.from_request(cfg, {"include_reasoning": "no"}).include_reasoning


def test_options_unknown_parser_name() -> None:
    with pytest.raises(ValueError, match="known: deepseek_r1, qwen3"):
        TransformOptions(parser="nope")


# ---- non-streaming -----------------------------------------------------------------------


def test_split_qwen3_content() -> None:
    body = completion({"content": "<think>plan</think>\n\nHi", "reasoning": None})
    msg = transform_chat_response(body, QWEN)["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "\n\nHi", "reasoning": "plan"}


def test_split_truncated_thought_is_all_reasoning() -> None:
    body = completion({"content": "still thinking"})
    msg = transform_chat_response(body, QWEN)["choices"][0]["message"]
    assert msg["reasoning"] == "still thinking" and msg["content"] is None


def test_split_thinking_disabled_leaves_content() -> None:
    opts = TransformOptions(parser="qwen3", enable_thinking=False, start_in_reasoning=False)
    msg = transform_chat_response(completion({"content": "Hi"}), opts)["choices"][0]["message"]
    assert msg["content"] == "Hi" and msg["reasoning"] is None


def test_split_deepseek() -> None:
    msg = transform_chat_response(completion({"content": "<think>r</think>"}), R1)["choices"][0]
    assert msg["message"]["reasoning"] == "r" and msg["message"]["content"] is None


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        (ReasoningField.reasoning, {"reasoning": "r"}),
        (ReasoningField.reasoning_content, {"reasoning_content": "r"}),
        (ReasoningField.both, {"reasoning": "r", "reasoning_content": "r"}),
    ],
)
@pytest.mark.parametrize("worker_key", ["reasoning", "reasoning_content"])
def test_worker_split_is_renamed(field: ReasoningField, expected: Json, worker_key: str) -> None:
    body = completion({"content": "<think>kept</think>", worker_key: "r"})
    msg = transform_chat_response(body, TransformOptions(parser="qwen3", field=field))
    assert msg["choices"][0]["message"] == {
        "role": "assistant",
        "content": "<think>kept</think>",
        **expected,
    }


def test_include_reasoning_false_removes_it() -> None:
    opts = TransformOptions(parser="qwen3", include_reasoning=False)
    msg = transform_chat_response(completion({"content": "r</think>c"}), opts)["choices"][0]
    assert msg["message"]["reasoning"] is None and msg["message"]["content"] == "c"
    body = completion({"content": "c", "reasoning": "r"})
    assert transform_chat_response(body, opts)["choices"][0]["message"]["reasoning"] is None


def test_n2_choices_split_independently() -> None:
    body = completion({"content": "a</think>A"}, {"content": "b"})
    choices = transform_chat_response(body, QWEN)["choices"]
    assert [(c["message"]["reasoning"], c["message"]["content"]) for c in choices] == [
        ("a", "A"),
        ("b", None),
    ]


def test_structured_tool_calls_pass_through() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    body = completion({"content": "r</think>\n\n", "tool_calls": calls})
    msg = transform_chat_response(body, QWEN)["choices"][0]["message"]
    assert msg["tool_calls"] is calls
    assert msg["reasoning"] == "r"


def test_unchanged_body_is_returned_as_is() -> None:
    body = completion({"content": "Hi", "reasoning": "r"})
    assert transform_chat_response(body, TransformOptions()) is body
    plain = completion({"content": "Hi"})
    assert transform_chat_response(plain, TransformOptions()) is plain
    assert transform_chat_response({"error": {"message": "x"}}, QWEN) == {"error": {"message": "x"}}


def test_input_is_not_mutated() -> None:
    body = completion({"content": "a</think>b"}, usage={"completion_tokens": 5})
    before = copy.deepcopy(body)
    transform_chat_response(body, TransformOptions(parser="qwen3", count_tokens=len))
    assert body == before


def test_reasoning_tokens_left_alone_without_counter() -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 5, "completion_tokens_details": None}
    out = transform_chat_response(completion({"content": "a</think>b"}, usage=usage), QWEN)
    assert out["usage"] is usage


def test_reasoning_tokens_counted_over_all_choices() -> None:
    usage = {"completion_tokens": 9, "completion_tokens_details": None}
    body = completion({"content": "abc</think>x"}, {"content": "de</think>y"}, usage=usage)
    out = transform_chat_response(body, TransformOptions(parser="qwen3", count_tokens=len))
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert out["usage"]["completion_tokens"] == 9


def test_worker_reasoning_tokens_are_kept() -> None:
    usage = {"completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 7}}
    body = completion({"content": "x", "reasoning": "abc"}, usage=usage)
    out = transform_chat_response(body, TransformOptions(count_tokens=len))
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 7


# ---- streaming ---------------------------------------------------------------------------


def test_stream_role_tool_and_usage_chunks_pass_through_identical() -> None:
    t = ChatStreamTransformer(QWEN)
    role = chunk(role="assistant", content="")
    tool = chunk(tool_calls=[{"index": 0, "function": {"arguments": "{"}}])
    usage = usage_chunk()
    err = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
    for c in (role, tool, usage, err):
        assert t.feed(c)[-1] is c


def test_stream_splits_with_tags_across_chunks() -> None:
    t = ChatStreamTransformer(QWEN)
    chunks = [chunk(role="assistant", content="")] + [
        chunk(content=p) for p in ["<th", "ink>Let", " me</th", "ink>", "\n\n", "Hi"]
    ]
    out = run(t, [*chunks, chunk(finish="stop")])
    deltas = [c["choices"][0]["delta"] for c in out]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"reasoning": "Let"},
        {"reasoning": " me"},
        {"content": "\n\n"},
        {"content": "Hi"},
        {},
    ]
    assert out[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_length_mid_thought_ends_as_reasoning() -> None:
    t = ChatStreamTransformer(QWEN)
    out = run(t, [chunk(content="so <"), chunk(finish="length", content="/thi")])
    assert [c["choices"][0]["delta"] for c in out] == [{"reasoning": "so "}, {"reasoning": "</thi"}]
    assert out[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_finish_flushes_when_upstream_never_finished() -> None:
    t = ChatStreamTransformer(QWEN)
    assert t.feed(chunk(content="r</think")) == [chunk(reasoning="r")]
    tail = t.finish()
    assert len(tail) == 1
    assert tail[0]["choices"] == [
        {"index": 0, "delta": {"reasoning": "</think"}, "logprobs": None, "finish_reason": None}
    ]
    assert tail[0]["id"] == "c1" and tail[0]["model"] == "m"
    assert t.finish() == []


def test_stream_held_text_goes_before_usage_chunk() -> None:
    t = ChatStreamTransformer(QWEN)
    t.feed(chunk(content="thinking <th"))
    usage = usage_chunk()
    out = t.feed(usage)
    assert next(c["choices"] for c in out)[0]["delta"] == {"reasoning": "<th"}
    assert out[-1] is usage
    assert t.finish() == []


@pytest.mark.parametrize("worker_key", ["reasoning", "reasoning_content"])
def test_stream_renames_worker_reasoning(worker_key: str) -> None:
    t = ChatStreamTransformer(TransformOptions(field=ReasoningField.both))
    delta: dict[str, Any] = {worker_key: "r"}
    out = t.feed(chunk(0, None, **delta))
    assert out[0]["choices"][0]["delta"] == {"reasoning": "r", "reasoning_content": "r"}
    same = chunk(content="c")
    assert t.feed(same)[0] is same


def test_stream_worker_split_is_not_split_again() -> None:
    t = ChatStreamTransformer(QWEN)
    out = run(t, [chunk(reasoning="r"), chunk(content="answer"), chunk(finish="stop")])
    assert collect(out) == {0: ("r", "answer")}


def test_stream_include_reasoning_false_drops_reasoning_chunks() -> None:
    t = ChatStreamTransformer(TransformOptions(parser="qwen3", include_reasoning=False))
    out = run(t, [chunk(content="abc"), chunk(content="</think>x"), chunk(finish="stop")])
    assert [c["choices"][0]["delta"] for c in out] == [{"content": "x"}, {}]
    t2 = ChatStreamTransformer(TransformOptions(include_reasoning=False))
    assert t2.feed(chunk(reasoning="r")) == []


def test_stream_keeps_logprobs_of_held_back_text() -> None:
    t = ChatStreamTransformer(QWEN)
    c = chunk(content="<th")
    c["choices"][0]["logprobs"] = {"content": [{"token": "<th", "logprob": -0.1}]}
    out = t.feed(c)
    assert out[0]["choices"][0]["delta"] == {}
    assert out[0]["choices"][0]["logprobs"] == c["choices"][0]["logprobs"]


def test_stream_tool_call_delta_with_held_content() -> None:
    t = ChatStreamTransformer(QWEN)
    calls = [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]
    out = t.feed(chunk(content="r<", tool_calls=calls))
    assert out[0]["choices"][0]["delta"] == {"tool_calls": calls, "reasoning": "r"}
    assert out[0]["choices"][0]["delta"]["tool_calls"] is calls


def test_stream_n2_interleaved() -> None:
    t = ChatStreamTransformer(QWEN)
    chunks = [
        chunk(0, content="a<"),
        chunk(1, content="b</th"),
        chunk(0, content="/think>A"),
        chunk(1, content="ink>B"),
        chunk(0, finish="stop"),
        chunk(1, finish="stop"),
    ]
    assert collect(run(t, chunks)) == {0: ("a", "A"), 1: ("b", "B")}


def test_stream_reasoning_tokens_on_final_usage() -> None:
    t = ChatStreamTransformer(TransformOptions(parser="qwen3", count_tokens=len))
    out = run(t, [chunk(content="abcd</think>x"), chunk(1, content="ef"), usage_chunk()])
    assert out[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 6}
    worker = usage_chunk(completion_tokens_details={"reasoning_tokens": 3})
    t2 = ChatStreamTransformer(TransformOptions(parser="qwen3", count_tokens=len))
    t2.feed(chunk(content="abcd"))
    assert t2.feed(worker)[-1] is worker


# ---- streaming agrees with non-streaming ---------------------------------------------------

FRAGMENTS = ["<think>", "</think>", "<tool_call>", "<", "</", "th", "ink>", "\n\n", " ", "a", "b"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=25).map("".join)


@st.composite
def pieces_of(draw: st.DrawFn, text: str) -> list[str]:
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=10))))
    bounds = [0, *cuts, len(text)]
    return [text[i:j] for i, j in itertools.pairwise(bounds)]


@st.composite
def upstream(draw: st.DrawFn, n: int) -> tuple[list[str], list[Json]]:
    """n texts, and a stream of chunks for them, interleaved across choices in order."""
    texts_ = [draw(texts) for _ in range(n)]
    per_choice: list[list[Json]] = []
    for i, text in enumerate(texts_):
        parts = draw(pieces_of(text))
        seq = [chunk(i, role="assistant", content="")]
        seq += [chunk(i, content=p) for p in parts[:-1]]
        last_with_finish = draw(st.booleans())
        seq.append(
            chunk(i, "stop", content=parts[-1]) if last_with_finish else chunk(i, content=parts[-1])
        )
        if not last_with_finish:
            seq.append(chunk(i, "stop"))
        per_choice.append(seq)
    order = draw(st.permutations([i for i, seq in enumerate(per_choice) for _ in seq]))
    cursors = [0] * n
    stream: list[Json] = []
    for i in order:
        stream.append(per_choice[i][cursors[i]])
        cursors[i] += 1
    stream.append(usage_chunk())
    return texts_, stream


OPTIONS = [
    TransformOptions(parser="qwen3"),
    TransformOptions(parser="qwen3", enable_thinking=False, start_in_reasoning=False),
    TransformOptions(parser="deepseek_r1"),
    TransformOptions(parser="qwen3", field=ReasoningField.reasoning_content),
]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.sampled_from([1, 2]), opts=st.sampled_from(OPTIONS))
def test_stream_agrees_with_non_stream(data: st.DataObject, n: int, opts: TransformOptions) -> None:
    texts_, stream = data.draw(upstream(n))
    key = opts.keys[0]
    whole = transform_chat_response(completion(*({"content": t} for t in texts_)), opts)
    expected = {
        c["index"]: (c["message"][key] or "", c["message"]["content"] or "")
        for c in whole["choices"]
    }
    out = run(ChatStreamTransformer(opts), stream)
    got = collect(out, key)
    assert {i: got.get(i, ("", "")) for i in range(n)} == expected
    assert out[-1]["usage"]  # the usage chunk is last
    finishes = [ch["index"] for c in out for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == list(range(n))
    done: set[int] = set()
    for c in out:
        for ch in c["choices"]:
            assert ch["index"] not in done, "text for a choice after its finish_reason"
            if ch["finish_reason"]:
                done.add(ch["index"])
    for c in out[:-1]:
        for ch in c["choices"]:
            assert ch["delta"] or ch["finish_reason"], ch  # nothing empty but the finish chunk
            assert set(ch["delta"]) <= {"role", "content", key}


# ---- request side ------------------------------------------------------------------------


def test_normalize_renames_reasoning_content_in_place() -> None:
    user = {"role": "user", "content": "q"}
    body: Json = {
        "messages": [user, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    }
    assert normalize_request_messages(body) is body
    assert body["messages"][1] == {"role": "assistant", "content": "a", "reasoning": "r"}
    assert body["messages"][0] is user and user == {"role": "user", "content": "q"}


def test_normalize_to_old_worker_name() -> None:
    body: Json = {"messages": [{"role": "assistant", "content": "a", "reasoning": "r"}]}
    normalize_request_messages(body, worker_field="reasoning_content")
    assert body["messages"][0] == {"role": "assistant", "content": "a", "reasoning_content": "r"}


def test_normalize_prefers_new_name_and_drops_nulls() -> None:
    body: Json = {
        "messages": [
            {"role": "assistant", "reasoning": "new", "reasoning_content": "old"},
            {"role": "assistant", "reasoning": None, "reasoning_content": "old"},
            {"role": "assistant", "reasoning_content": None},
        ]
    }
    normalize_request_messages(body)
    assert body["messages"] == [
        {"role": "assistant", "reasoning": "new"},
        {"role": "assistant", "reasoning": "old"},
        {"role": "assistant"},
    ]


def test_normalize_hostile_shapes_and_bad_field() -> None:
    for body in ({"messages": "not a list"}, {"messages": [1, None, "x"]}, {}):
        assert normalize_request_messages(body) == body
    with pytest.raises(ValueError, match="worker_field"):
        normalize_request_messages({}, worker_field="thoughts")


# ---- SSE framing -------------------------------------------------------------------------


def test_events_basic_and_comments() -> None:
    buf = EventBuffer()
    data = b': keep-alive\n\ndata: {"a":1}\n\ndata: [DONE]\n\ndata: {"b"'
    items = buf.events(data)
    assert items == [b": keep-alive", b'{"a":1}', b"[DONE]"]
    assert [is_comment(i) for i in items] == [True, False, False]
    assert buf.tail() == b'data: {"b"'
    assert buf.events(b":2}\n\n") == [b'{"b":2}']
    assert buf.tail() == b"" and len(buf) == 0


def test_events_crlf_multiline_and_other_fields() -> None:
    buf = EventBuffer()
    assert buf.events(b"event: x\r\ndata: a\r\ndata:b\r") == []
    assert buf.events(b"\n\r\n") == [b"a\nb"]
    assert buf.events(b"id: 3\n\n\n\ndata: c\n\n") == [b"c"]


def test_frame() -> None:
    assert frame({"a": "é"}) == b'data: {"a":"\xc3\xa9"}\n\n'
    assert frame_comment(b": keep-alive") == b": keep-alive\n\n"


@settings(max_examples=300, deadline=None)
@given(
    objs=st.lists(
        st.dictionaries(st.text(max_size=3), st.text(max_size=5), max_size=3), max_size=5
    ),
    cuts=st.lists(st.integers(0, 400), max_size=10),
    crlf=st.booleans(),
)
def test_events_any_read_boundaries(objs: list[Json], cuts: list[int], crlf: bool) -> None:
    raw = b": ping\n\n" + b"".join(frame(o) for o in objs) + b"data: [DONE]\n\n"
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    bounds = [0, *sorted({c for c in cuts if c <= len(raw)}), len(raw)]
    buf = EventBuffer()
    items = [i for a, b in itertools.pairwise(bounds) for i in buf.events(raw[a:b])]
    assert items[0] == b": ping" and items[-1] == b"[DONE]"
    assert [orjson.loads(i) for i in items[1:-1]] == objs
    assert len(buf) == 0


# ---- grammar and worker-side parsers (issue 12) --------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": {"regex": "a+"}},
        {"structured_outputs": {"json": {"type": "object"}}},
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["a", "b"]},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},  # Responses
    ],
)
def test_grammar_request_is_not_split(extra: Json) -> None:
    opts = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), extra)
    assert opts.parser is None
    body = completion({"content": '{"a": 1}', "reasoning": None})
    assert transform_chat_response(body, opts)["choices"][0]["message"]["content"] == '{"a": 1}'


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"response_format": {"type": "text"}},
        {"response_format": None},
        {"structured_outputs": {"disable_any_whitespace": True}},
        {"text": {"format": {"type": "text"}}},
        {"structured_outputs": {"regex": "<think>abc</think>hi"}},  # it writes the tags itself
        {"guided_choice": ["a</think>b", "c</think>d"]},
    ],
)
def test_no_grammar_keeps_the_split(extra: Json) -> None:
    opts = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), extra)
    assert opts.parser == "qwen3"


def test_worker_with_parser_is_never_split_again() -> None:
    base = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), {})
    opts = base.for_worker("qwen3")
    assert opts.parser is None and not opts.needs_transform
    assert base.for_worker(None) is base
    same = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), {},
                                         worker_parser="qwen3")  # fmt: skip
    assert same.parser is None
    # the worker split nothing out (thinking off): its content stays content
    t = ChatStreamTransformer(opts)
    c = chunk(content="plain answer")
    assert t.feed(c) == [c]


def test_reasoning_texts_counted_whatever_include_reasoning_drops() -> None:
    opts = TransformOptions(parser="qwen3", include_reasoning=False)
    body = completion({"content": "r1</think>a"}, {"content": "no end"})
    assert chat_reasoning_texts(body, opts) == ["r1", "no end"]
    out = transform_chat_response(body, opts)
    assert [c["message"]["reasoning"] for c in out["choices"]] == [None, None]
    worker_split = completion({"content": "a", "reasoning": "r"})
    assert chat_reasoning_texts(worker_split, TransformOptions()) == ["r"]


def test_grammar_answer_reports_zero_reasoning_tokens_as_vllm() -> None:
    grammar = {"response_format": {"type": "json_object"}}
    opts = TransformOptions.from_request(model(reasoning=ReasoningParser.qwen3), grammar)
    assert opts.needs_transform and opts.zero_reasoning_tokens
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
             "completion_tokens_details": None}  # fmt: skip
    body = transform_chat_response(completion({"content": "{}"}, usage=usage), opts)
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert body["choices"][0]["message"]["content"] == "{}"
    t = ChatStreamTransformer(opts)
    assert t.feed(chunk(content="{")) == [chunk(content="{")]
    final = t.feed(usage_chunk())[-1]
    assert final["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert not opts.for_worker("qwen3").needs_transform


def test_stream_empty_content_delta_is_not_sent_when_splitting() -> None:
    """vLLM's parser sends nothing for a token that decodes to no text yet."""
    t = ChatStreamTransformer(QWEN)
    role = chunk(role="assistant", content="")
    assert t.feed(role) == [role]
    assert t.feed(chunk(content="")) == []
    assert t.feed(chunk(content="r"))[0]["choices"][0]["delta"] == {"reasoning": "r"}
