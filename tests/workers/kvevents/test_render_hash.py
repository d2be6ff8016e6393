"""A request's block hashes as vLLM 0.32 (CPU) published them for the tiny dense model.

The expected hashes were recorded from a real worker (``PYTHONHASHSEED=0``, block size 128,
sha256, ``cache_salt`` "abc") answering the chat request below: its ``BlockStored`` event named
these two blocks, and it reported 345 prompt tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest

from gpupool.workers.kvevents.hashing import HashSpec, block_hashes
from gpupool.workers.kvevents.render import NotModelled, PromptRenderer, _raise, _Sandbox

MODELS = Path(os.environ.get("GPUPOOL_TINY_MODELS", Path(__file__).parents[3] / ".models"))
DENSE = MODELS / "qwen3-dense"
LONG = "You are a helpful assistant. " + "lorem ipsum dolor sit amet " * 20
BODY = {"messages": [{"role": "user", "content": LONG}, {"role": "user", "content": "hello there"}]}
VLLM_HASHES = [10210480223173523310, 10103818411789399474]

pytestmark = pytest.mark.skipif(not (DENSE / "tokenizer.json").exists(), reason="no tiny models")


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    return PromptRenderer.load(DENSE)


def test_chat_blocks_hash_as_vllm_published_them(renderer: PromptRenderer) -> None:
    ids = renderer.prompt_ids("/v1/chat/completions", BODY)
    assert len(ids) == 345
    assert block_hashes(ids, HashSpec(128, "sha256", "0"), "abc") == VLLM_HASHES


def test_a_salt_or_seed_changes_every_block(renderer: PromptRenderer) -> None:
    ids = renderer.prompt_ids("/v1/chat/completions", BODY)
    other_salt = block_hashes(ids, HashSpec(128, "sha256", "0"), "abd")
    other_seed = block_hashes(ids, HashSpec(128, "sha256", "1"), "abc")
    assert not set(other_salt) & set(VLLM_HASHES)
    assert not set(other_seed) & set(VLLM_HASHES)


def test_one_text_part_is_its_string(renderer: PromptRenderer) -> None:
    parts = {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                          for m in BODY["messages"]]}  # fmt: skip
    assert renderer.prompt_ids("/v1/chat/completions", parts) == renderer.prompt_ids(
        "/v1/chat/completions", BODY
    )


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "x"}], "tools": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "x", "name": "n"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        # vLLM drops Claude Code's billing header line from system text
        {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\ns"}]},
    ],
)
def test_what_is_not_modelled_says_so(renderer: PromptRenderer, body: dict[str, object]) -> None:
    with pytest.raises(NotModelled):
        renderer.prompt_ids("/v1/chat/completions", body)


def test_completion_prompts(renderer: PromptRenderer) -> None:
    assert renderer.prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    ids = renderer.prompt_ids("/v1/completions", {"prompt": "hello world"})
    assert ids == renderer.tokenizer.encode("hello world").ids
    with pytest.raises(NotModelled):
        renderer.prompt_ids("/v1/completions", {"prompt": ["a", "b"]})
    with pytest.raises(NotModelled):
        renderer.prompt_ids("/v1/responses", {"input": "x"})


@pytest.mark.parametrize(
    "content",
    ["plain words " * 40, "<think>a b</think> then <tool_call>{}</tool_call>" * 20, "", " \n ",
     "<|im_end|>literal<|im_start|>" + "x" * 300],
)  # fmt: skip
def test_segments_encode_as_the_whole_text(renderer: PromptRenderer, content: str) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": t}]}
                for t in ("s" * 300, content, "t" * 300)]  # fmt: skip
    text = renderer._render(messages, True, {})
    assert text is not None
    whole = renderer.tokenizer.encode(text, add_special_tokens=False).ids
    renderer.segments.checks = 0  # no self-check: the runs alone must be right
    assert renderer.segments.encode(text) == whole
    assert renderer.segments.encode(text) == whole  # from the remembered runs


def test_the_dense_template_is_given_content_parts(renderer: PromptRenderer) -> None:
    """Its template loops over a message's content, so vLLM renders it with lists of parts; it
    cannot add a system message's parts to a string (vLLM refuses that request), and there the
    string form is rendered instead."""
    assert renderer.content_format == "openai"
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]}
    text = renderer.tokenizer.decode(renderer.prompt_ids("/v1/chat/completions", body),
                                     skip_special_tokens=False)  # fmt: skip
    assert text == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nx<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template",
    ["{{ messages.pop() }}", "{{ (messages | first).clear() }}", "[{{ messages.__class__ }}]",
     "{% set ns = namespace(t='') %}[{{ ns._Namespace__attrs }}]", "{{ messages[0].keys() }}",
     "[{{ raise_exception.__code__ }}]", "{{ messages[0].role }}{{ messages[0].nothing }}",
     "{% set ns = namespace(t='a') %}{% set ns.t = ns.t + 'b' %}{{ ns.t }}"],
)  # fmt: skip
def test_the_sandbox_answers_as_jinjas(template: str) -> None:
    """Its remembered attribute answers and its plain-dict reads give what Jinja's own
    ImmutableSandboxedEnvironment gives, every time: the same text, or the same refusal."""
    own = _Sandbox().from_string(template)
    jinjas = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(template)
    messages = [{"role": "user", "content": "x"}]

    def render(t: jinja2.Template) -> str:
        try:
            return t.render(messages=messages, raise_exception=_raise)
        except Exception as e:
            return f"raised {type(e).__name__}"

    expected = render(jinjas)
    assert [render(own) for _ in range(2)] == [expected, expected]


def test_dict_reads_are_jinjas() -> None:
    """A message key that is also a dict method resolves as Jinja resolves it (the method)."""
    tok = PromptRenderer.load(DENSE).tokenizer
    own = PromptRenderer(tok, "{{ messages[0].keys is defined }}|{{ messages[0].role }}|"
                              "{{ messages[0].nothing is defined }}", {})  # fmt: skip
    text = own._render([{"role": "user", "content": "x"}], True, {})
    assert text == "True|user|False"
