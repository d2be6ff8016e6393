"""A KV-event publisher speaking vLLM's protocol (``ZmqEventPublisher``): PUB of
``(topic, seq, payload)`` and a ROUTER replay socket answering ``[b"", start_seq]`` with every
buffered batch from it on and then ``seq = -1``. Its replay side runs in a thread. The
simulator publishes with it; tests drive it to make gaps (``send=False``) and restarts."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import zmq

from gpupool.workers.kvevents import wire


class KvPublisher:
    def __init__(
        self, endpoint: str, replay: str | None, buffer_steps: int = 100, topic: str = ""
    ) -> None:
        self.topic = topic.encode()
        self._ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(endpoint)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay is not None:
            self.router = self._ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(replay)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def publish(self, *events: wire.Event, send: bool = True) -> int:
        """Buffer one batch and (unless ``send`` is False: a lost message) send it."""
        payload = wire.encode(wire.EventBatch(0.0, list(events), 0))
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if send:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As a new vLLM process: the sequence starts at 0 and the buffer is empty."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in batches:
                self.router.send_multipart([client, b"", self.topic, s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True),
                                        b""])  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.router.close(0)
        self.pub.close(0)
        self._ctx.term()
