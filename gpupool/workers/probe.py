"""Probes of one vLLM server: health, model card, and the few metrics routing uses.

Shared by the remote poller (``url:`` workers) and the supervisor (``launch:`` workers).
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import orjson

_WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(slots=True)
class ProbeResult:
    healthy: bool
    serves_model: bool = False
    max_model_len: int | None = None
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.healthy and self.serves_model


@dataclass(slots=True)
class VllmLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0


async def probe(
    session: aiohttp.ClientSession, url: str, model: str, timeout_s: float = 5.0
) -> ProbeResult:
    """Ready means `/health` answers 200 and `/v1/models` lists ``model``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with session.get(f"{url}/health", timeout=timeout) as r:
            if r.status != 200:
                return ProbeResult(False, error=f"/health answered {r.status}")
        async with session.get(f"{url}/v1/models", timeout=timeout) as r:
            if r.status != 200:
                return ProbeResult(True, error=f"/v1/models answered {r.status}")
            body = orjson.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return ProbeResult(False, error=f"{type(e).__name__}: {e}".strip())
    except orjson.JSONDecodeError:
        return ProbeResult(True, error="/v1/models returned invalid JSON")
    return _read_cards(body, model)


def _read_cards(body: object, model: str) -> ProbeResult:
    cards = body.get("data") if isinstance(body, dict) else None
    for card in cards if isinstance(cards, list) else []:
        if isinstance(card, dict) and card.get("id") == model:
            mml = card.get("max_model_len")
            return ProbeResult(True, True, mml if isinstance(mml, int) else None)
    return ProbeResult(True, False, error=f"/v1/models does not list `{model}`")


async def scrape_load(
    session: aiohttp.ClientSession, url: str, timeout_s: float = 2.0
) -> VllmLoad | None:
    try:
        async with session.get(
            f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
        return None
    return parse_load(text)


def parse_load(text: str) -> VllmLoad:
    """Sum the wanted gauges over label sets (one engine per worker in practice)."""
    load = VllmLoad()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        attr = _WANTED.get(name)
        if attr is None:
            continue
        try:
            value = float(rest.rpartition("}")[2].split()[0])
        except (IndexError, ValueError):
            continue
        setattr(load, attr, getattr(load, attr) + value)
    return load
