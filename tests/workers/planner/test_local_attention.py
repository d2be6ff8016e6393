"""Layers that keep fewer than every token (issue 25): sliding windows, chunked attention, MLA's
latent, read from config.json the way vLLM reads them and sized as its KV manager sizes them."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool.workers.planner import PlanArgs, parse_model_spec, plan_from_args
from gpupool.workers.planner.model_spec import LayerKind
from gpupool.workers.planner.params import attention_layer_params
from tests.workers.planner.conftest import H200

BASE: dict[str, Any] = {
    "hidden_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 2880,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
}
SLIDE, FULL, CHUNK = (
    LayerKind.sliding_attention,
    LayerKind.full_attention,
    LayerKind.chunked_attention,
)


def spec(**fields: Any) -> Any:
    return parse_model_spec({**BASE, **fields}, name="t")


def test_gpt_oss_alternating_layer_types_make_two_groups_of_twelve() -> None:
    types = ["sliding_attention", "full_attention"] * 12
    s = spec(model_type="gpt_oss", num_hidden_layers=24, layer_types=types, sliding_window=128)
    assert s.layer_kinds.count(SLIDE) == s.layer_kinds.count(FULL) == 12
    plan = plan_from_args(s, PlanArgs(H200, 0.9, max_model_len=32768, max_num_batched_tokens=8192))
    layout = plan.layout
    assert (layout.group_size, layout.attention_groups, layout.window_groups) == (12, 1, 1)
    # a 32K request: 2048 blocks in the full group, ceil((128 - 1 + 2 x 8192) / 16) + 1 sliding
    assert layout.blocks_per_request(32768) == 2048 + 1033


QWEN2_WINDOW = {"model_type": "qwen2", "sliding_window": 4096, "max_window_layers": 4}
WITHOUT_LAYER_TYPES = [
    # Gemma 3: every 6th layer global
    ({"model_type": "gemma3_text", "sliding_window": 1024}, [SLIDE] * 5 + [FULL]),
    # Gemma 2: even layers slide
    ({"model_type": "gemma2", "sliding_window": 4096}, [SLIDE, FULL] * 3),
    # Mistral-style: one window for every layer
    ({"model_type": "mistral", "sliding_window": 4096}, [SLIDE] * 6),
    # Qwen2: a window only when use_sliding_window, from max_window_layers on
    ({**QWEN2_WINDOW, "use_sliding_window": False}, [FULL] * 6),
    ({**QWEN2_WINDOW, "use_sliding_window": True}, [FULL] * 4 + [SLIDE] * 2),
    # Llama 4: chunked attention but on every 4th (NoPE) layer
    (
        {"model_type": "llama4_text", "attention_chunk_size": 8192},
        [CHUNK] * 3 + [FULL] + [CHUNK] * 2,
    ),
]


@pytest.mark.parametrize(("fields", "kinds"), WITHOUT_LAYER_TYPES)
def test_configs_without_layer_types(fields: dict[str, Any], kinds: list[LayerKind]) -> None:
    assert list(spec(num_hidden_layers=6, **fields).layer_kinds) == kinds


def test_all_sliding_is_one_group_that_holds_a_window_at_most() -> None:
    s = spec(model_type="mistral", num_hidden_layers=32, sliding_window=4096)
    plan = plan_from_args(s, PlanArgs(H200, 0.9, max_model_len=32768, max_num_batched_tokens=2048))
    layout = plan.layout
    assert (layout.attention_groups, layout.window_groups, layout.group_size) == (0, 1, 32)
    assert layout.blocks_per_request(32768) == (4096 - 1 + 2 * 2048 + 15) // 16 + 1
    assert layout.blocks_per_request(1024) == 1024 // 16 + 1


def test_llama4_chunked_layers_hold_a_chunk_plus_what_is_in_flight() -> None:
    s = spec(model_type="llama4_text", num_hidden_layers=48, attention_chunk_size=8192)
    plan = plan_from_args(s, PlanArgs(H200, 0.9, max_model_len=131072, max_num_batched_tokens=8192))
    layout = plan.layout
    assert (layout.group_size, layout.attention_groups, layout.window_groups) == (12, 1, 3)
    assert layout.blocks_per_request(131072) == 8192 + 3 * ((8192 + 2 * 8192) // 16)


DEEPSEEK: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
}


def test_mla_caches_one_latent_per_token_on_every_rank() -> None:
    s = parse_model_spec(DEEPSEEK, name="ds")
    assert s.mla is not None and s.mla.latent_dim == 576 and s.moe and s.moe.dense_layers == 3
    for tp in (1, 8):
        plan = plan_from_args(
            s, PlanArgs(8 * H200, 0.9, tensor_parallel_size=tp, max_model_len=4096)
        )
        assert plan.kv_bytes_per_token == 576 * 2 * 61  # bf16, not split across ranks
        assert plan.layout.block_size == 64  # FlashMLA's block
    # q through its LoRA, K/V latent down and up, o, the two latent norms
    assert attention_layer_params(s) == (
        7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168 + 2048
    )
