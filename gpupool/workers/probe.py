"""Probes of one vLLM server: health, model card, and the few metrics routing uses.

Shared by the remote poller (``url:`` workers) and the supervisor (``launch:`` workers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import aiohttp
import orjson

_WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(slots=True)
class ProbeResult:
    healthy: bool
    serves_model: bool = False
    max_model_len: int | None = None
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.healthy and self.serves_model


@dataclass(slots=True, frozen=True)
class CacheInfo:
    """vLLM's cache settings from its ``vllm:cache_config_info`` labels: what precise prefix
    routing must share with the worker to name its blocks."""

    block_size: int | None
    hash_algo: str
    prefix_caching: bool
    num_blocks: int | None
    hybrid: bool  # a second kind of cache (Mamba state): blocks hash at another size

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> CacheInfo:
        def number(key: str) -> int | None:  # a positive whole number, else unknown
            value = labels.get(key, "")
            n = int(value) if value.isascii() and value.isdigit() else 0
            return n if n > 0 else None

        hybrid = labels.get("mamba_block_size", "None") != "None" or (
            labels.get("hash_block_size", "None") not in ("None", labels.get("block_size"))
        )
        return cls(number("block_size"), labels.get("prefix_caching_hash_algo", "sha256"),
                   labels.get("enable_prefix_caching") == "True", number("num_gpu_blocks"),
                   hybrid)  # fmt: skip


@dataclass(slots=True)
class VllmLoad:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    cache: CacheInfo | None = None


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


# Only the gauges routing reads. vLLM serves /metrics with prometheus_client, which renders just
# the families named by ``name[]`` (under the mount's own path, ``/metrics/``): on vLLM's CPU build
# about 0.5 KB in 1 ms instead of about 50 KB in 7 ms, time the worker's API server would
# otherwise spend every scrape period, and text the gateway would parse. A server that ignores the
# filter sends everything, which reads the same.
FILTERED_METRICS = "/metrics/?" + "&".join(f"name[]={name}" for name in [*_WANTED, _CACHE_INFO])


async def scrape_load(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float = 2.0,
    unfiltered: set[str] | None = None,
) -> VllmLoad | None:
    """The worker's load from its metrics, asked for the few gauges routing reads; a worker
    that refuses that path (a non-200 where the plain ``/metrics`` answers) is added to
    ``unfiltered`` and asked for everything from then on."""
    if unfiltered is None or url not in unfiltered:
        status, text = await _get_text(session, url + FILTERED_METRICS, timeout_s)
        if text is not None:
            return parse_load(text)
        if status is None:
            return None  # unreachable: nothing learned about the path
    status, text = await _get_text(session, url + "/metrics", timeout_s)
    if text is None:
        return None
    if unfiltered is not None:
        unfiltered.add(url)
    return parse_load(text)


async def _get_text(
    session: aiohttp.ClientSession, url: str, timeout_s: float
) -> tuple[int | None, str | None]:
    """(status, body) of a GET; body None unless 200; status None when it failed outright."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return r.status, None
            return r.status, await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
        return None, None


def parse_load(text: str) -> VllmLoad:
    """Sum the wanted gauges over label sets (one engine per worker in practice)."""
    load = VllmLoad()
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name == _CACHE_INFO:
            load.cache = CacheInfo.from_labels(_labels(rest.rpartition("}")[0]))
            continue
        attr = _WANTED.get(name)
        if attr is None:
            continue
        try:
            value = float(rest.rpartition("}")[2].split()[0])
        except (IndexError, ValueError):
            continue
        setattr(load, attr, getattr(load, attr) + value)
    return load


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _labels(text: str) -> dict[str, str]:
    return dict(_LABEL.findall(text))
