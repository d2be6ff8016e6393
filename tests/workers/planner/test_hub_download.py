"""The online path with the real huggingface_hub client against a Hub on loopback
(``HF_ENDPOINT``): only ``config.json`` (and ``hf_quant_config.json``) is asked for, the answer
lands in the HF cache, and the next resolution offline reads it from there."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest

from gpupool.workers.planner.errors import ModelNotFoundError
from gpupool.workers.planner.resolve import resolve_model
from tests.workers.planner.conftest import MODEL_CONFIGS

COMMIT = "a" * 40


class FakeHub(ThreadingHTTPServer):
    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.requests: list[tuple[str, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, *, body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        data = self.server.files.get(self.path)
        if data is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    config = (MODEL_CONFIGS / "qwen3.5-27b" / "config.json").read_bytes()
    server = FakeHub({"/acme/Custom-27B/resolve/main/config.json": config})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import: where an earlier test of this
    # process imported it offline (the planner's fixture sets HF_HUB_OFFLINE=1), say online here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.shutdown()
    server.server_close()


def test_only_the_config_is_fetched_then_found_in_the_cache_offline(
    hub: FakeHub, hf_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = resolve_model("acme/Custom-27B")
    assert found.source.startswith("the Hub, config.json only")
    assert found.spec.num_layers == 64 and not found.builtin
    files = {path for _, path in hub.requests if "/resolve/" in path}  # not the client's own API
    assert files == {
        "/acme/Custom-27B/resolve/main/config.json",
        "/acme/Custom-27B/resolve/main/hf_quant_config.json",
    }  # no weights, no index
    cached = list(hf_env.glob("models--acme--Custom-27B/snapshots/*/config.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["architectures"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    again = resolve_model("acme/Custom-27B")
    assert again.source.startswith("Hugging Face cache") and again.spec == found.spec
    assert hub.requests == []


def test_a_repo_without_config_falls_back_and_names_what_the_hub_said(hub: FakeHub) -> None:
    with pytest.raises(ModelNotFoundError, match=r"the Hub: acme/Nothing has no config\.json"):
        resolve_model("acme/Nothing")
    found = resolve_model("Qwen/Qwen3.5-27B-FP8")  # not on this Hub: the built-in shape
    assert found.builtin
