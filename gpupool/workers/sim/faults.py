"""Fault and timing knobs that tests change while the simulator runs."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field
from typing import Any

from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.errors import BadRequest


@dataclass(slots=True)
class Knobs:
    """The live values; ``POST /sim/control`` updates them through :meth:`update`."""

    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    fail_rate: float = 0.0
    hang: bool = False
    health_fail: bool = False
    crash_after_tokens: int | None = None
    rng: random.Random = field(default_factory=random.Random)
    _unhung: asyncio.Event | None = None

    @classmethod
    def from_config(cls, config: SimConfig) -> Knobs:
        return cls(
            ttft_ms=config.ttft_ms,
            itl_ms=config.itl_ms,
            fail_rate=config.fail_rate,
            hang=config.hang,
            health_fail=config.health_fail,
            crash_after_tokens=config.crash_after_tokens,
            rng=random.Random(config.seed),
        )

    def should_fail(self) -> bool:
        return self.fail_rate > 0.0 and self.rng.random() < self.fail_rate

    async def wait_unhung(self) -> None:
        """Return at once unless ``hang`` is on; then wait until it is switched off."""
        while self.hang:
            if self._unhung is None:
                self._unhung = asyncio.Event()
            await self._unhung.wait()

    def check_crash(self, emitted_tokens: int) -> None:
        """Kill the process, as a GPU fault would, once a stream emitted enough tokens."""
        limit = self.crash_after_tokens
        if limit is not None and emitted_tokens >= limit:
            os._exit(1)

    def update(self, changes: dict[str, Any]) -> None:
        for key, value in changes.items():
            _set_knob(self, key, value)
        if not self.hang and self._unhung is not None:
            self._unhung.set()
            self._unhung = None

    def snapshot(self) -> dict[str, Any]:
        return {
            "ttft_ms": self.ttft_ms,
            "itl_ms": self.itl_ms,
            "fail_rate": self.fail_rate,
            "hang": self.hang,
            "health_fail": self.health_fail,
            "crash_after_tokens": self.crash_after_tokens,
        }


_NUMBERS = ("ttft_ms", "itl_ms", "fail_rate")
_FLAGS = ("hang", "health_fail")


def _set_knob(knobs: Knobs, key: str, value: Any) -> None:
    if key in _NUMBERS and isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0 or (key == "fail_rate" and value > 1):
            raise BadRequest(f"{key} out of range", param=key, value=value)
        setattr(knobs, key, float(value))
    elif key in _FLAGS and isinstance(value, bool):
        setattr(knobs, key, value)
    elif key == "crash_after_tokens" and (value is None or _is_count(value)):
        knobs.crash_after_tokens = value
    else:
        raise BadRequest(f"Unknown knob or bad value for {key!r}", param=key, value=value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
