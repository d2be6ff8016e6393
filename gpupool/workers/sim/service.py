"""The simulator's endpoints as plain methods: bytes and :class:`Meta` in, a reply out.

Transport lives in ``app.py``; nothing here knows about ASGI.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from gpupool.workers.sim import messages, render, responses
from gpupool.workers.sim.batching import StepEngine
from gpupool.workers.sim.config import VLLM_VERSION, SimConfig
from gpupool.workers.sim.engine import Engine
from gpupool.workers.sim.errors import BadRequest, InvalidBody, SimError
from gpupool.workers.sim.faults import Knobs
from gpupool.workers.sim.jobs import JobBuilder, Meta
from gpupool.workers.sim.metrics import CONTENT_TYPE
from gpupool.workers.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    parse_body,
)
from gpupool.workers.sim.reasoning import split_all
from gpupool.workers.sim.serving import (
    ChatFormat,
    TextFormat,
    chat_body,
    completion_body,
    run_full,
    stream,
)
from gpupool.workers.sim.stored import ResponseStore
from gpupool.workers.sim.text import TextSource
from gpupool.workers.sim.tokenize import Tokenizer, UnknownTokenId, render_chat

if TYPE_CHECKING:
    from gpupool.workers.sim.kvevents import SimKvEvents

JSON = b"application/json"
METRICS_CONTENT_TYPE = CONTENT_TYPE.encode()


@dataclass(slots=True)
class JsonReply:
    status: int
    body: bytes
    content_type: bytes | None = JSON


@dataclass(slots=True)
class StreamReply:
    chunks: AsyncGenerator[bytes, None]


Reply = JsonReply | StreamReply


def _kv_events(config: SimConfig) -> SimKvEvents | None:
    """``kvevents.py`` (ZeroMQ, Jinja, tokenizers) is imported only where KV events are asked
    for: 0.04 s of CPU less at every other simulator's start."""
    if not config.kv_events_config:
        return None
    from gpupool.workers.sim.kvevents import sim_kv_events

    return sim_kv_events(config)


def _ok(payload: Any) -> JsonReply:
    return JsonReply(200, orjson.dumps(payload))


