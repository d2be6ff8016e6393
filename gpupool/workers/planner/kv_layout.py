"""vLLM's KV cache layout: block size, page size, layer groups, blocks per request.

Mirrors vLLM v1 (``platforms/interface.py::_align_hybrid_block_size``,
``v1/core/kv_cache_utils.py``):

- Plain models: one group holding every layer; ``block_size`` tokens per block (16 unless
  ``--block-size``); a block costs ``page x num_layers`` bytes.
- Hybrid models (vllm-behaviour.md §7): the attention block grows until one attention page
  (``block_size x bytes per token per layer``) holds a whole Gated DeltaNet state (the mamba page):
  ``block = align x ceil(mamba_page / (align x attn_bytes_per_token))``; the mamba page is then
  padded to the attention page. Layers are grouped so every group has the same number of layers
  (the smaller layer count, or the larger when within 1.5x: 10 full + 30 linear → 4 groups of
  10); one block costs ``page x group_size`` bytes and serves one group.
- A request at ``max_model_len`` needs ``ceil(max_model_len / block)`` blocks in each attention
  group and, per mamba group, what ``MambaSpec.max_memory_usage_bytes`` asks for: 2 blocks when
  prefix caching is on (``mamba_cache_mode="align"``, set by ``MambaModelConfig`` whenever prefix
  caching is enabled: the running state plus the last block-aligned one), 1 without it
  (``"none"``). vLLM 0.32 turns prefix caching on by default for hybrids
  (``ModelConfig.is_prefix_caching_supported``); older releases (seed 004's 0.25.1) left it off.
- vLLM logs ``Maximum concurrency = num_blocks / blocks_per_request`` and
  ``GPU KV cache size = concurrency x max_model_len`` tokens
  (``kv_cache_utils.get_max_concurrency_for_kv_cache_config``).

Checked against seed 004 (Qwen3.6-35B-A3B, fp8 KV, 180224 tokens, prefix caching off):
64.36 GiB → 3219 blocks of 10 x 2,146,304 bytes, 86 + 3 = 89 blocks per request, 36.17x and
6,518,438 tokens, as vLLM logged; and against the H200 run of 2026-12-01 (vLLM 0.26.0, a
Qwen3.5-35B-A3B-shaped model, ``--enable-prefix-caching``, 131072 tokens): 69.88 GiB → 6735
blocks of 10 x 1,114,112 bytes, 241 + 3 x 2 = 247 blocks per request, 27.27x and 3,573,967
tokens, as vLLM logged (1 block per mamba group would have said 27.60x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_KERNEL_BLOCK = 16
MAMBA_BLOCKS_NONE = 1
"""Blocks a request holds per mamba group without prefix caching (``mamba_cache_mode="none"``)."""
MAMBA_BLOCKS_ALIGN = 2
"""... with prefix caching (``"align"``): the running state and the last block-aligned one."""
_GROUP_SLACK = 1.5


@dataclass(frozen=True, slots=True)
class KvLayout:
    block_size: int  # tokens per block
    page_bytes: int  # one block of one layer (mamba pages padded to it)
    group_size: int  # layers per group
    attention_groups: int
    mamba_groups: int
    mamba_page_bytes: int = 0  # unpadded Gated DeltaNet state of one layer
    mamba_blocks: int = MAMBA_BLOCKS_NONE  # blocks per request in each mamba group

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.group_size

    def blocks_per_request(self, max_model_len: int) -> int:
        attention = self.attention_groups * math.ceil(max_model_len / self.block_size)
        return attention + self.mamba_groups * self.mamba_blocks

    def bytes_per_request(self, max_model_len: int) -> int:
        return self.blocks_per_request(max_model_len) * self.block_bytes


def hybrid_block_size(mamba_page_bytes: int, attn_bytes_per_token: int, align: int) -> int:
    """``align x ceil(mamba_page / (align x attn_bytes_per_token))`` (vLLM's hybrid alignment)."""
    return align * math.ceil(mamba_page_bytes / (align * attn_bytes_per_token))


def plain_layout(attn_bytes_per_token: int, num_layers: int, block_size: int) -> KvLayout:
    return KvLayout(block_size, block_size * attn_bytes_per_token, num_layers, 1, 0)


def hybrid_layout(
    attn_bytes_per_token: int,
    mamba_page_bytes: int,
    full_layers: int,
    linear_layers: int,
    align: int,
    *,
    prefix_caching: bool = False,
) -> KvLayout:
    """The hybrid layout; ``prefix_caching`` puts vLLM's mamba cache in "align" mode."""
    block = hybrid_block_size(mamba_page_bytes, attn_bytes_per_token, align)
    size = _group_size(full_layers, linear_layers)
    return KvLayout(
        block_size=block,
        page_bytes=block * attn_bytes_per_token,
        group_size=size,
        attention_groups=math.ceil(full_layers / size),
        mamba_groups=math.ceil(linear_layers / size),
        mamba_page_bytes=mamba_page_bytes,
        mamba_blocks=MAMBA_BLOCKS_ALIGN if prefix_caching else MAMBA_BLOCKS_NONE,
    )


def _group_size(full_layers: int, linear_layers: int) -> int:
    low, high = sorted((full_layers, linear_layers))
    return high if high < low * _GROUP_SLACK else low


@dataclass(frozen=True, slots=True)
class KvCapacity:
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float  # sequences of max_model_len the cache holds at once
    tokens: int  # vLLM's "GPU KV cache size" = concurrency x max_model_len


def kv_capacity(layout: KvLayout, kv_budget_bytes: int, max_model_len: int) -> KvCapacity:
    blocks = max(0, kv_budget_bytes) // layout.block_bytes
    per_request = layout.blocks_per_request(max_model_len)
    concurrency = blocks / per_request
    return KvCapacity(blocks, per_request, concurrency, int(concurrency * max_model_len))


def longest_fitting_len(layout: KvLayout, kv_budget_bytes: int) -> int:
    """The longest max-model-len whose one request fits (vLLM's auto-fit), 0 if none."""
    blocks = max(0, kv_budget_bytes) // layout.block_bytes
    attention_blocks = blocks - layout.mamba_groups * layout.mamba_blocks
    if attention_blocks < layout.attention_groups:
        return 0
    return (attention_blocks // layout.attention_groups) * layout.block_size
