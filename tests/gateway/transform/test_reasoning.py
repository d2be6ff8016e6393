"""Reasoning parsers: vLLM 0.32 semantics for qwen3 and deepseek_r1, streaming == non-streaming."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.gateway.transform.reasoning import (
    THINK_END,
    THINK_START,
    DeepSeekR1Parser,
    Qwen3Parser,
    ReasoningParser,
    get_parser,
    known_parsers,
)

PARSERS = ["qwen3", "deepseek_r1"]


def stream(parser: ReasoningParser, pieces: list[str]) -> list[tuple[str, str]]:
    out = [parser.feed(p) for p in pieces]
    out.append(parser.finish())
    return out


def joined(deltas: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def qwen3(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    return Qwen3Parser(start_in_reasoning=thinking).split(text)


def r1(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    return DeepSeekR1Parser(start_in_reasoning=thinking).split(text)


# ---- registry ------------------------------------------------------------------------------


def test_registry_names() -> None:
    assert known_parsers() == ["deepseek_r1", "qwen3"]
    assert get_parser("qwen3") is Qwen3Parser
    assert get_parser("deepseek_r1") is DeepSeekR1Parser


def test_unknown_parser_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser `granite`.*deepseek_r1, qwen3"):
        get_parser("granite")


# ---- qwen3, non-streaming ----------------------------------------------------------------


def test_qwen3_splits_at_think_end() -> None:
    assert qwen3("Let me think.</think>\n\nHello") == ("Let me think.", "\n\nHello")


def test_qwen3_swallows_generated_think_start() -> None:
    assert qwen3("<think>\nplan\n</think>\n\nHi") == ("\nplan\n", "\n\nHi")


def test_qwen3_no_think_end_is_all_reasoning() -> None:
    assert qwen3("<think>cut off mid-thou") == ("cut off mid-thou", None)
    assert qwen3("an instruct model's whole answer") == ("an instruct model's whole answer", None)


def test_qwen3_thinking_disabled_is_all_content() -> None:
    assert qwen3("Hello there", thinking=False) == (None, "Hello there")


def test_qwen3_thinking_disabled_drops_stray_think_end() -> None:
    # The CONTENT state absorbs </think> (vLLM's (CONTENT, THINK_END) transition).
    assert qwen3("Hi</think> there", thinking=False) == (None, "Hi there")


def test_qwen3_second_think_end_dropped() -> None:
    assert qwen3("a</think>b</think>c") == ("a", "bc")


def test_qwen3_empty_parts_are_none() -> None:
    assert qwen3("</think>") == (None, None)
    assert qwen3("<think></think>Hi") == (None, "Hi")
    assert qwen3("") == (None, None)


def test_qwen3_keeps_reasoning_newlines() -> None:
    assert qwen3("step 1\n\nstep 2\n\n</think>ok") == ("step 1\n\nstep 2\n\n", "ok")


def test_qwen3_tool_call_ends_reasoning_and_stays_in_content() -> None:
    text = "I should call it.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert qwen3(text) == ("I should call it.\n", text[len("I should call it.\n") :])


def test_qwen3_think_end_inside_tool_call_is_literal() -> None:
    text = "r<tool_call>{'x': '</think>'}</tool_call>after</think>!"
    assert qwen3(text) == ("r", "<tool_call>{'x': '</think>'}</tool_call>after!")


def test_qwen3_whitespace_only_content_kept_non_streaming() -> None:
    assert qwen3("r</think>\n\n") == ("r", "\n\n")


# ---- qwen3, streaming --------------------------------------------------------------------


def test_qwen3_stream_tag_split_across_chunks() -> None:
    deltas = stream(Qwen3Parser(), ["<th", "ink>Let", " me</", "thi", "nk>", "Hi"])
    assert deltas == [("", ""), ("Let", ""), (" me", ""), ("", ""), ("", ""), ("", "Hi"), ("", "")]


def test_qwen3_stream_sends_whitespace_as_it_comes() -> None:
    """vLLM's serving path passes content through token by token once reasoning ended."""
    deltas = stream(Qwen3Parser(), ["r</think>", "\n", "\n", "Hello", " ", "world"])
    assert deltas[:-1] == [("r", ""), ("", "\n"), ("", "\n"), ("", "Hello"), ("", " "),
                           ("", "world")]  # fmt: skip


def test_qwen3_stream_whitespace_in_the_tag_chunk_leaves_with_it() -> None:
    parser = Qwen3Parser()
    assert parser.feed("r</think>\n\n") == ("r", "\n\n")
    assert parser.finish() == ("", "")


def test_qwen3_stream_partial_tag_at_end_is_text() -> None:
    parser = Qwen3Parser()
    assert parser.feed("thinking <th") == ("thinking ", "")
    assert parser.finish() == ("<th", "")


def test_qwen3_stream_lone_angle_bracket_released_when_not_a_tag() -> None:
    parser = Qwen3Parser()
    assert parser.feed("a <") == ("a ", "")
    assert parser.feed(" b") == ("< b", "")


def test_qwen3_stream_tool_call_split_across_chunks() -> None:
    deltas = stream(Qwen3Parser(), ["plan<tool", "_call>\n<function=f>"])
    assert joined(deltas) == ("plan", "<tool_call>\n<function=f>")
    assert deltas[0] == ("plan", "")