class SimService:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.knobs = Knobs.from_config(config)
        self.tokenizer = Tokenizer()
        engine = Engine if config.gpu is None else StepEngine
        self.engine = engine(config, self.knobs)
        self.kv = _kv_events(config)  # KV-cache events (``kvevents.py``), or None
        if self.kv is not None:
            self.engine.cache.events = self.kv
            self.engine.metrics.cache_info = self.kv.cache_info(self.engine.cache.num_blocks)
        self.jobs = JobBuilder(config, self.tokenizer, TextSource(config, self.tokenizer))
        self.stored = ResponseStore()

    # -- generation -------------------------------------------------------------------------

    def blocking(self, meta: Meta) -> bool:
        """Whether a generation request may wait (so a disconnect must be watched for)."""
        return self.engine.would_block(meta.hold_s)

    async def chat(self, body: bytes, meta: Meta) -> Reply:
        await self._arrive()
        req = parse_body(body, ChatRequest, meta.media_ok)
        job = self.jobs.chat(req, meta)
        if self.kv is not None:
            job.admission.blocks = self.kv.blocks("/v1/chat/completions", body)
        self._maybe_fail()
        if req.stream:
            return StreamReply(stream(self.engine, self.knobs, job, ChatFormat(job)))
        await run_full(self.engine, job)
        return JsonReply(200, chat_body(job))

    async def messages(self, body: bytes, meta: Meta) -> Reply:
        """vLLM's Anthropic ``/v1/messages``, over :meth:`chat` (``messages.py``)."""
        req = messages.parse_messages(body, meta)
        parser = self.config.reasoning_parser is not None
        try:
            chat = messages.chat_request(req, parser)
        except messages.BudgetRefused as e:
            if req.stream:  # vLLM refuses it only inside the stream
                return StreamReply(messages.refused_stream())
            return JsonReply(e.status, messages.error_body(e.status, e.to_json()))
        try:
            reply = await self.chat(orjson.dumps(chat), meta)
        except SimError as e:
            return JsonReply(e.status, messages.error_body(e.status, e.to_json()))
        if isinstance(reply, StreamReply):
            return StreamReply(messages.message_events(reply.chunks))
        if reply.status != 200:
            return JsonReply(reply.status, messages.error_body(reply.status, reply.body))
        return JsonReply(200, messages.message_body(orjson.loads(reply.body)))

    async def count_tokens(self, body: bytes, meta: Meta) -> Reply:
        """vLLM's ``/v1/messages/count_tokens``: the chat prompt's tokens."""
        req = messages.parse_count(body, meta)
        try:
            self.jobs.check_model(req.model)
        except SimError as e:
            return JsonReply(e.status, messages.error_body(e.status, e.to_json()))
        ids = self.tokenizer.encode(render_chat(messages.chat_messages(req), True, False))
        n = len(ids)
        return _ok({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    async def completions(self, body: bytes, meta: Meta) -> Reply:
        await self._arrive()
        req = parse_body(body, CompletionRequest, meta.media_ok)
        job = self.jobs.completion(req, meta)
        if self.kv is not None:
            job.admission.blocks = self.kv.blocks("/v1/completions", body)
        self._maybe_fail()
        if req.stream:
            return StreamReply(stream(self.engine, self.knobs, job, TextFormat(job)))
        await run_full(self.engine, job)
        return JsonReply(200, completion_body(job))

    async def responses(self, body: bytes, meta: Meta) -> Reply:
        await self._arrive()
        req = parse_body(body, ResponsesRequest, meta.media_ok)
        self.stored.check_previous(req.previous_response_id)
        fields: dict[str, Any] = {"model": req.model, "messages": _responses_messages(req),
                                  "max_tokens": req.max_output_tokens}  # fmt: skip
        if req.stream:  # vLLM's Responses events over the chat stream (``responses.py``)
            fields.update(stream=True, stream_options={"include_usage": True})
        chat = ChatRequest.model_validate(fields)
        job = self.jobs.chat(chat, meta)
        self._maybe_fail()
        if req.stream:
            rid = req.request_id or "resp_" + job.response_id.removeprefix("chatcmpl-")

            def keep(body: bytes) -> None:
                self.stored.keep(rid, body, req.store is not False)

            chunks = stream(self.engine, self.knobs, job, ChatFormat(job))
            return StreamReply(responses.response_events(chunks, rid, keep))
        await run_full(self.engine, job)
        out = job.outputs[0]
        if job.thinking is None:
            text: tuple[str | None, str | None] = (None, "".join(out.pieces))
            reasoning_tokens = 0
        else:
            reasoning, content, reasoning_tokens = split_all(out.pieces, job.thinking)
            text = (reasoning, content)
        rid = req.request_id or "resp_" + job.response_id.removeprefix("chatcmpl-")
        tokens = (job.prompt_tokens, job.generated, reasoning_tokens)
        body = render.responses_body(rid, job.created, job.model, text, out.finish_reason, tokens)
        self.stored.keep(rid, body, req.store is not False)
        return JsonReply(200, body)

    async def _arrive(self) -> None:
        self.engine.stats.requests_total += 1
        await self.knobs.wait_unhung()

    def _maybe_fail(self) -> None:
        if self.knobs.should_fail():
            self.engine.metrics.success["error"] += 1
            raise SimError()

    # -- serving information ----------------------------------------------------------------

    async def health(self, body: bytes, meta: Meta) -> Reply:
        await self.knobs.wait_unhung()
        return JsonReply(503 if self.knobs.health_fail else 200, b"", None)

    async def version(self, body: bytes, meta: Meta) -> Reply:
        return _ok({"version": VLLM_VERSION})

    async def load(self, body: bytes, meta: Meta) -> Reply:
        return _ok({"server_load": 0})  # vLLM counts only with --enable-server-load-tracking

    async def models(self, body: bytes, meta: Meta) -> Reply:
        now = int(time.time())
        cfg = self.config
        cards = [
            render.model_card(
                name, cfg.root, cfg.max_model_len, now, "modelperm-" + secrets.token_hex(8)
            )
            for name in cfg.served_names
        ]
        return _ok({"object": "list", "data": cards})

    async def metrics(self, body: bytes, meta: Meta) -> Reply:
        return JsonReply(200, self.engine.metrics.render(), METRICS_CONTENT_TYPE)

    async def tokenize(self, body: bytes, meta: Meta) -> Reply:
        req = parse_body(body, TokenizeRequest, meta.media_ok)
        self.jobs.check_model(req.model)
        if req.messages is not None:
            text = render_chat(req.messages, req.add_generation_prompt, req.continue_final_message)
        else:
            text = req.prompt or ""
        ids = self.tokenizer.encode(text)
        strs = [self.tokenizer.piece_of(i) for i in ids] if req.return_token_strs else None
        return _ok(
            {
                "count": len(ids),
                "max_model_len": self.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, body: bytes, meta: Meta) -> Reply:
        req = parse_body(body, DetokenizeRequest, meta.media_ok)
        self.jobs.check_model(req.model)
        try:
            return _ok({"prompt": self.tokenizer.decode(req.tokens)})
        except UnknownTokenId as exc:
            raise BadRequest(str(exc), param="tokens") from None

    # -- test control -----------------------------------------------------------------------

    async def sim_stats(self, body: bytes, meta: Meta) -> Reply:
        return _ok(self.engine.stats_payload())

    async def sim_control(self, body: bytes, meta: Meta) -> Reply:
        try:
            changes = orjson.loads(body or b"{}")
        except orjson.JSONDecodeError as exc:
            raise InvalidBody.json_invalid(exc.pos, exc.msg) from None
        if not isinstance(changes, dict):
            raise BadRequest("The control body must be a JSON object.")
        self.knobs.update(changes)
        return _ok(self.knobs.snapshot())

    async def reset_prefix_cache(self, body: bytes, meta: Meta) -> Reply:
        """vLLM's ``POST /reset_prefix_cache`` (served with ``VLLM_SERVER_DEV_MODE=1``)."""
        self.engine.cache.clear()
        return JsonReply(200, b"", None)

    async def sim_reset(self, body: bytes, meta: Meta) -> Reply:
        self.engine.reset_stats()
        return _ok(self.engine.stats_payload())


def _responses_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        messages.extend(m for m in req.input if "role" in m)
    return messages
