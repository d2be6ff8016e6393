"""Clients that keep a gateway busy (the openai SDK, streaming) and a polling wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import openai


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 20) -> float:
    """Poll ``cond`` until true; the seconds it took (fails after ``timeout``)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


class Load:
    """``clients`` threads streaming chat completions through ``gw`` until the block ends."""

    def __init__(self, gw: str, model: str, clients: int = 6, max_tokens: int = 12) -> None:
        self.client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0, timeout=60)
        self.model, self.max_tokens = model, max_tokens
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                stream = self.client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    max_tokens=self.max_tokens,
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text, "empty answer"
                with self._lock:
                    self.ok += 1
            except Exception as e:  # every failure is the finding
                with self._lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
                time.sleep(0.2)  # a gateway that is gone refuses at once: do not spin

    def wait_for(self, n: int, timeout: float = 60) -> None:
        """``n`` more answers (or the first error)."""
        target = self.ok + n
        wait_until(lambda: self.ok >= target or bool(self.errors), f"{n} more answers", timeout)
