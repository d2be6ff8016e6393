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
- Local attention (vLLM's ``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec``, hybrid KV cache
  manager): layers are grouped by kind with the same rule (Gemma 3's 40 sliding + 8 full → 6
  groups of 8; gpt-oss's 12 + 12 → 2 groups of 12), every group takes blocks from one pool, and a
  request holds in a sliding group ``ceil(min(window - 1 + in flight, max_model_len) / block) + 1``
  blocks, in a chunked group ``ceil(min(chunk + in flight, max_model_len) / block)``
  (``max_memory_usage_bytes``). The tokens in flight are what one step may add: vLLM's source
  says ``max_num_batched_tokens``, but 0.26.0 on the H200 reserved twice that (a Gemma-3-12B-like
  model, window 1024, 8,192 batched tokens: 1,089 blocks per sliding group, 13.80x and 452,218
  tokens for 100.98 GiB; one step's worth would have said 577 blocks and 20.96x), which async
  scheduling's second step in flight explains; :data:`IN_FLIGHT_STEPS` holds the factor.
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
IN_FLIGHT_STEPS = 2
"""Steps of ``max_num_batched_tokens`` a local-attention group reserves beyond its window (0.26.0
on the H200, measured; vLLM's source reads as 1)."""
_GROUP_SLACK = 1.5


@dataclass(frozen=True, slots=True)
class WindowGroups:
    """Groups of sliding-window (``chunked=False``) or chunked-local layers."""

    groups: int
    tokens: int  # the window, or the chunk
    chunked: bool = False

    def blocks(self, max_model_len: int, block_size: int, batched_tokens: int) -> int:
        """Blocks one request holds in one such group (vLLM's ``max_memory_usage_bytes``)."""
        in_flight = IN_FLIGHT_STEPS * batched_tokens
        if self.chunked:
            return math.ceil(min(self.tokens + in_flight, max_model_len) / block_size)
        return math.ceil(min(self.tokens - 1 + in_flight, max_model_len) / block_size) + 1


@dataclass(frozen=True, slots=True)
class KvLayout:
    block_size: int  # tokens per block
    page_bytes: int  # one block of one layer (mamba pages padded to it)
    group_size: int  # layers per group
    attention_groups: int  # full-attention groups
    mamba_groups: int
    mamba_page_bytes: int = 0  # unpadded Gated DeltaNet state of one layer
    mamba_blocks: int = MAMBA_BLOCKS_NONE  # blocks per request in each mamba group
    windows: tuple[WindowGroups, ...] = ()  # sliding-window and chunked-local groups
    batched_tokens: int = 0  # max-num-batched-tokens, which sets what a window group reserves

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.group_size

    @property
    def window_groups(self) -> int:
        return sum(w.groups for w in self.windows)

    @property
    def groups(self) -> int:
        return self.attention_groups + self.window_groups + self.mamba_groups

    def blocks_per_request(self, max_model_len: int) -> int:
        attention = self.attention_groups * math.ceil(max_model_len / self.block_size)
        windows = sum(
            w.groups * w.blocks(max_model_len, self.block_size, self.batched_tokens)
            for w in self.windows
        )
        return attention + windows + self.mamba_groups * self.mamba_blocks

    def bytes_per_request(self, max_model_len: int) -> int:
        return self.blocks_per_request(max_model_len) * self.block_bytes


def hybrid_block_size(mamba_page_bytes: int, attn_bytes_per_token: int, align: int) -> int:
    """``align x ceil(mamba_page / (align x attn_bytes_per_token))`` (vLLM's hybrid alignment)."""
    return align * math.ceil(mamba_page_bytes / (align * attn_bytes_per_token))


def plain_layout(attn_bytes_per_token: int, num_layers: int, block_size: int) -> KvLayout:
    return KvLayout(block_size, block_size * attn_bytes_per_token, num_layers, 1, 0)


@dataclass(frozen=True, slots=True)
class AttentionLayers:
    """How many attention layers of each kind a model has, and their windows."""

    full: int
    sliding: int = 0
    window: int = 0
    chunked: int = 0
    chunk: int = 0


def attention_layout(
    attn_bytes_per_token: int, layers: AttentionLayers, block_size: int, batched_tokens: int
) -> KvLayout:
    """Full, sliding-window and chunked layers in groups of equal size (vLLM's
    ``_get_kv_cache_groups_uniform_page_size``); one kind alone is one group."""
    counts = [n for n in (layers.full, layers.sliding, layers.chunked) if n]
    size = _group_size(*counts) if len(counts) > 1 else sum(counts)
    windows = tuple(
        WindowGroups(math.ceil(n / size), tokens, chunked)
        for n, tokens, chunked in (
            (layers.sliding, layers.window, False),
            (layers.chunked, layers.chunk, True),
        )
        if n
    )
    return KvLayout(
        block_size=block_size,
        page_bytes=block_size * attn_bytes_per_token,
        group_size=size,
        attention_groups=math.ceil(layers.full / size),
        mamba_groups=0,
        windows=windows,
        batched_tokens=batched_tokens,
    )


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


def _group_size(*counts: int) -> int:
    """The smallest kind's layer count, or the largest when within 1.5x of it."""
    low, high = min(counts), max(counts)
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
    if layout.blocks_per_request(1) > blocks:
        return 0
    low, high = 1, max(1, blocks * layout.block_size)  # every block one group's, at most
    while low < high:
        mid = (low + high + 1) // 2
        if layout.blocks_per_request(mid) <= blocks:
            low = mid
        else:
            high = mid - 1
    return low
