"""One worker's cached blocks, as its KV-cache events tell them. Bounded; thread-safe.

The subscription thread writes (``stored``, ``removed``, ``clear``); routing reads
(``prefix_blocks``) on the event loop. A block is keyed by vLLM's int hash, which chains its
parent's, so the longest run of a request's leading hashes found here is the prefix vLLM will
find cached. Past ``max_blocks`` the least recently stored or matched block goes first: vLLM
evicts least recently used free blocks, so that is the one it most likely dropped.

A request just placed on the worker counts at once as the blocks it will store
(``pending``), until they are stored or ``pending_s`` passes, so requests decided in the same
instant see each other.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class IndexStats:
    """Counters since the gateway started (they survive ``clear``)."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0  # AllBlocksCleared events, and lifecycle or resync drops
    gaps: int = 0  # sequence gaps seen
    replayed: int = 0  # gaps the replay socket filled
    resyncs: int = 0  # gaps it could not fill: the index was dropped
    evicted: int = 0  # dropped past max_blocks
    undecodable: int = 0
    block_size: int | None = None  # as the last BlockStored said
    hybrid: bool = False  # events from a second KV-cache group (not modelled)
    verified: bool | None = None  # a parentless chain recomputed: matches (None: not yet)
    reason: str = ""  # why the last resync happened
    last_event: float = field(default=0.0)


class BlockIndex:
    def __init__(self, max_blocks: int = 1_000_000, pending_s: float = 30.0) -> None:
        self.max_blocks = max_blocks
        self.pending_s = pending_s
        self.stats = IndexStats()
        self.synced = True  # False after a resync until a block is stored again
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._pending: dict[int, float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def stored(self, hashes: Iterable[int]) -> None:
        with self._lock:
            blocks, pending = self._blocks, self._pending
            for h in hashes:
                blocks[h] = None
                blocks.move_to_end(h)
                pending.pop(h, None)
                self.stats.stored += 1
            over = len(blocks) - self.max_blocks
            for _ in range(max(over, 0)):
                blocks.popitem(last=False)
                self.stats.evicted += 1
            self.synced = True

    def removed(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                if self._blocks.pop(h, 0) is None:
                    self.stats.removed += 1

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._pending.clear()
            self.stats.cleared += 1

    def prefix_blocks(self, hashes: Sequence[int], now: float | None = None) -> int:
        """How many of ``hashes``, from the first, are cached or about to be."""
        return self.prefix(hashes, now)[0]

    def prefix(self, hashes: Sequence[int], now: float | None = None) -> tuple[int, int]:
        """How many of ``hashes``, from the first, are cached or about to be; and how many of
        those are only about to be (placed here, not stored yet)."""
        now = time.monotonic() if now is None else now
        blocks, pending = self._blocks, self._pending
        n = placed = 0
        with self._lock:
            for h in hashes:
                if h in blocks:
                    n += 1
                    continue
                until = pending.get(h)
                if until is None or until < now:
                    break
                n += 1
                placed += 1
        return n, placed

    def placed(self, hashes: Sequence[int], now: float | None = None) -> None:
        """A request with these block hashes was just placed here: the ones cached are used
        now (most recent), the others count as cached for ``pending_s``."""
        now = time.monotonic() if now is None else now
        until = now + self.pending_s
        with self._lock:
            blocks, pending = self._blocks, self._pending
            for h in hashes:
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    pending[h] = until
            if len(pending) > self.max_blocks:  # never more than the index itself
                stale = [h for h, t in pending.items() if t < now]
                for h in stale or list(pending)[: len(pending) // 2]:
                    pending.pop(h, None)

    def pending_count(self) -> int:
        return len(self._pending)
