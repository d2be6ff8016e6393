"""vLLM's sleep-mode endpoints, served with ``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``.

The gateway never proxies these paths (only the routes in ``pipeline/kinds.py`` reach a
worker); this module is the only code that calls them.

Level 1 moves the weights to host RAM and drops the KV cache; a wake copies them back. Level 2
drops both; a wake allocates the weights again, reloads them (``reload_weights`` through
``/collective_rpc``), then allocates the KV cache, whose prefix cache is reset.
``mode=wait`` has vLLM finish what it runs before sleeping (requests from outside the gateway);
the gateway's own have finished by then. ``mode=keep`` (a switch's pause, ``swap.pause_after_s``)
keeps what it runs: vLLM pauses its scheduler, preempts the running requests (their KV cache is
dropped; they go back to its waiting queue, to be recomputed from their prompt and the tokens made
so far), then sleeps; their HTTP streams stay open, and the wake resumes them.
"""

from __future__ import annotations

import aiohttp
import orjson


class SleepCallFailed(Exception):
    """A sleep-mode call failed: the message says which and why."""


async def _post(
    session: aiohttp.ClientSession, url: str, timeout_s: float, body: bytes | None = None
) -> bytes:
    headers = {"content-type": "application/json"} if body is not None else None
    what = "POST " + url.rpartition("/")[2]
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            text = await r.read()
            if r.status != 200:
                detail = text[:300].decode("utf-8", "replace")
                raise SleepCallFailed(
                    f"POST {url.rpartition('/')[2]} answered {r.status}: {detail}"
                )
            return text
    except TimeoutError:  # (before OSError, its base; aiohttp's own timeouts derive from it)
        raise SleepCallFailed(f"{what}: no answer in {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as e:
        raise SleepCallFailed(f"{what}: {type(e).__name__}: {e}") from None


async def sleep(
    session: aiohttp.ClientSession, url: str, level: int, timeout_s: float, keep: bool = False
) -> None:
    """``keep``: pause (keep) the running requests rather than wait for them."""
    mode = "keep" if keep else "wait"
    await _post(session, f"{url}/sleep?level={level}&mode={mode}", timeout_s)


async def wake(session: aiohttp.ClientSession, url: str, level: int, timeout_s: float) -> None:
    if level < 2:
        await _post(session, f"{url}/wake_up", timeout_s)
        return
    await _post(session, f"{url}/wake_up?tags=weights", timeout_s)
    await _post(session, f"{url}/collective_rpc", timeout_s, b'{"method":"reload_weights"}')
    await _post(session, f"{url}/wake_up?tags=kv_cache", timeout_s)
    await _post(session, f"{url}/reset_prefix_cache", timeout_s)


async def is_sleeping(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool | None:
    """What ``/is_sleeping`` says; None when it cannot be read (no sleep mode, unreachable)."""
    try:
        async with session.get(
            f"{url}/is_sleeping", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            if r.status != 200:
                return None
            body = orjson.loads(await r.read())
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError):
        return None
    value = body.get("is_sleeping") if isinstance(body, dict) else None
    return value if isinstance(value, bool) else None
