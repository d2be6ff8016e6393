#!/usr/bin/env python3
"""Make tiny random-weight models that a real (CPU) vLLM can serve, fully offline.

Run with the vLLM venv's interpreter (it has torch, transformers and tokenizers):

    .venv-vllm/bin/python scripts/make_tiny_models.py OUT_DIR [--force]

Creates
    OUT_DIR/qwen3-dense/         Qwen3ForCausalLM  (2 layers, hidden 128, head_dim 64), bf16
    OUT_DIR/qwen3-next-hybrid/   Qwen3NextForCausalLM (3x linear_attention [Gated DeltaNet]
                                 + 1x full_attention, MoE 8 experts / 2 per token), bf16
each with the same byte-level BPE tokenizer (~2000 tokens) and a Qwen3-like ChatML chat
template that honours `enable_thinking`.

Properties:
  * offline: the tokenizer is trained on text generated here from a fixed seed;
  * deterministic: same script version -> same tokenizer and same weights;
  * idempotent: a model dir is skipped when its config.json exists and its stamp file holds
    this script's VERSION (bump VERSION whenever the output would change);
  * atomic: each model is built in a temporary sibling dir and renamed into place.

Tokenizer details that matter for tests (see docs/real-vllm-notes.md):
  * special tokens: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos);
  * <think>, </think>, <tool_call>, </tool_call> are added tokens but NOT special, so vLLM's
    default skip_special_tokens=true keeps them in the output text (as Qwen's tokenizers do).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

VERSION = "2"
STAMP_NAME = ".tiny-model-stamp"
SEED = 1234
VOCAB_SIZE = 2000  # BPE trainer target (includes the 3 special tokens); +4 added tokens

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Qwen3-style ChatML template (simplified): system/user/assistant/tool roles, optional tools
# block, assistant tool_calls rendered as <tool_call>{json}</tool_call>, reasoning of past
# assistant turns dropped, and `enable_thinking=false` -> empty think block in the prompt.
CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.content is string %}{%- set content = message.content %}
{%- elif message.content is none or message.content is undefined %}{%- set content = '' %}
{%- else %}{%- set content = namespace(t='') %}{%- for part in message.content %}{%- if part.type == 'text' %}{%- set content.t = content.t + part.text %}{%- endif %}{%- endfor %}{%- set content = content.t %}
{%- endif %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}
{{- '<|im_start|>assistant\n' + content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first and content %}{{- '\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

_WORDS = [
    "the",
    "be",
    "to",
    "of",
    "and",
    "a",
    "in",
    "that",
    "have",
    "I",
    "it",
    "for",
    "not",
    "on",
    "with",
    "he",
    "as",
    "you",
    "do",
    "at",
    "this",
    "but",
    "his",
    "by",
    "from",
    "they",
    "we",
    "say",
    "her",
    "she",
    "or",
    "an",
    "will",
    "my",
    "one",
    "all",
    "would",
    "there",
    "their",
    "what",
    "so",
    "up",
    "out",
    "if",
    "about",
    "who",
    "get",
    "which",
    "go",
    "me",
    "when",
    "make",
    "can",
    "like",
    "time",
    "no",
    "just",
    "him",
    "know",
    "take",
    "people",
    "into",
    "year",
    "your",
    "good",
    "some",
    "could",
    "them",
    "see",
    "other",
    "than",
    "then",
    "now",
    "look",
    "only",
    "come",
    "its",
    "over",
    "think",
    "also",
    "back",
    "after",
    "use",
    "two",
    "how",
    "our",
    "work",
    "first",
    "well",
    "way",
    "even",
    "new",
    "want",
    "because",
    "any",
    "these",
    "give",
    "day",
    "most",
    "us",
    "is",
    "are",
    "was",
    "were",
    "been",
    "has",
    "had",
    "did",
    "said",
    "made",
    "hello",
    "world",
    "model",
    "token",
    "request",
    "response",
    "stream",
    "server",
    "worker",
    "gateway",
    "pool",
    "queue",
    "cache",
    "prefix",
    "health",
    "metrics",
    "error",
    "message",
    "content",
    "role",
    "system",
    "user",
    "assistant",
    "tool",
    "function",
    "name",
    "arguments",
    "value",
    "answer",
    "question",
    "reason",
    "think",
    "step",
    "first",
    "second",
    "final",
    "result",
    "number",
    "list",
    "string",
    "object",
    "true",
    "false",
    "null",
    "weather",
    "city",
    "today",
    "tomorrow",
    "price",
    "total",
    "count",
    "ok",
    "yes",
    "please",
    "thank",
    "sorry",
    "test",
    "data",
    "file",
    "line",
    "code",
    "python",
    "json",
    "http",
    "status",
    "ready",
    "running",
    "waiting",
    "abc",
    "def",
    "ghi",
    "xyz",
    "foo",
    "bar",
    "baz",
    "qux",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "red",
    "green",
    "blue",
    "small",
    "large",
    "fast",
    "slow",
]

_SNIPPETS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"role": "user", "content": "hello"}',
    "def f(x):\n    return x + 1\n",
    "for i in range(10):\n    print(i)\n",
    "x = [1, 2, 3]; y = {'a': 1, 'b': 2}\n",
    "<think>\nLet me think step by step.\n</think>\n\nThe answer is 42.",
    '<tool_call>\n{"name": "lookup", "arguments": {"q": "abc"}}\n</tool_call>',
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14 -7 1e-6",
    "Punctuation: . , ; : ! ? ' \" ( ) [ ] { } < > / \\ | - _ + = * & ^ % $ # @ ~ `",
    "Ünïcödé: café naïve Straße 東京 你好 😀 — “quotes” ‘single’ …",
]


_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "na",
    "mu",
    "se",
    "lo",
    "vi",
    "pe",
    "dra",
    "ston",
    "quel",
    "min",
    "ber",
    "tor",
    "ash",
    "eng",
    "ol",
    "un",
    "ex",
    "pro",
    "con",
    "ter",
    "ment",
    "ing",
    "tion",
    "al",
    "er",
    "ous",
    "ive",
    "ly",
    "ness",
    "able",
    "ch",
    "th",
    "sh",
    "str",
    "pl",
    "gr",
]


def training_corpus(seed: int = SEED, n_lines: int = 12000) -> list[str]:
    """Deterministic pseudo-English + code/JSON/ChatML text (no files, no network)."""
    rng = random.Random(seed)
    pseudo = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(1500)
    ]
    vocab = _WORDS * 4 + pseudo
    lines: list[str] = []
    for _i in range(n_lines):
        kind = rng.random()
        if kind < 0.08:
            lines.append(rng.choice(_SNIPPETS))
            continue
        n = rng.randint(4, 18)
        words = [rng.choice(vocab) for _ in range(n)]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 9999)))
        sep = rng.choice([" ", " ", " ", ", ", " - "])
        end = rng.choice([".", ".", "?", "!", ":", ""])
        lines.append(sep.join(words) + end)
    return lines


def build_tokenizer():
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NON_SPECIAL_ADDED])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    return hf


def _save_common(model, tokenizer, out: Path):
    import torch
    from transformers import GenerationConfig

    eos = [
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def make_qwen3_dense(tokenizer, out: Path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # head_dim 16 is rejected by the CPU attention kernel
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(cfg)
    _save_common(model, tokenizer, out)


def make_qwen3_next_hybrid(tokenizer, out: Path):
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # The CPU GDN kernel rejects head dim 32 at the first request ("Unexpected head dim
        # size, 32"); 64 works. With these dims the mamba state (~67 KB/layer) exceeds one
        # 128-token attention page (32 KB), so vLLM raises the attention block size to 384
        # ("Setting attention block size to 384 tokens ..."), like real Qwen3-Next/3.5.
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        partial_rotary_factor=0.25,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = Qwen3NextForCausalLM(cfg)
    _save_common(model, tokenizer, out)


MODELS = {
    "qwen3-dense": make_qwen3_dense,
    "qwen3-next-hybrid": make_qwen3_next_hybrid,
}


def stamp_ok(d: Path) -> bool:
    try:
        return (d / "config.json").is_file() and (d / STAMP_NAME).read_text().strip() == VERSION
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true", help="rebuild even if stamps match")
    args = ap.parse_args(argv)
    out_dir: Path = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    todo = [n for n in MODELS if args.force or not stamp_ok(out_dir / n)]
    if not todo:
        print(f"make_tiny_models: all models up to date in {out_dir} (version {VERSION})")
        return 0

    t0 = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    t_tok = time.monotonic() - t0
    print(f"make_tiny_models: tokenizer: {len(tokenizer)} tokens ({t_tok:.1f}s)")

    for name in todo:
        t1 = time.monotonic()
        final = out_dir / name
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_dir))
        try:
            MODELS[name](tokenizer, tmp)
            (tmp / STAMP_NAME).write_text(VERSION + "\n")
            os.chmod(tmp, 0o755)
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
        print(f"make_tiny_models: {final} ({size / 1e6:.2f} MB, {time.monotonic() - t1:.1f}s)")
    print(f"make_tiny_models: done in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
