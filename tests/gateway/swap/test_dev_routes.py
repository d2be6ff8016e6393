"""vLLM's dev-mode routes are never reachable through the gateway, however the path is spelled:
only the routes in pipeline/kinds.py reach a worker, and only the admin API controls sleep.

Raw requests on a socket (an HTTP client would normalise `..`, `//` and percent escapes away);
after all of them both simulated workers report the same sleep state, sleep and wake counts as
before, and the ledger no violation."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.gateway.swap.tools import ledger_of, serving, two_model_config, wait_states, workers
from tests.support.procs import Proc

DEV = ["sleep", "wake_up", "is_sleeping", "collective_rpc", "reset_prefix_cache",
       "release_kv_cache_memory", "reset_mm_cache", "reset_encoder_cache", "server_info",
       "pause", "resume", "is_paused", "update_weights", "init_weight_transfer_engine"]  # fmt: skip


def spellings(route: str) -> list[str]:
    upper = route.upper()
    escaped = "".join(f"%{ord(c):02X}" for c in route)
    return [
        f"/{route}", f"/{upper}", f"/{route.capitalize()}", f"//{route}", f"/{route}/",
        f"/{route}?level=1", f"/{route}%3Flevel=1", f"/./{route}", f"/v1/../{route}",
        f"/v1/%2E%2E/{route}", f"/v1/%2e%2e/{route}", f"/%2F{route}", f"/%2f{route}",
        f"/{escaped}", f"/v1/{route}", f"/v1//{route}", f"/v1/chat/completions/../../{route}",
        f"/v1/chat/completions/%2E%2E/%2E%2E/{route}", f"/{route}%00", f"/{route};x",
        f"/{route}#frag", f"/{route}%20", f"\\{route}", f"/v1\\..\\{route}",
        f"http://127.0.0.1/{route}",
    ]  # fmt: skip


def raw(url: str, method: str, target: str) -> int:
    parts = urlsplit(url)
    body = b'{"method": "reload_weights"}'
    head = (
        f"{method} {target} HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json"
        f"\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
        s.sendall(head.encode("latin-1") + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    line = reply.split(b"\r\n", 1)[0]
    return int(line.split()[1]) if line.startswith(b"HTTP/1.1 ") else 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    tmp = tmp_path_factory.mktemp("dev-routes")
    with serving(two_model_config(tmp), tmp) as gw:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        yield gw, tmp


def _sleep_stats(gw: Proc) -> dict[str, object]:
    out = {}
    for name, w in workers(gw).items():
        stats = httpx.get(w["url"] + "/sim/sleep").json()
        out[name] = (w["state"], stats["asleep"], stats["sleeps"], stats["wakes"])
    return out


@pytest.mark.parametrize("route", DEV)
def test_dev_route_is_not_reachable_on_any_spelling(stack: tuple[Proc, Path], route: str) -> None:
    gw, tmp = stack
    before = _sleep_stats(gw)
    for target in spellings(route):
        for method in ("POST", "GET", "PUT"):
            status = raw(gw.url, method, target)
            assert status in (0, 400, 404, 405), (method, target, status)
    assert _sleep_stats(gw) == before
    assert ledger_of(tmp)["violations"] == []
