"""Precise prefix routing's work per request: body → token ids → block hashes → cached tokens
per worker, and what it tells the pool of placements and vLLM's answers.

Tokenizing and hashing a long prompt run on a small thread pool of their own (``threads``);
a short one (at most ``inline_chars`` characters of text in at most ``INLINE_MESSAGES``
messages) runs on the event loop, where it costs tens of microseconds: less than handing it to
a thread and waking the loop after (``bench/routing/kv_cost.py``). The index lookups after are
dictionary reads. A worker is routed precisely only
while everything its blocks' hashes depend on is known (``why_not``); otherwise the request
keeps today's affinity there, and ``/admin/workers`` and the metrics say why.

vLLM never counts a prompt's last token as cached (it must compute it for the logits): of a
prompt of ``n`` tokens at most ``(n - 1) // block_size`` blocks hit.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.routing.cached import KvPrediction
from gpupool.gateway.routing.policy import RouteRequest
from gpupool.workers.kvevents import hashing
from gpupool.workers.registry import Worker

if TYPE_CHECKING:  # both loaded only where kv routing is on (``setup.build_kv``, ``_load``)
    from gpupool.workers.kvevents.pool import KvPool
    from gpupool.workers.kvevents.render import PromptRenderer

log = logging.getLogger("gpupool.kvroute")


class KvRouting:
    def __init__(
        self, pool: KvPool, model_dirs: dict[str, str], metrics: Metrics | None = None,
        threads: int = 2, max_pending: int = 64, inline_chars: int = 2048,
    ) -> None:  # fmt: skip
        self.pool = pool
        self.metrics = metrics
        self._dirs = model_dirs  # model name → the directory its workers' vLLM reads
        self._renderers: dict[str, PromptRenderer | str] = {}  # or why there is none
        self._loading: dict[str, asyncio.Task[PromptRenderer | str]] = {}
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="gpupool-kv")
        self._pending = 0  # prompts queued or being hashed on the threads
        self.max_pending = max_pending  # past it a request routes approximately (no queue)
        self.inline_chars = inline_chars  # prompts this short are tokenized on the loop
        self.routed: dict[tuple[str, str], int] = {}  # (model, mode/reason) → requests

    @classmethod
    def from_config(cls, cfg: GpupoolConfig, pool: KvPool, metrics: Metrics | None) -> KvRouting:
        dirs: dict[str, str] = {}
        for wc in cfg.workers:
            if wc.kv_events is not None and wc.kv_events.tokenizer:
                dirs.setdefault(wc.model, wc.kv_events.tokenizer)
            elif wc.launch is not None and Path(wc.launch.model_path).is_dir():
                dirs.setdefault(wc.model, wc.launch.model_path)
        return cls(pool, dirs, metrics)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- why a worker is (not) routed precisely --------------------------------------------

    def spec(self, w: Worker) -> hashing.HashSpec | None:
        info, src = w.cache_info, w.kv_source
        if info is None or src is None or info.block_size is None:
            return None
        sub = self.pool.subscriber(w.name)
        tagged = sub.salt_tagged() if sub is not None else True  # vLLM 0.26 hashes it bare
        seed = src.seed or hashing.DEFAULT_SEED
        return hashing.HashSpec(info.block_size, info.hash_algo, seed, tagged)

    def why_not(self, w: Worker) -> str:
        """Empty when ``w`` is routed precisely; else the reason it is not."""
        return self._check(w)[0]

    def _check(self, w: Worker) -> tuple[str, hashing.HashSpec | None]:
        """Why ``w`` is not routed precisely (empty if it is) and, if it is, its hash spec."""
        spec = self.spec(w)
        reason = self._events_reason(w, spec) or self._cache_reason(w)
        if reason:
            return reason, None
        renderer = self._renderers.get(w.model)
        if isinstance(renderer, str):
            return f"no tokenizer: {renderer}", None
        if w.model not in self._dirs:
            return "no model directory for its tokenizer", None
        return "", spec

    def _events_reason(self, w: Worker, spec: hashing.HashSpec | None) -> str:
        index, sub = self.pool.index(w.name), self.pool.subscriber(w.name)
        if w.kv_source is None:
            return "no KV events from this worker"
        if index is None or sub is None:
            return "not subscribed to its KV events"
        if not index.synced:
            return f"index refilling after a resync ({index.stats.reason})"
        if index.stats.hybrid:
            return "hybrid KV cache (blocks of another size): not modelled"
        if spec is not None and sub.verify(spec) is False:
            return "its block hashes do not match the expected seed"
        return ""

    @staticmethod
    def _cache_reason(w: Worker) -> str:
        info = w.cache_info
        if info is None or info.block_size is None:
            return "vLLM's cache settings not read yet (/metrics)"
        if not info.prefix_caching:
            return "prefix caching is off"
        if info.hybrid:
            return "hybrid KV cache (blocks of another size): not modelled"
        if info.hash_algo not in hashing.SUPPORTED_ALGOS:
            return f"hash algorithm {info.hash_algo} is not supported"
        return ""

    # ---- per request -----------------------------------------------------------------------

    async def predict(
        self, route: RouteRequest, path: str, body: dict[str, Any], salt: str | None,
        workers: list[Worker],
    ) -> RouteRequest:  # fmt: skip
        """``route`` with what each precisely known worker holds of this prompt."""
        specs = self._known(workers)
        if not specs:
            self._count(route.model, "approximate: no worker is known exactly")
            return route
        renderer = await self._renderer(route.model)
        if isinstance(renderer, str):
            self._count(route.model, "approximate: no tokenizer")
            return route
        from gpupool.workers.kvevents.render import NotModelled  # loaded with the renderer

        try:
            if _short(path, body, self.inline_chars):
                ids, by_spec = _hash(renderer, path, body, salt, set(specs.values()))
            else:
                if self._pending >= self.max_pending:  # a burst: route now, not behind it
                    self._count(route.model, "approximate: tokenizer busy")
                    return route
                ids, by_spec = await self._on_threads(renderer, path, body, salt, specs)
        except NotModelled as e:
            self._count(route.model, f"approximate: {e}")
            return route
        except Exception as e:  # a template or tokenizer failing on this body: route as before
            log.warning("kv routing for %s: prompt not tokenized (%s: %s)", route.model,
                        type(e).__name__, e)  # fmt: skip
            self._count(route.model, "approximate: tokenizing failed")
            return route
        cached, hashes, placed = {}, {}, {}
        for name, spec in specs.items():
            index = self.pool.index(name)
            if index is None:
                continue
            blocks = by_spec[spec]
            found, pending = index.prefix(blocks)
            hit = min(found, max(len(ids) - 1, 0) // spec.block_size)
            cached[name], hashes[name] = hit * spec.block_size, blocks
            if pending:
                placed[name] = min(pending, hit) * spec.block_size
        self._count(route.model, "precise")
        return replace(route, kv=KvPrediction(len(ids), cached, hashes, placed))

    def _known(self, workers: list[Worker]) -> dict[str, hashing.HashSpec]:
        """The precisely known workers' hash specs (their index bounds set on the way)."""
        specs: dict[str, hashing.HashSpec] = {}
        for w in workers:
            reason, spec = self._check(w)
            if spec is not None and not reason:
                specs[w.name] = spec
                self._bound(w)
        return specs

    async def _on_threads(
        self, renderer: PromptRenderer, path: str, body: dict[str, Any], salt: str | None,
        specs: dict[str, hashing.HashSpec],
    ) -> tuple[list[int], dict[hashing.HashSpec, list[int]]]:  # fmt: skip
        loop = asyncio.get_running_loop()
        self._pending += 1
        try:
            return await loop.run_in_executor(
                self._threads, _hash, renderer, path, body, salt, set(specs.values())
            )
        finally:
            self._pending -= 1

    def _bound(self, w: Worker) -> None:
        """The index holds at most what the worker's cache can: its block count, as vLLM
        shows it, under ``max_blocks_per_worker``."""
        index, info = self.pool.index(w.name), w.cache_info
        if index is not None and info is not None and info.num_blocks:
            index.max_blocks = min(self.pool.max_blocks, info.num_blocks)

    def placed(self, route: RouteRequest, worker: str) -> None:
        """The request was placed on ``worker``: its blocks count there at once."""
        kv = route.kv
        if kv is None:
            return
        blocks = kv.hashes.get(worker)
        index = self.pool.index(worker)
        if blocks and index is not None:
            index.placed(blocks)

    def _count(self, model: str, mode: str) -> None:
        key = (model, mode)
        self.routed[key] = self.routed.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.kv_routed.labels(model, mode).inc()

    async def _renderer(self, model: str) -> PromptRenderer | str:
        found = self._renderers.get(model)
        if found is not None:
            return found
        task = self._loading.get(model)
        if task is None:
            task = self._loading[model] = asyncio.ensure_future(self._load(model))
        return await asyncio.shield(task)

    async def _load(self, model: str) -> PromptRenderer | str:
        path = self._dirs.get(model)
        result: PromptRenderer | str
        if path is None:
            result = "no model directory"
        else:
            from gpupool.workers.kvevents.render import PromptRenderer

            try:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._threads, PromptRenderer.load, path)
            except Exception as e:  # any load failure (files, JSON, template) is a reason
                result = f"{type(e).__name__}: {e}"
                log.warning("kv routing for %s: no tokenizer (%s)", model, result)
        self._renderers[model] = result
        self._loading.pop(model, None)
        return result


