"""One KV-event subscription and index per worker, kept in step with the worker's life.

A worker's index starts empty whenever its cache does: a (re)launch, a sleep or a wake, a stop or
a failure (``on_change``). Two ways keep what the index learned: the first way up
(``starting → warming → ready``, the warm-up's blocks included), and a drain and its resume
(``ready ⇄ draining``): a drained launched worker's vLLM process stays up with its cache, and
its subscription goes on following the events (what it finishes, what vLLM evicts), so a
resume finds the index as warm as the cache. A drain that ends in a stop (``stopped``, a `url:`
worker's drain too) empties it. A new endpoint (a restarted worker's new ports) means a new
subscription. ``remove`` (the worker left the pool) ends its subscription and drops its index.
Threads end within ``subscriber.POLL_S`` of ``forget``; ``aclose`` joins them all, then ends
the ZMQ context.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from gpupool.workers.kvevents.index import BlockIndex
from gpupool.workers.kvevents.subscriber import Subscriber
from gpupool.workers.registry import Worker, WorkerState

_KEEPS = {
    (WorkerState.starting, WorkerState.warming),
    (WorkerState.warming, WorkerState.ready),
    (WorkerState.starting, WorkerState.ready),
    (WorkerState.ready, WorkerState.draining),  # the process and its cache stay up
    (WorkerState.draining, WorkerState.ready),  # resumed: the same process (else → starting)
}
_SUBSCRIBED = (WorkerState.starting, WorkerState.warming, WorkerState.ready, WorkerState.draining)


class KvPool:
    def __init__(
        self, max_blocks: int = 1_000_000, pending_s: float = 30.0, replay_timeout_s: float = 2.0
    ) -> None:
        self.max_blocks = max_blocks
        self.pending_s = pending_s
        self.replay_timeout_s = replay_timeout_s
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._subs: dict[str, Subscriber] = {}
        self._indexes: dict[str, BlockIndex] = {}
        self._stopping: list[Subscriber] = []

    def index(self, name: str) -> BlockIndex | None:
        return self._indexes.get(name)

    def subscriber(self, name: str) -> Subscriber | None:
        return self._subs.get(name)

    def watch(self, worker: Worker) -> None:
        """Subscribe to the worker's current source (nothing when it has none)."""
        src = worker.kv_source
        sub = self._subs.get(worker.name)
        if sub is not None and sub.ends == src:
            return
        self.forget(worker.name)
        if src is None:
            return
        index = self._indexes.get(worker.name)
        if index is None:
            index = self._indexes[worker.name] = BlockIndex(self.max_blocks, self.pending_s)
        else:
            index.clear()
        sub = Subscriber(worker.name, src, index, self._ctx, self.replay_timeout_s)
        self._subs[worker.name] = sub
        sub.start()

    def forget(self, name: str) -> None:
        sub = self._subs.pop(name, None)
        if sub is not None:
            sub.stop()
            self._stopping = [s for s in self._stopping if s.is_alive()]
            self._stopping.append(sub)

    def remove(self, name: str) -> None:
        """A worker left the pool (a reload, discovery)."""
        self.forget(name)
        self._indexes.pop(name, None)

    def on_change(self, worker: Worker, old: WorkerState) -> None:
        """The registry's listener: empty the index whenever the worker's cache is gone."""
        index = self._indexes.get(worker.name)
        if index is not None and (old, worker.state) not in _KEEPS:
            index.clear()
        if worker.state in _SUBSCRIBED:
            self.watch(worker)
        elif worker.state in (WorkerState.stopped, WorkerState.failed):
            self.forget(worker.name)

    async def aclose(self) -> None:
        for name in list(self._subs):
            self.forget(name)
        threads = self._stopping
        self._stopping = []
        await asyncio.to_thread(_join, threads)
        self._ctx.term()


def _join(threads: list[Subscriber]) -> None:
    for t in threads:
        t.join()
