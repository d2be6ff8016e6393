"""A rerank's key budget counts every pair: the worker reads the query once per document, so a
key's ``tpm`` reserves it that often (in-process pipeline, a fake worker that holds the answer
while the reservation is read); the reservation is settled when it ends."""

from __future__ import annotations

import asyncio
import hashlib

import orjson

from gpupool.config.models import GpupoolConfig
from gpupool.gateway.admission.memory import MemoryAdmission
from gpupool.gateway.catalog import Catalog
from gpupool.gateway.incoming import Incoming
from gpupool.gateway.metrics import Metrics
from gpupool.gateway.pipeline.kinds import KINDS
from gpupool.gateway.pipeline.pipeline import Pipeline
from gpupool.gateway.routing.policy import Router
from gpupool.gateway.security.keys import KeyStore
from gpupool.gateway.security.limits import KeyLimits
from gpupool.gateway.services import RegistryView
from gpupool.workers.registry import Registry, Worker, WorkerState
from tests.gateway.test_pipeline import FakePath, FakeResponse

MODEL, KEY = "m", "sk-budget"


async def test_a_reranks_query_is_reserved_once_per_document() -> None:
    cfg = GpupoolConfig.model_validate({
        "models": [{"name": MODEL}],
        "workers": [{"name": "w", "model": MODEL, "url": "http://w"}],
        "auth": {"enabled": True, "keys": [
            {"name": "k", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tpm": 10**8}]},
    })  # fmt: skip
    registry = Registry()
    worker = Worker(name="w", model=MODEL, url="http://w", capacity=4, max_model_len=32768)
    worker.set_state(WorkerState.ready)
    registry.add(worker)
    arrived, release = asyncio.Event(), asyncio.Event()

    async def answer(url: str, body: bytes) -> FakeResponse:
        arrived.set()
        await release.wait()
        usage = {"prompt_tokens": 200 * 1001, "total_tokens": 200 * 1001}
        return FakeResponse(body=orjson.dumps({"results": [], "usage": usage}))

    limits = KeyLimits()
    admission = MemoryAdmission.from_config(cfg.queue, RegistryView(registry), "r")
    pipeline = Pipeline(cfg, registry, Catalog(cfg.models), Router(), admission,
                        FakePath(answer), Metrics(), limits)  # fmt: skip
    principal = KeyStore(cfg.auth).identify(KEY)
    query = "q" * 4000  # about 1,000 tokens, read with each of the 200 documents
    raw = orjson.dumps({"model": MODEL, "query": query, "documents": ["doc"] * 200})
    incoming = Incoming("rid", [(b"authorization", f"Bearer {KEY}".encode())], principal)
    task = asyncio.create_task(pipeline.handle(KINDS["/rerank"], incoming, raw))
    at_worker = asyncio.create_task(arrived.wait())  # there, the key's hold is taken
    await asyncio.wait({task, at_worker}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    assert at_worker.done(), task.exception() if task.done() else "it never reached the worker"
    reserved = await limits.reserved("k")
    assert reserved >= 200 * 1000, reserved  # not len(raw) / 4 (about 1,150)
    release.set()
    reply = await task
    assert reply.after is not None
    await reply.after()
    assert await limits.in_use("k") == 0 and await limits.reserved("k") == 0  # settled
