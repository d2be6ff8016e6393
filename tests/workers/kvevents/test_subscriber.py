"""The subscription thread against a publisher speaking vLLM's protocol: in-order batches, a gap
the replay fills, a gap it cannot fill (resync), a restarted publisher, and a late subscriber."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from gpupool.workers.kvevents import wire
from gpupool.workers.kvevents.index import BlockIndex
from gpupool.workers.kvevents.source import KvSource
from gpupool.workers.kvevents.subscriber import Subscriber
from tests.support.kv_publisher import KvPublisher, stored


def _until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.01)


@pytest.fixture
def wired(tmp_path: Path) -> Iterator[tuple[KvPublisher, BlockIndex, Subscriber]]:
    src = KvSource(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    pub = KvPublisher(src.endpoint, src.replay, buffer_steps=5)
    ctx: zmq.Context[Any] = zmq.Context()
    index = BlockIndex(max_blocks=100)
    sub = Subscriber("w", src, index, ctx, replay_timeout_s=5.0)
    sub.start()
    try:
        # the SUB joins asynchronously: publish until one batch arrives
        _until(lambda: _hello(pub, index))
        yield pub, index, sub
    finally:
        sub.stop()
        sub.join()
        pub.close()
        ctx.term()
    assert not sub.is_alive()


def _hello(pub: KvPublisher, index: BlockIndex, parent: int | None = None) -> bool:
    if index.stats.batches:
        return True
    pub.publish(stored([999], parent))
    time.sleep(0.05)
    return bool(index.stats.batches)


def test_in_order_batches_build_the_index(
    wired: tuple[KvPublisher, BlockIndex, Subscriber],
) -> None:
    pub, index, _ = wired
    pub.publish(stored([1, 2, 3]))
    pub.publish(wire.BlockRemoved([2], "GPU"))
    _until(lambda: index.stats.removed == 1)
    assert index.prefix_blocks([1, 3]) == 2
    assert index.prefix_blocks([1, 2, 3]) == 1
    pub.publish(wire.AllBlocksCleared())
    _until(lambda: len(index) == 0)


def test_a_gap_is_filled_from_the_replay_socket(
    wired: tuple[KvPublisher, BlockIndex, Subscriber],
) -> None:
    pub, index, _ = wired
    pub.publish(stored([10]), send=False)  # lost on the PUB socket, kept for replay
    pub.publish(stored([11]))
    _until(lambda: index.prefix_blocks([11]) == 1)
    assert index.prefix_blocks([10]) == 1
    assert (index.stats.gaps, index.stats.replayed, index.stats.resyncs) == (1, 1, 0)
    assert index.synced


def test_a_gap_past_the_replay_buffer_resyncs(
    wired: tuple[KvPublisher, BlockIndex, Subscriber],
) -> None:
    pub, index, _ = wired
    pub.publish(stored([20]))
    _until(lambda: index.prefix_blocks([20]) == 1)
    for h in range(30, 37):  # 7 lost batches; the buffer keeps 5
        pub.publish(stored([h]), send=False)
    pub.publish(wire.BlockRemoved([999], "GPU"))
    _until(lambda: index.stats.resyncs == 1)
    assert index.prefix_blocks([20]) == 0  # dropped: what was missed may have removed it
    assert not index.synced
    pub.publish(stored([40]))
    _until(lambda: index.synced)
    assert index.prefix_blocks([40]) == 1


def test_a_restarted_publisher_empties_the_index(
    wired: tuple[KvPublisher, BlockIndex, Subscriber],
) -> None:
    pub, index, _ = wired
    pub.publish(stored([50]))
    _until(lambda: index.prefix_blocks([50]) == 1)
    pub.restart()
    pub.publish(stored([60]))
    _until(lambda: index.prefix_blocks([60]) == 1)
    assert index.prefix_blocks([50]) == 0


def test_a_late_subscriber_replays_from_the_start(tmp_path: Path) -> None:
    src = KvSource(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    pub = KvPublisher(src.endpoint, src.replay, buffer_steps=50)
    ctx: zmq.Context[Any] = zmq.Context()
    index = BlockIndex()
    for h in (1, 2, 3):
        pub.publish(stored([h]))  # nobody listens yet
    sub = Subscriber("w", src, index, ctx, replay_timeout_s=5.0)
    sub.start()
    try:
        _until(lambda: _hello(pub, index))
        _until(lambda: index.prefix_blocks([1]) == 1)
        assert index.prefix_blocks([2]) == index.prefix_blocks([3]) == 1
        assert index.stats.resyncs == 0
    finally:
        sub.stop()
        sub.join()
        pub.close()
        ctx.term()


def test_the_seed_check_hashes_on_the_subscription_thread_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` is asked on the event loop (every request's ``why_not``): it only reads what
    the subscription thread recomputed when a parentless chain came, and that thread rehashes
    only a few first blocks of a long chain (the seed shows in them already)."""
    from gpupool.workers.kvevents import hashing
    from gpupool.workers.kvevents.subscriber import VERIFY_BLOCKS

    src = KvSource(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", seed="7")
    spec = hashing.HashSpec(block_size=4, seed="7")
    ids = list(range(4 * 2000))
    good = hashing.block_hashes(ids, spec)
    wrong = hashing.block_hashes(ids[:8], hashing.HashSpec(4, seed="other"))
    hashed: list[tuple[int, int]] = []  # (thread, tokens) per chain hashed
    chain = hashing.chain

    def recording(parent: bytes, token_ids: list[int], *rest: Any) -> list[bytes]:
        hashed.append((threading.get_ident(), len(token_ids)))
        return chain(parent, token_ids, *rest)

    monkeypatch.setattr(hashing, "chain", recording)
    pub = KvPublisher(src.endpoint, src.replay, buffer_steps=50)
    ctx: zmq.Context[Any] = zmq.Context()
    index = BlockIndex()
    sub = Subscriber("w", src, index, ctx, replay_timeout_s=5.0)
    sub.start()
    try:
        _until(lambda: _hello(pub, index, parent=1))  # a chained batch: nothing to check
        assert sub.verify(spec) is None
        pub.publish(stored(good, None, ids))
        _until(lambda: len(sub.checks) == 1)
        assert sub.verify(spec) is True
        assert hashed == [(sub.ident, VERIFY_BLOCKS * 4)]
        pub.publish(stored(wrong, None, ids[:8]))
        _until(lambda: len(sub.checks) == 2)
        assert sub.verify(spec) is False
        assert sub.verify(hashing.HashSpec(block_size=8, seed="7")) is None  # no such chains
        assert all(t == sub.ident for t, _ in hashed), hashed  # never the caller's thread
    finally:
        sub.stop()
        sub.join()
        pub.close()
        ctx.term()


def test_a_salted_chain_tells_how_the_worker_hashes_its_salt(tmp_path: Path) -> None:
    """vLLM 0.26 hashes a ``cache_salt`` bare (``(salt,)``), 0.32 tagged
    (``(("cache_salt", salt),)``); both publish it bare in ``extra_keys``. The seed check
    tries both ways, and the predictions then hash salts the way this worker's chains did."""
    from gpupool.workers.kvevents import hashing

    src = KvSource(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", seed="7")
    ids = list(range(4 * 3))
    pub = KvPublisher(src.endpoint, src.replay, buffer_steps=50)
    ctx: zmq.Context[Any] = zmq.Context()
    index = BlockIndex()
    sub = Subscriber("w", src, index, ctx, replay_timeout_s=5.0)
    sub.start()

    def salted(spec: hashing.HashSpec, salt: str) -> wire.BlockStored:
        hashes: list[wire.Hash] = list(hashing.block_hashes(ids, spec, salt))
        extra: list[list[Any] | None] = [[salt], *([None] * (len(hashes) - 1))]
        return wire.BlockStored(hashes, None, ids, 4, medium="GPU", extra_keys=extra)

    try:
        _until(lambda: _hello(pub, index, parent=1))
        assert sub.salt_tagged() is True  # vLLM 0.32's way until a chain shows otherwise
        bare = hashing.HashSpec(block_size=4, seed="7", salt_tagged=False)
        assert hashing.block_hashes(ids, bare, "t") != hashing.block_hashes(
            ids, hashing.HashSpec(4, seed="7"), "t"
        )
        pub.publish(salted(bare, "tenant-a"))
        _until(lambda: len(sub.checks) == 1)
        assert sub.verify(bare) is True  # the seed is right: a 0.26 worker is not refused
        assert sub.salt_tagged() is False
        pub.publish(salted(hashing.HashSpec(4, seed="7"), "tenant-b"))
        _until(lambda: len(sub.checks) == 2)
        assert sub.salt_tagged() is True
        pub.publish(salted(hashing.HashSpec(4, seed="other"), "tenant-c"))
        _until(lambda: len(sub.checks) == 3)
        assert sub.verify(bare) is False  # a wrong seed matches neither way
    finally:
        sub.stop()
        sub.join()
        pub.close()
        ctx.term()
