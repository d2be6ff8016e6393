"""A ``url:`` worker's event source from its configuration, ``{host}`` filled per address."""

from __future__ import annotations

from gpupool.config.models import WorkerConfig
from gpupool.gateway.kvroute.setup import kv_source


def _wc(url: str, **kv: str) -> WorkerConfig:
    return WorkerConfig.model_validate({"name": "w", "model": "m", "url": url, "kv_events": kv})


def test_host_is_the_workers_own() -> None:
    wc = _wc("http://10.0.0.7:8000", endpoint="tcp://{host}:5557",
             replay_endpoint="tcp://{host}:5558", hash_seed="0")  # fmt: skip
    src = kv_source(wc)
    assert src is not None
    assert (src.endpoint, src.replay, src.seed) == (
        "tcp://10.0.0.7:5557",
        "tcp://10.0.0.7:5558",
        "0",
    )
    v6 = kv_source(_wc("http://[fd00::7]:8000", endpoint="tcp://{host}:5557"))
    assert v6 is not None and v6.endpoint == "tcp://[fd00::7]:5557"


def test_no_kv_events_no_source() -> None:
    wc = WorkerConfig.model_validate({"name": "w", "model": "m", "url": "http://h:1"})
    assert kv_source(wc) is None
