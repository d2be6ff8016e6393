"""One worker's KV-cache event subscription: a thread, so decoding never runs on the event loop.

    connect SUB ─▶ message seq N ─┬─ N == next ─────────────▶ apply
                                  ├─ first message, N > 0 ─▶ replay [0, N) ─┐
                                  ├─ N > next (a gap) ─────▶ replay [next, N) ┤─ filled ▶ apply
                                  └─ N < next (restarted) ─▶ clear, replay [0, N) ┘
                                                 not filled (no replay socket, buffer too short,
                                                 no answer in ``replay_timeout_s``) ▶ resync:
                                                 the index is dropped and refills from events

The replay socket is vLLM's ROUTER: a DEALER sends ``[b"", start_seq]`` and receives
``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on, then ``seq = -1``.
The thread owns its sockets and closes them on every exit; ``stop`` ends it within ``POLL_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from gpupool.workers.kvevents import hashing, wire
from gpupool.workers.kvevents.index import BlockIndex
from gpupool.workers.kvevents.source import KvSource

log = logging.getLogger("gpupool.kvevents")

POLL_S = 0.1
MAX_SAMPLES = 4  # the last parentless chains' checks kept (the verdict reads them)
VERIFY_BLOCKS = 4  # of each parentless chain's first blocks, recomputed to check the seed


@dataclass(slots=True, frozen=True)
class Check:
    """One parentless chain recomputed on the subscription thread: its block size, and whether
    its first blocks hash as the worker's seed says (None: its extra keys are not a salt)."""

    block_size: int
    matches: bool | None
    salt_tagged: bool | None = None  # how the salt matched (None: no salt, or no match)


