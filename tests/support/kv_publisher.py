"""Test helpers around the simulator's KV-event publisher (vLLM's protocol)."""

from __future__ import annotations

from gpupool.workers.kvevents import wire
from gpupool.workers.kvevents.publisher import KvPublisher

__all__ = ["KvPublisher", "stored"]


def stored(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None,
           block_size: int = 4) -> wire.BlockStored:  # fmt: skip
    return wire.BlockStored(hashes, parent, tokens or [0] * (block_size * len(hashes)),
                            block_size, medium="GPU")  # fmt: skip
