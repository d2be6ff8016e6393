"""Two overlapping reloads through the admin API: the newer file wins.

The first reload's read of the config file is held (after it read the file) until the second
reload, sent after the file was rewritten, has either finished or is waiting for the reload
lock. Files read before the lock let the first reload apply its older read last (the keys of
the first file won); read inside the lock, the second reads the newer file and applies it last.
The gateway is the real app (``create_app``) under uvicorn in a thread, so the read can be held.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from gpupool.config import load_config
from gpupool.gateway import reload
from gpupool.gateway.api.app import create_app
from gpupool.gateway.services import Services
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import free_port

MODEL = "m"
ADMIN, ZED, ALICE, BOB = "sk-admin-race", "sk-zed-race", "sk-alice-race", "sk-bob-race"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
NOBODY = f"http://127.0.0.1:{free_port()}"  # the one worker, never up: unchanged by the reloads


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _cfg(name: str, key: str, state: Path) -> dict[str, Any]:
    """A config whose one client key is ``name``'s."""
    auth = {"enabled": True, "admin_key_sha256": _h(ADMIN),
            "keys": [{"name": name, "sha256": _h(key)}]}  # fmt: skip
    return {"models": [{"name": MODEL}], "auth": auth, "server": {"state_dir": str(state)},
            "workers": [{"name": "w", "model": MODEL, "url": NOBODY}]}  # fmt: skip


class CountingLock(asyncio.Lock):
    """The reload lock, counting the reloads that asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def acquire(self) -> bool:
        self.asked += 1
        return await super().acquire()


class HeldRead:
    """``load_config`` whose first call, having read the file, waits for ``release``."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_read = threading.Event()
        self.release = threading.Event()

    def __call__(self, path: str | Path) -> Any:
        self.calls += 1
        cfg = load_config(path)
        if self.calls == 1:
            self.first_read.set()
            self.release.wait(30)
        return cfg


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, list[Services]]]:
    path = tmp_path / "gpupool.yaml"
    path.write_text(yaml.safe_dump(_cfg("zed", ZED, tmp_path / "state")))
    built: list[Services] = []

    def hook(svc: Services) -> None:
        svc.reload_lock = CountingLock()
        built.append(svc)

    app = create_app(load_config(path), config_path=path, on_services=hook)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _until(lambda: server.started, "the gateway did not start")
    try:
        yield f"http://127.0.0.1:{port}", path, built
    finally:
        server.should_exit = True
        thread.join(30)


def _until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def _models(url: str, key: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.get(url + "/v1/models", headers=headers, timeout=10).status_code


def test_the_newer_file_wins_two_overlapping_reloads(
    served: tuple[str, Path, list[Services]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, path, (svc,) = served
    held = HeldRead()
    monkeypatch.setattr(reload, "load_config", held)
    lock = svc.reload_lock
    assert isinstance(lock, CountingLock)

    def post() -> httpx.Response:
        return httpx.post(url + "/admin/reload", headers=ADMIN_H, timeout=60)

    state = path.parent / "state"
    path.write_text(yaml.safe_dump(_cfg("alice", ALICE, state)))
    first, first_out = _in_thread(post)
    _until(held.first_read.is_set, "the first reload never read its file")
    path.write_text(yaml.safe_dump(_cfg("bob", BOB, state)))  # newer, for the second reload
    second, second_out = _in_thread(post)
    _until(lambda: bool(second_out) or lock.asked >= 2, "the second reload never started")
    held.release.set()
    first.join(60)
    second.join(60)
    assert [r.status_code for r in (*first_out, *second_out)] == [200, 200]
    assert (_models(url, BOB), _models(url, ALICE), _models(url, ZED)) == (200, 401, 401)
    assert held.calls == 2
    assert_nothing_held(url, ADMIN_H)
