"""The simulator's KV-cache events: its prefix cache keyed and published as vLLM's.

With ``--kv-events-config`` (vLLM's flag) and ``--tokenizer DIR`` (a model directory:
``tokenizer.json`` and chat template), a chat or completions prompt that can be computed exactly
(``workers/kvevents/render.py``) is tokenized as vLLM would, its full blocks of
:data:`~gpupool.workers.sim.cache.BLOCK_SIZE` tokens are hashed as vLLM hashes them (sha256, the
seed from ``PYTHONHASHSEED``, the request's ``cache_salt`` on the first block), and those hashes
key the prefix cache. Blocks it stores and evicts are published as ``BlockStored`` /
``BlockRemoved`` in vLLM's wire format, with its replay socket; ``/metrics`` then shows
``vllm:cache_config_info`` so the gateway knows the block size and hash algorithm. Prompts that
cannot be computed exactly keep the simulator's own piece hashing and publish nothing.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import orjson

from gpupool.workers.kvevents import hashing, wire
from gpupool.workers.kvevents.publisher import KvPublisher
from gpupool.workers.kvevents.render import NotModelled, PromptRenderer
from gpupool.workers.sim.cache import BLOCK_SIZE
from gpupool.workers.sim.config import SimConfig

log = logging.getLogger("gpupool.sim")


@dataclass(slots=True, frozen=True)
class Blocks:
    """A prompt as vLLM would hash it: token ids and one key per full block."""

    ids: list[int]
    keys: list[int]
    salt: str | None


class SimKvEvents:
    def __init__(self, config_json: str, tokenizer_dir: str, block_size: int) -> None:
        cfg = json.loads(config_json)
        self.block_size = block_size
        self.spec = hashing.HashSpec(
            block_size, "sha256", os.environ.get("PYTHONHASHSEED", hashing.DEFAULT_SEED)
        )
        self.renderer = PromptRenderer.load(tokenizer_dir)
        steps = int(cfg.get("buffer_steps", 10_000))
        self.publisher = KvPublisher(
            cfg["endpoint"], cfg.get("replay_endpoint"), steps, cfg.get("topic", "")
        )

    def blocks(self, path: str, raw: bytes) -> Blocks | None:
        """The request's blocks, or None when its prompt is not computed exactly."""
        try:
            body = orjson.loads(raw)
            ids = self.renderer.prompt_ids(path, body)
        except (orjson.JSONDecodeError, NotModelled, AttributeError, TypeError):
            return None
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        return Blocks(ids, hashing.block_hashes(ids, self.spec, salt or None), salt or None)

    def stored(self, blocks: Blocks, start: int, end: int) -> None:
        """Blocks ``start``..``end - 1`` of a prompt went into the cache."""
        size = self.block_size
        extra: list[list[Any] | None] = [None] * (end - start)
        if start == 0 and blocks.salt:
            extra[0] = [blocks.salt]
        parent = blocks.keys[start - 1] if start else None
        keys: list[wire.Hash] = list(blocks.keys[start:end])
        ids = blocks.ids[start * size : end * size]
        event = wire.BlockStored(keys, parent, ids, size, medium="GPU", extra_keys=extra,
                                 group_idx=0, kv_cache_spec_kind="full_attention")  # fmt: skip
        self.publisher.publish(event)

    def removed(self, keys: list[int]) -> None:
        self.publisher.publish(wire.BlockRemoved(list[wire.Hash](keys), "GPU"))

    def cleared(self) -> None:
        self.publisher.publish(wire.AllBlocksCleared())

    def cache_info(self, num_blocks: int) -> dict[str, str]:
        """``vllm:cache_config_info``'s labels, as vLLM shows them."""
        return {"block_size": str(self.block_size), "enable_prefix_caching": "True",
                "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": str(num_blocks),
                "hash_block_size": "None", "mamba_block_size": "None"}  # fmt: skip

    def close(self) -> None:
        self.publisher.close()


def sim_kv_events(config: SimConfig) -> SimKvEvents | None:
    """The simulator's events when ``--kv-events-config`` asks for them and ``--tokenizer``
    names the model directory to compute prompts with (without it: none, logged)."""
    cfg = config.kv_events_config
    if not cfg or not json.loads(cfg).get("enable_kv_cache_events", True):
        return None
    if not config.tokenizer:
        log.warning("--kv-events-config without --tokenizer: no KV events are published")
        return None
    return SimKvEvents(cfg, config.tokenizer, BLOCK_SIZE)