INLINE_MESSAGES = 8  # rendering costs per message too: more go to the threads


def _short(path: str, body: dict[str, Any], limit: int) -> bool:
    """Whether ``body``'s prompt is short enough to render and tokenize on the event loop: at
    most ``limit`` characters of text (a token list: ids) in at most ``INLINE_MESSAGES``
    messages. A shape this cannot read is not short (the threads say why it is not modelled)."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        return isinstance(prompt, (str, list)) and len(prompt) <= limit
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) > INLINE_MESSAGES:
        return False
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            part = content[0] if len(content) == 1 else None
            content = part.get("text") if isinstance(part, dict) else None
        if not isinstance(content, str):
            return False
        chars += len(content)
    return chars <= limit


def _hash(
    renderer: PromptRenderer, path: str, body: dict[str, Any], salt: str | None,
    specs: set[hashing.HashSpec],
) -> tuple[list[int], dict[hashing.HashSpec, list[int]]]:  # fmt: skip
    """On a worker thread: the prompt's token ids and its block hashes under each spec."""
    ids = renderer.prompt_ids(path, body)
    return ids, {spec: hashing.block_hashes(ids, spec, salt) for spec in specs}


def status(kv: KvRouting | None, w: Worker) -> dict[str, Any] | None:
    """``/admin/workers``' ``kv`` entry: whether the worker is routed precisely, why not, and
    what its index holds (None when KV-event routing is off)."""
    if kv is None:
        return None
    index = kv.pool.index(w.name)
    reason = kv.why_not(w)
    out: dict[str, Any] = {"precise": not reason, "reason": reason or None}
    if index is not None:
        st = index.stats
        out.update(blocks=len(index), pending=index.pending_count(), block_size=st.block_size,
                   batches=st.batches, gaps=st.gaps, replayed=st.replayed, resyncs=st.resyncs,
                   cleared=st.cleared, evicted=st.evicted, undecodable=st.undecodable)  # fmt: skip
    return out


