"""A block-hash prefix cache with LRU eviction, enough to make prefix hits observable."""

from __future__ import annotations

from collections import OrderedDict

BLOCK_SIZE = 16


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def query(self, pieces: list[str]) -> int:
        """Cached tokens for this prompt (a leading run of full blocks); remembers its blocks."""
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

    def lookup(self, pieces: list[str]) -> int:
        """Cached tokens for this prompt, remembering nothing new (its blocks are not computed
        yet: :meth:`insert` once they are)."""
        size = self.block_size
        chain = 0
        hits = 0
        for start in range(0, (len(pieces) - 1) // size * size, size):
            chain = hash((chain, "".join(pieces[start : start + size])))
            if chain not in self._blocks:
                break
            self._blocks.move_to_end(chain)
            hits += size
        return hits

    def insert(self, pieces: list[str]) -> None:
        """Remember this prompt's full blocks (all computed now), most recently used."""
        size = self.block_size
        chain = 0
        for start in range(0, len(pieces) // size * size, size):
            chain = hash((chain, "".join(pieces[start : start + size])))
            if chain in self._blocks:
                self._blocks.move_to_end(chain)
            else:
                self._insert(chain)

    def _insert(self, key: int) -> None:
        self._blocks[key] = None
        if len(self._blocks) > self.num_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()
