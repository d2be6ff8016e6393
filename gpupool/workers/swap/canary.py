"""The canary of a level-2 wake: one fixed greedy prompt whose answer, recorded while the worker
was known good, must come back the same before the woken worker takes requests.

A level-2 wake reallocates the weights and reloads them (``reload_weights``); where that reload
is not right the worker answers 200 with garbage (vllm#29341: two RTX PRO 6000, PR #54235), and
nothing but an answer shows it. The prompt is short and greedy (temperature 0, a seed), with few
tokens, so that batch composition cannot move it on a correct worker; a mismatch (or no answer)
is a broken wake: ``group.py`` restarts a launched worker, puts a ``url:`` one back to sleep.
"""

from __future__ import annotations

import aiohttp
import orjson

PROMPT = "The first five prime numbers are 2, 3,"
MAX_TOKENS = 8
_LIMIT = 64 << 10  # a completion of 8 tokens is far smaller


class CanaryFailed(Exception):
    """The canary got no usable answer: the message says why."""


async def ask(session: aiohttp.ClientSession, url: str, model: str, timeout_s: float) -> str:
    """The worker's answer to the canary prompt (its ``choices[0].text``)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "seed": 0, "stream": False}  # fmt: skip
    try:
        async with session.post(
            f"{url}/v1/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as r:
            raw = await _body(r.content)
            if r.status != 200:
                raise CanaryFailed(f"the canary answered {r.status}")
    except TimeoutError:
        raise CanaryFailed(f"the canary had no answer in {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError) as e:
        raise CanaryFailed(f"the canary failed: {type(e).__name__}: {e}") from None
    try:
        text = orjson.loads(raw)["choices"][0]["text"]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        raise CanaryFailed("the canary's answer is not a completion") from None
    if not isinstance(text, str):
        raise CanaryFailed("the canary's answer is not a completion")
    return text


async def _body(content: aiohttp.StreamReader) -> bytes:
    """The body to its end, at most ``_LIMIT`` bytes (``read(n)`` alone returns what has come
    so far: a body in two packets would read as half a completion)."""
    raw = b""
    while len(raw) < _LIMIT:
        chunk = await content.read(_LIMIT - len(raw))
        if not chunk:
            break
        raw += chunk
    return raw
