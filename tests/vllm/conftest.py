"""The real-vLLM stacks: each starts once per session, however many files use it.

* ``real_stack``: one `gpupool serve` supervising two real vLLM (CPU) workers of two models.
* ``conformance``: ``test_conformance.py``'s gateway and workers (``tiny-p`` with vLLM's parsers,
  ``tiny`` without), shared with ``test_api_fidelity.py`` and ``test_usage_and_split.py``; they
  only read it. The files that use it run first and together (``pytest_collection_modifyitems``
  below), and it stops after the last test that uses it, so it never runs beside ``real_stack``
  (each stack is two vLLM workers of about 3 GB).

The vLLM virtual environment and the tiny offline models come from `make test`
(scripts/setup_vllm.sh and scripts/make_tiny_models.py); without them these tests skip.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx
import pytest

from tests.support.procs import ROOT, Proc, free_port, gateway, running, sim

MODEL = "tiny"
BIG_WINDOW, SMALL_WINDOW = 2048, 768


def _paths() -> tuple[Path, Path]:
    py = Path(os.environ.get("GPUPOOL_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
    models = Path(os.environ.get("GPUPOOL_TINY_MODELS", ROOT / ".models"))
    return py, models


def _worker(name: str, model_dir: Path, window: int, py: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": MODEL,
        "launch": {
            # a port from the tests' own lock (below the ephemeral range, held 300 s): a port
            # gpupool picks by bind(0) stays free only until vLLM binds it, 30 s and more later
            "port": free_port(),
            "model_path": str(model_dir),
            "command": [
                str(py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                "{model_path}",
            ],
            "args": {
                "dtype": "bfloat16",
                "max-model-len": window,
                "max-num-seqs": 4,
                "max-num-batched-tokens": 2048,
                # these workers return raw `<think>` text so that the gateway's split is tested
                "reasoning-parser": False,
                # no torch.compile: on CPU it is most of a start (34 s of 70 with a cold cache,
                # several minutes on a loaded 2-core box), and these tests read the API, not speed
                # (vLLM's own CPU CI skips it too, VLLM_CPU_CI_ENV)
                "enforce-eager": True,
            },
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
            "startup_timeout_s": 300,
            "backoff_initial_s": 0.5,
        },
        "warmup": [{"prompt": "warm up", "max_tokens": 2}],
    }


@pytest.fixture(scope="session")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("vllm")
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL, "reasoning": "qwen3"}],
        "workers": [
            _worker("big", models / "qwen3-dense", BIG_WINDOW, py),
            _worker("small", models / "qwen3-next-hybrid", SMALL_WINDOW, py),
        ],
        "routing": {"health_interval_s": 1.0, "fail_threshold": 2},
    }
    gw = gateway(cfg, tmp)
    with running(gw):
        wait_ready(gw, timeout=420)
        yield {"gw": gw, "tmp": tmp, "models": models, "py": py}


def wait_ready(gw: Proc, timeout: float, names: tuple[str, ...] = ("big", "small")) -> None:
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        data = httpx.get(gw.url + "/admin/workers", timeout=5).json()["data"]
        states = {w["name"]: w["state"] for w in data}
        if all(states.get(n) == "ready" for n in names):
            return
        time.sleep(0.5)
    raise TimeoutError(f"workers not ready: {states}\n{gw.logs()}")


@pytest.fixture(scope="session")
def contract_sim(
    real_stack: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    s = sim(model=MODEL, max_model_len=BIG_WINDOW, tmp=tmp_path_factory.mktemp("contract"),
            mode="lorem", max_num_seqs=4)  # fmt: skip
    with running(s):
        yield s


T = TypeVar("T")


class Shared(Generic[T]):
    """A server for several test files: started by the first :meth:`get`, stopped by
    :meth:`close` (after the last test that uses it) and started again if a later test asks."""

    def __init__(self, start: Callable[[contextlib.ExitStack], T]) -> None:
        self._start = start
        self._exit: contextlib.ExitStack | None = None
        self._value: T | None = None

    def get(self) -> T:
        if self._exit is None:
            with contextlib.ExitStack() as exit_stack:
                self._value = self._start(exit_stack)
                self._exit = exit_stack.pop_all()
        assert self._value is not None
        return self._value

    def close(self) -> None:
        exit_stack, self._exit, self._value = self._exit, None, None
        if exit_stack is not None:
            exit_stack.close()


CONFORMANCE = "conformance"
_shared: dict[str, Shared[Any]] = {}


@pytest.fixture(scope="session")
def conformance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared[Any]]:
    """``test_conformance.py``'s stack (its ``stack`` fixture calls ``get``)."""
    from tests.vllm.test_conformance import start_stack

    shared: Shared[Any] = Shared(lambda exit_stack: start_stack(exit_stack, tmp_path_factory))
    _shared[CONFORMANCE] = shared
    yield shared
    shared.close()
    del _shared[CONFORMANCE]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of ``tests/vllm/`` that use the conformance stack first, in their order."""
    here = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/vllm/")]
    mine = [items[i] for i in here]
    mine.sort(key=lambda item: CONFORMANCE not in getattr(item, "fixturenames", ()))
    for i, item in zip(here, mine, strict=True):
        items[i] = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the conformance stack once the next test does not use it (none later does)."""
    shared = _shared.get(CONFORMANCE)
    if shared is not None and CONFORMANCE not in getattr(nextitem, "fixturenames", ()):
        shared.close()