# ---- deepseek_r1 -------------------------------------------------------------------------


def test_r1_strips_think_start_and_splits() -> None:
    assert r1("<think>reason</think>answer") == ("reason", "answer")


def test_r1_no_think_end_is_all_reasoning() -> None:
    assert r1("<think>still going") == ("still going", None)
    assert r1("no tags at all") == ("no tags at all", None)


def test_r1_empty_content_is_none() -> None:
    assert r1("<think>reason</think>") == ("reason", None)


def test_r1_ignores_enable_thinking() -> None:
    assert r1("reason</think>answer", thinking=False) == ("reason", "answer")
    assert r1("just text", thinking=False) == ("just text", None)


def test_r1_tags_after_reasoning_are_plain_content() -> None:
    assert r1("a</think>b</think>c<think>d") == ("a", "b</think>c<think>d")


def test_r1_tool_call_is_not_special() -> None:
    assert r1("x<tool_call>y") == ("x<tool_call>y", None)


def test_r1_does_not_hold_whitespace() -> None:
    parser = DeepSeekR1Parser()
    assert parser.feed("r</think>\n\n") == ("r", "\n\n")


def test_r1_stream_split_tags() -> None:
    deltas = stream(DeepSeekR1Parser(), ["<", "think", ">", "ab", "</thi", "nk>", "cd"])
    assert joined(deltas) == ("ab", "cd")
    assert all("<" not in r and "<" not in c for r, c in deltas)


def test_split_does_not_disturb_stream_state() -> None:
    parser = Qwen3Parser()
    parser.feed("abc</think>")
    assert parser.split("x</think>y") == ("x", "y")
    assert parser.feed("z") == ("", "z")


# ---- properties --------------------------------------------------------------------------

FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<",
    "</",
    "th",
    "ink>",
    ">",
    "\n\n",
    " ",
    "a",
    "b",
]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(texts)
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=15))))
    bounds = [0, *cuts, len(text)]
    return text, [text[i:j] for i, j in itertools.pairwise(bounds)]


@settings(max_examples=300, deadline=None)
@given(case=chunked(), name=st.sampled_from(PARSERS), thinking=st.booleans())
def test_stream_concatenates_to_non_stream_split(
    case: tuple[str, list[str]], name: str, thinking: bool
) -> None:
    text, pieces = case
    cls = get_parser(name)
    reasoning, content = cls(start_in_reasoning=thinking).split(text)
    deltas = stream(cls(start_in_reasoning=thinking), pieces)
    assert joined(deltas) == (reasoning or "", content or "")


@settings(max_examples=300, deadline=None)
@given(case=chunked(), name=st.sampled_from(PARSERS), thinking=st.booleans())
def test_reasoning_never_carries_think_tags(
    case: tuple[str, list[str]], name: str, thinking: bool
) -> None:
    """No chunking leaks a tag into reasoning. A tag can only appear there as the split's own
    text: ``<thi<think>nk>`` swallows the real tag and joins its neighbours (see below)."""
    text, pieces = case
    whole, _ = get_parser(name)(start_in_reasoning=thinking).split(text)
    for r, _ in stream(get_parser(name)(start_in_reasoning=thinking), pieces):
        for tag in (THINK_START, THINK_END):
            assert tag not in r or tag in (whole or "")


def test_text_around_a_swallowed_tag_joins_as_vllm_joins_it() -> None:
    """vLLM drops the ``<think>`` token and detokenizes ``<thi`` + ``nk>`` beside each other, so
    the reasoning reads ``<think>`` as text; streamed whole or cut anywhere, gpupool agrees."""
    for name in PARSERS:
        assert get_parser(name)().split("<thi<think>nk>") == ("<think>", None)
        assert joined(stream(get_parser(name)(), ["<thi<think>nk>"])) == ("<think>", "")
        assert joined(stream(get_parser(name)(), ["<th", "i<thi", "nk>nk>"])) == ("<think>", "")


@settings(max_examples=300, deadline=None)
@given(case=chunked(), name=st.sampled_from(PARSERS), thinking=st.booleans())
def test_a_chunk_without_tag_characters_leaves_whole_and_at_once(
    case: tuple[str, list[str]], name: str, thinking: bool
) -> None:
    """Token for token: only text that may be a tag waits for the next chunk."""
    _, pieces = case
    parser = get_parser(name)(start_in_reasoning=thinking)
    for piece in pieces:
        idle = parser._buf == ""
        reasoning, content = parser.feed(piece)
        if idle and "<" not in piece:
            assert reasoning + content == piece


@settings(max_examples=300, deadline=None)
@given(case=chunked(), name=st.sampled_from(PARSERS), thinking=st.booleans())
def test_only_a_possible_tag_is_held_back(
    case: tuple[str, list[str]], name: str, thinking: bool
) -> None:
    _, pieces = case
    parser = get_parser(name)(start_in_reasoning=thinking)
    tags = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    for piece in pieces:
        parser.feed(piece)
        pending = parser._buf
        assert pending == "" or any(t.startswith(pending) and t != pending for t in tags)
