"""A fake vLLM worker for precise prefix routing tests: ready, shows vLLM's
``vllm:cache_config_info`` (block size 128, sha256, prefix caching on) on ``/metrics``, answers
chat and completions with a fixed reply that reports 0 cached tokens; the test publishes its
KV-cache events through a :class:`KvPublisher` (vLLM's wire format and replay protocol)."""

from __future__ import annotations

import json
from typing import Any

CACHE_INFO = (
    'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",'
    'hash_block_size="None",mamba_block_size="None",num_gpu_blocks="1000",'
    'prefix_caching_hash_algo="sha256"} 1.0\n'
)


class KvWorker:
    """An ASGI app; ``served`` counts the generation requests it answered."""

    def __init__(self, model: str = "m", window: int = 4096) -> None:
        self.model, self.window = model, window
        self.served = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        path = scope["path"]
        if path == "/health":
            await _reply(send, 200, b"", "text/plain")
        elif path == "/v1/models":
            card = {"id": self.model, "object": "model", "max_model_len": self.window}
            await _reply(send, 200, json.dumps({"object": "list", "data": [card]}).encode())
        elif path.startswith("/metrics"):
            await _reply(send, 200, CACHE_INFO.encode(), "text/plain; version=0.0.4")
        elif path in ("/v1/chat/completions", "/v1/completions"):
            self.served += 1
            await _reply(send, 200, json.dumps(self._answer(path)).encode())
        else:
            await _reply(send, 404, b'{"error": "not found"}')

    def _answer(self, path: str) -> dict[str, Any]:
        # no prompt count (the gateway's prediction is compared with cached_tokens alone)
        usage = {"prompt_tokens": 0, "total_tokens": 1, "completion_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        if path == "/v1/completions":
            choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length"}
        else:
            msg = {"role": "assistant", "content": "x"}
            choice = {"index": 0, "message": msg, "finish_reason": "length"}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [choice], "usage": usage}  # fmt: skip


async def _reply(send: Any, status: int, body: bytes, ctype: str = "application/json") -> None:
    headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
