"""The per-worker block index: prefixes, removal, the bound, and placements that count at once."""

from __future__ import annotations

from gpupool.workers.kvevents.index import BlockIndex


def test_the_longest_leading_run_counts() -> None:
    index = BlockIndex()
    index.stored([1, 2, 3])
    assert index.prefix_blocks([1, 2, 3, 4]) == 3
    assert index.prefix_blocks([2, 3]) == 2
    assert index.prefix_blocks([9, 1]) == 0
    index.removed([2])
    assert index.prefix_blocks([1, 2, 3]) == 1
    assert index.stats.removed == 1


def test_past_the_bound_the_least_recently_used_block_goes() -> None:
    index = BlockIndex(max_blocks=3)
    index.stored([1, 2, 3])
    index.placed([1])  # used again: most recent
    index.stored([4])
    assert len(index) == 3
    assert index.prefix_blocks([1]) == 1
    assert index.prefix_blocks([2]) == 0
    assert index.stats.evicted == 1


def test_a_placement_counts_until_stored_or_expired() -> None:
    index = BlockIndex(pending_s=10.0)
    index.stored([1])
    index.placed([1, 2, 3], now=100.0)
    assert index.prefix_blocks([1, 2, 3], now=105.0) == 3
    assert index.prefix([1, 2, 3], now=105.0) == (3, 2)  # of them, placed and not yet stored
    assert index.prefix_blocks([1, 2, 3], now=111.0) == 1  # never stored: forgotten
    index.stored([2])
    assert index.pending_count() == 1
    assert index.prefix_blocks([1, 2, 3], now=111.0) == 2


def test_clear_forgets_blocks_and_placements() -> None:
    index = BlockIndex()
    index.stored([1, 2])
    index.placed([1, 2, 3])
    index.clear()
    assert len(index) == 0 and index.pending_count() == 0
    assert index.prefix_blocks([1]) == 0