def observe(
    kv: KvRouting, route: RouteRequest, worker: str, prompt: int, reported: int,
    moved: bool = False,
) -> None:  # fmt: skip
    """vLLM answered a precisely routed request with ``reported`` cached tokens of ``prompt``:
    how far the prediction was (``tokens_differ``: the prompt was not the one predicted, as a
    migrated request's continuation (``moved``: its usage counts the client's prompt, but the
    worker read the prompt and the tokens generated before the move); its difference says
    nothing of the prediction, so the error histogram leaves it out)."""
    pred = route.kv
    m = kv.metrics
    if pred is None or m is None or worker not in pred.cached:
        return
    predicted = pred.cached[worker]
    if moved or (prompt and prompt != pred.tokens):
        outcome = "tokens_differ"
    elif predicted == reported:
        outcome = "exact"
    else:
        outcome = "over" if predicted > reported else "under"
        log.info("kv prediction for %s on %s missed: %d cached tokens predicted (%d of them "
                 "placed by a request just before, not stored yet), %d reported, of %d",
                 route.model, worker, predicted, pred.placed.get(worker, 0), reported,
                 pred.tokens)  # fmt: skip
    m.kv_predictions.labels(route.model, worker, outcome).inc()
    if outcome != "tokens_differ":
        m.kv_prediction_error.labels(route.model).observe(abs(predicted - reported))
