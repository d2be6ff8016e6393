"""A block-hash prefix cache with LRU eviction, enough to make prefix hits observable.

A prompt given with its :class:`~gpupool.workers.sim.kvevents.Blocks` (KV events on) is keyed
by vLLM's block hashes of its real token ids instead of the simulator's pieces, and what goes in
and out is published (``kvevents.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpupool.workers.sim.kvevents import Blocks, SimKvEvents

BLOCK_SIZE = 16


class PrefixCache:
    def __init__(
        self, num_blocks: int, block_size: int = BLOCK_SIZE, events: SimKvEvents | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._evicted: list[int] = []

    def query(self, pieces: list[str], blocks: Blocks | None = None) -> int:
        """Cached tokens for this prompt (a leading run of full blocks); remembers its blocks."""
        if blocks is not None:
            hits = self.lookup(pieces, blocks)
            self.insert(pieces, blocks, upto=(len(blocks.ids) - 1) // self.block_size)
            return hits
        size = self.block_size
        full = (len(pieces) - 1) // size  # the last token is always computed
        chain = 0
        hits = 0
        hitting = True
        for start in range(0, full * size, size):
            chain = hash((chain, "".join(pieces[start : start + size])))
            if hitting and chain in self._blocks:
                self._blocks.move_to_end(chain)
                hits += size
                continue
            hitting = False
            self._insert(chain)
        return hits

    def lookup(self, pieces: list[str], blocks: Blocks | None = None) -> int:
        """Cached tokens for this prompt, remembering nothing new (its blocks are not computed
        yet: :meth:`insert` once they are)."""
        size = self.block_size
        if blocks is not None:
            hits = 0
            for key in blocks.keys[: (len(blocks.ids) - 1) // size]:
                if key not in self._blocks:
                    break
                self._blocks.move_to_end(key)
                hits += size
            return min(hits, max(len(pieces) - 1, 0))  # in the simulator's own tokens
        chain = 0
        hits = 0
        for start in range(0, (len(pieces) - 1) // size * size, size):
            chain = hash((chain, "".join(pieces[start : start + size])))
            if chain not in self._blocks:
                break
            self._blocks.move_to_end(chain)
            hits += size
        return hits

    def insert(
        self, pieces: list[str], blocks: Blocks | None = None, upto: int | None = None
    ) -> None:
        """Remember this prompt's full blocks (all computed now), most recently used."""
        if blocks is not None:
            self._insert_keyed(blocks, len(blocks.keys) if upto is None else upto)
            return
        size = self.block_size
        chain = 0
        for start in range(0, len(pieces) // size * size, size):
            chain = hash((chain, "".join(pieces[start : start + size])))
            if chain in self._blocks:
                self._blocks.move_to_end(chain)
            else:
                self._insert(chain)

    def _insert_keyed(self, blocks: Blocks, upto: int) -> None:
        """Insert vLLM-keyed blocks; publish each run of new ones and what they evicted."""
        start = None
        for i, key in enumerate(blocks.keys[:upto]):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                self._stored(blocks, start, i)
                start = None
                continue
            self._insert(key)
            start = i if start is None else start
        self._stored(blocks, start, upto)

    def _stored(self, blocks: Blocks, start: int | None, end: int) -> None:
        events = self.events
        if start is None or events is None:
            return
        events.stored(blocks, start, end)
        if self._evicted:
            events.removed(self._evicted)
            self._evicted = []

    def _insert(self, key: int) -> None:
        self._blocks[key] = None
        if len(self._blocks) > self.num_blocks:
            gone, _ = self._blocks.popitem(last=False)
            if self.events is not None:
                self._evicted.append(gone)

    def clear(self) -> None:
        self._blocks.clear()
        self._evicted = []
        if self.events is not None:
            self.events.cleared()
