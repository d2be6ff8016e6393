"""Warm-up requests and the liveness check a supervised worker gets.

Warm-up matters because Triton autotunes each kernel shape on first use (seed 000): text,
several image sizes and multi-image prompts each reach different shapes, and running them
before traffic (ideally on the largest card, whose cache smaller cards of the same
architecture reuse) keeps the autotuner's scratch memory away from live requests.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib
from typing import Any

import aiohttp

from gpupool.config.models import WarmupItem

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MAX_SIDE = 8192


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def png_bytes(width: int, height: int) -> bytes:
    """A valid 8-bit RGB PNG of ``width`` x ``height`` (a vertical gradient), without Pillow."""
    if not (0 < width <= _MAX_SIDE and 0 < height <= _MAX_SIDE):
        raise ValueError(f"image size {width}x{height} is outside 1..{_MAX_SIDE}")
    rows = b"".join(b"\x00" + bytes((y % 256, 96, 255 - y % 256)) * width for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        _PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(rows, 6))
        + _chunk(b"IEND", b"")
    )


def png_data_uri(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height)).decode()


def _image_part(size: list[int]) -> dict[str, Any]:
    if len(size) != 2:
        raise ValueError(f"image size {size} is not [width, height]")
    return {"type": "image_url", "image_url": {"url": png_data_uri(size[0], size[1])}}


def warmup_body(model: str, item: WarmupItem) -> dict[str, Any]:
    """A chat completion request for one warm-up item (blocking: images are encoded here)."""
    content: list[dict[str, Any]] = []
    if item.prompt:
        content.append({"type": "text", "text": item.prompt})
    content += [_image_part(size) for size in item.images]
    if not content:
        content.append({"type": "text", "text": "Hello"})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": item.max_tokens,
        "temperature": 0,
    }


async def send_warmup(
    session: aiohttp.ClientSession, url: str, model: str, item: WarmupItem, timeout_s: float
) -> str | None:
    """Send one warm-up request; return None on success, else what went wrong."""
    try:
        body = await asyncio.to_thread(warmup_body, model, item)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status == 200:
                await r.read()
                return None
            text = (await r.text(errors="replace"))[:300]
            return f"answered {r.status}: {text}"
    except ValueError as e:
        return str(e)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return f"{type(e).__name__}: {e}".strip().rstrip(":")


async def health_ok(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """``GET /health`` answered 200 within ``timeout_s``."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{url}/health", timeout=timeout) as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
