"""A chat or completions stream goes on from the token ids its worker generated (migration).

A stream that may move asks its worker for ``return_token_ids`` (``asks_ids``; the pipeline
adds the flag, the relay keeps the ids and takes them out of what the client reads:
``transform/token_ids.py``). When its worker dies mid-answer, the next one reads exactly what
the first had read and written::

    the first worker's prompt ids + the ids it generated (choice 0, as the client got them)
    POST /v1/completions {prompt: those ids, return_token_ids, the request's sampling
                          parameters, seed and cache_salt, max_tokens less the ids sent}
    its text_completion chunks ── Resume (completions), AsChat (chat) ──▶ the client's stream

No text is tokenized again and no chat template renders anything: the prompt ids are vLLM's
own rendering, the generated ids its own tokens, so a greedy answer goes on as the
uninterrupted one does. Without ids (a worker that returned none: an older vLLM, a backend
that is not vLLM) the answer goes on from its text as before (``transform/continuation.py``,
``continue_completion.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from gpupool.gateway.pipeline.continue_completion import (
    AsChat,
    completion_body,
    send_completion,
    text_only,
)
from gpupool.gateway.pipeline.dispatch import Dispatcher
from gpupool.gateway.pipeline.exchange import Exchange
from gpupool.gateway.transform.continuation import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Progress,
    Resume,
    refusal,
)
from gpupool.gateway.transform.token_ids import FLAG
from gpupool.workers.registry import Registry

Json = dict[str, Any]
log = logging.getLogger("gpupool.migrate")

NO_LIMIT_CAP = 1 << 20  # ids kept for a chat that names no limit (vLLM's: the window)


def ids_cap(body: Json, chat: bool) -> int:
    """The most ids a stream of ``body`` keeps (its output limit), or 0: it does not ask
    for them. Asked where the ids can continue it: what ``refusal`` lets continue, a chat of
    text messages that offers no tools (token ids carry no image; a completion's text is not
    parsed into tool calls), and no stop strings (vLLM holds back the text that may begin one
    while its ids go out: that text would be lost at the cut)."""
    if refusal(body, chat) is not None or body.get("stop") or (chat and not text_only(body)):
        return 0
    limit = _limit(body)
    if isinstance(limit, int) and limit > 0:
        return limit
    return NO_LIMIT_CAP if chat else COMPLETIONS_DEFAULT_MAX_TOKENS


def ids_body(origin: Json, chat: bool, ids: list[int], sent: int, room: int) -> Json | None:
    """The completion that goes on after ``ids`` (the prompt's and the ``sent`` generated);
    ``room``: the window left after them. None when no token is left to generate."""
    src = origin
    if not chat and not isinstance(origin.get("max_tokens"), int):
        src = {**origin, "max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS}
    out = completion_body(src, ids, sent, room)
    if out is not None:
        out[FLAG] = True  # a further move goes on from the ids too
        out.pop("truncate_prompt_tokens", None)  # the ids are the prompt the first one read
    return out


def _limit(body: Json) -> object:
    return body.get("max_completion_tokens") or body.get("max_tokens")


class IdsContinuation:
    """Opens a stream's continuation from its token ids on the exchange's (new) worker."""

    def __init__(self, dispatcher: Dispatcher, registry: Registry) -> None:
        self.dispatcher = dispatcher
        self.registry = registry

    async def open(self, ex: Exchange, origin: Json, progress: Progress) -> Resume | bytes:
        """Send the completion (``ex.resp`` set): its rewriter, or why not (the worker's
        answer or the gateway's words: the caller goes on from the text instead)."""
        plan, ids = ex.plan, progress.token_ids
        assert ids is not None and ids.prompt is not None
        worker = self.registry.get(ex.worker)
        window = worker.window if worker is not None else None
        prompt = ids.ids()
        limited = not progress.chat or isinstance(_limit(origin), int)
        if window is None and not limited:
            return b"the worker's window is not known (a chat without a limit)"
        room = (window or len(prompt) + NO_LIMIT_CAP) - len(prompt)
        body = ids_body(origin, progress.chat, prompt, progress.sent, room)
        if body is None:
            return b"no room left in the window"
        data = await send_completion(self.dispatcher, ex, body)
        if data is not None:
            return data
        log.warning("request %s: continued on worker %s from %d prompt and %d generated "
                    "token ids", plan.ctx.request_id, ex.worker, len(ids.prompt),
                    len(ids.generated))  # fmt: skip
        if progress.chat:
            return AsChat(progress, len(ids.prompt))
        return Resume(progress, len(ids.prompt))
