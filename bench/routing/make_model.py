#!/usr/bin/env python3
"""Make a random-weight model for the routing bench, offline: a config and a tokenizer, no weights.

Run with the vLLM venv's interpreter (it has transformers and tokenizers):

    .venv-vllm/bin/python bench/routing/make_model.py OUT_DIR [--hidden 256 --layers 4 ...]

vLLM serves it with ``--load-format dummy`` (random weights made at load), so the size is only a
config: on the 2-core CPU box a small one gives a prefill of hundreds of ms for a 2K-token prompt;
on a GPU machine pass bigger numbers. The tokenizer is the one of ``scripts/make_tiny_models.py``
(deterministic, built here from a fixed seed), so the bench's prompts tokenize the same everywhere.
Idempotent: an OUT_DIR whose stamp matches the arguments is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".routing-model-stamp"
# Plain ChatML. vLLM hands a template that reads content parts every message's content as a
# list, so each role (system included) joins its text parts here.
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.content is string %}{%- set c = m.content %}"
    "{%- else %}{%- set c = namespace(t='') %}"
    "{%- for p in m.content %}{%- if p.type == 'text' %}{%- set c.t = c.t + p.text %}{%- endif %}"
    "{%- endfor %}{%- set c = c.t %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64, help="64: the CPU attention kernel's")
    p.add_argument("--max-positions", type=int, default=32768)
    return p.parse_args(argv)


def build(args: argparse.Namespace, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_models import build_tokenizer
    from transformers import GenerationConfig, Qwen3Config

    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )
    cfg.save_pretrained(tmp)
    GenerationConfig(
        eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    ).save_pretrained(tmp)
    tok.save_pretrained(tmp)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out: Path = args.out_dir.resolve()
    want = json.dumps({k: v for k, v in vars(args).items() if k != "out_dir"}, sort_keys=True)
    want += "\n" + CHAT_TEMPLATE
    if (out / STAMP).is_file() and (out / STAMP).read_text() == want:
        print(f"make_model: {out} is up to date")
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        build(args, tmp)
        (tmp / STAMP).write_text(want)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"make_model: {out} ({want})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