class Subscriber(threading.Thread):
    def __init__(
        self,
        name: str,
        ends: KvSource,
        index: BlockIndex,
        ctx: zmq.Context[Any],
        replay_timeout_s: float = 2.0,
    ) -> None:
        super().__init__(name=f"kv-events-{name}", daemon=True)
        self.worker = name
        self.ends = ends
        self.index = index
        # the seed the worker's hashes must start from (``ends.seed``, else vLLM's default)
        self.seed = ends.seed or hashing.DEFAULT_SEED
        self.checks: deque[Check] = deque(maxlen=MAX_SAMPLES)
        self._ctx = ctx
        self._replay_timeout_s = replay_timeout_s
        self._next: int | None = None
        self._stop_flag = threading.Event()

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, self.ends.topic.encode())
            sub.connect(self.ends.endpoint)
            while not self._stop_flag.is_set():
                if sub.poll(int(POLL_S * 1000)):
                    self.on_message(sub.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError as e:  # the context ended under it (gateway shutdown)
            if not self._stop_flag.is_set():
                log.warning("kv events of %s: %s", self.worker, e)
        finally:
            sub.close(0)

    # ---- sequence --------------------------------------------------------------------------

    def on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.index.stats.undecodable += 1
            return
        seq = wire.seq_of(frames[1])
        expected = self._next
        if expected is None:
            if seq > 0:  # subscribed late (or the first batches beat the subscription)
                self._catch_up(0, seq, f"subscribed at seq {seq}")
        elif seq < expected:  # the publisher started again: a new vLLM process
            self.index.clear()
            if seq > 0:
                self._catch_up(0, seq, "restarted")
        elif seq > expected:
            self.index.stats.gaps += 1
            self._catch_up(expected, seq, f"gap {expected}..{seq - 1}")
        self._apply(frames[2])
        self._next = seq + 1

    def _catch_up(self, start: int, upto: int, why: str) -> None:
        got = self._replay(start, upto)
        if got is None or [s for s, _ in got] != list(range(start, upto)):
            self._resync(why)
            return
        for _, payload in got:
            self._apply(payload)
        if start > 0:
            self.index.stats.replayed += 1

    def _resync(self, why: str) -> None:
        """What was missed is gone: drop the index, it refills from the events to come."""
        self.index.clear()
        self.index.synced = False
        self.index.stats.resyncs += 1
        self.index.stats.reason = f"{why}; not replayable"
        log.info("kv events of %s: %s, not replayable: index dropped", self.worker, why)

    def _replay(self, start: int, upto: int) -> list[tuple[int, bytes]] | None:
        if not self.ends.replay:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.ends.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            return self._read_replay(sock, upto)
        finally:
            sock.close(0)

    def _read_replay(self, sock: zmq.Socket[Any], upto: int) -> list[tuple[int, bytes]] | None:
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self._replay_timeout_s
        while not self._stop_flag.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                return None
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 4:
                return None
            seq = wire.seq_of(frames[2])
            if seq == wire.END_SEQ:
                return out
            if seq < upto:
                out.append((seq, frames[3]))
        return None

    # ---- events ----------------------------------------------------------------------------

    def _apply(self, payload: bytes) -> None:
        index = self.index
        try:
            batch = wire.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            index.stats.undecodable += 1
            return
        index.stats.batches += 1
        index.stats.last_event = time.monotonic()
        for ev in batch.events:
            if isinstance(ev, wire.BlockStored):
                self._stored(ev)
            elif isinstance(ev, wire.BlockRemoved):
                if ev.medium in (None, "GPU"):
                    index.removed(wire.as_int(h) for h in ev.block_hashes)
            else:
                index.clear()

    def _stored(self, ev: wire.BlockStored) -> None:
        if ev.medium not in (None, "GPU"):
            return  # an offloading tier's copy: not what the engine finds first
        if ev.group_idx not in (None, 0) or ev.kv_cache_spec_kind not in (None, "full_attention"):
            self.index.stats.hybrid = True
            return
        hashes = [wire.as_int(h) for h in ev.block_hashes]
        self.index.stored(hashes)
        self.index.stats.block_size = ev.block_size
        if ev.parent_block_hash is None and ev.lora_name is None:
            first = ev.extra_keys[0] if ev.extra_keys else None
            self.checks.append(self._check(ev.token_ids, _salt(first), hashes, ev.block_size))

    def _check(
        self, ids: list[int], salt: str | bool | None, hashes: list[int], block_size: int
    ) -> Check:
        """Recompute a parentless chain's first blocks (here, on this thread: never on the
        event loop) with sha256 and this worker's seed; a salted chain both ways vLLM has
        hashed a salt (tagged, then bare), which tells the gateway this worker's way."""
        if salt is False or block_size < 1:
            return Check(block_size, None)
        head = ids[: VERIFY_BLOCKS * block_size]
        root = hashing.none_hash(self.seed)
        for tagged in (True, False) if isinstance(salt, str) else (True,):
            extra = hashing.salt_keys(salt, tagged) if isinstance(salt, str) else None
            mine = hashing.chain(root, head, block_size, extra)
            if [hashing.external(h) for h in mine] == hashes[: len(mine)]:
                return Check(block_size, True, tagged if isinstance(salt, str) else None)
        return Check(block_size, False)

    def salt_tagged(self) -> bool:
        """How this worker hashes a cache salt, as its last salted chain showed (tagged, vLLM
        0.32, until one shows otherwise)."""
        for c in reversed(list(self.checks)):
            if c.salt_tagged is not None:
                return c.salt_tagged
        return True

    def verify(self, spec: hashing.HashSpec) -> bool | None:
        """Whether the last parentless chains this worker stored hash as ``spec`` says: False
        if any does not, None with none to tell by. Reads what this thread computed as the
        chains came (``_check``): no hashing on the caller's thread."""
        if spec.algo not in hashing.SUPPORTED_ALGOS or spec.seed != self.seed:
            return None
        verdict: bool | None = None
        for c in list(self.checks):
            if c.block_size != spec.block_size or c.matches is None:
                continue
            if not c.matches:
                return False
            verdict = True
        return verdict


def _salt(first: list[Any] | None) -> str | bool | None:
    """The first block's cache salt, when its extra keys can only be one (a single string;
    vLLM publishes them untagged); None without extra keys; ``False`` when they hold anything
    else (not checked)."""
    if first is None:
        return None
    if len(first) == 1 and isinstance(first[0], str):
        return first[0]
    return False
