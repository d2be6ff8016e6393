"""A key's tokens when a stream's worker dies mid-answer and the answer cannot move.

``gpupool serve`` with auth on (a key with a ``tpm``, its budget in Redis so the test can read
what the key was charged), one scripted worker (``support/script_worker.py``) that streams some
text, optionally with a usage, then goes silent and is killed, and no other worker: migration
(``routing.migrations`` 2) has nowhere to move the answer. The client got text, so the key is
charged as with migrations off (0): the usage seen, else the reservation stands; never 0.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, redis_server, running

pytestmark = [pytest.mark.timeout(60)]

KEY, ADMIN, NAME = "sk-budget-key", "sk-budget-admin", "budget"
AUTH = {"authorization": f"Bearer {KEY}"}
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
HEAD = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
ROLE = (f'data: {HEAD}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
        '"logprobs":null,"finish_reason":null}]}\n\n')  # fmt: skip
USAGE = {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}


def _text(content: str, usage: bool) -> str:
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
    extra = f',"usage":{json.dumps(USAGE)}' if usage else ""
    return f'data: {HEAD}"choices":[{json.dumps(choice)}]{extra}}}\n\n'


def _h(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _worker(tmp: Path, usage: bool) -> Proc:
    script = tmp / "script.json"
    script.write_text(json.dumps({"chat": [ROLE, _text("He", usage), "SLEEP"], "rest": []}))
    port = free_port()
    argv = [sys.executable, "-m", "tests.support.script_worker", "--port", str(port),
            "--model", MODEL, "--script", str(script)]  # fmt: skip
    return Proc(argv, f"http://127.0.0.1:{port}", tmp / f"script-{port}.log")


def _charged(store: redis.Redis) -> int:
    """The key's tokens counted in the last minute (reservations included)."""
    return int(store.get(f"gpupool:kl:ts:{NAME}") or 0)


@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
@pytest.mark.parametrize("migrations", [0, 2])
def test_a_cut_stream_that_cannot_move_charges_the_key_as_without_migration(
    tmp_path: Path, migrations: int, usage: bool
) -> None:
    w, store = _worker(tmp_path, usage), redis_server(tmp_path)
    cfg = gateway_config([("w", w, 4)], queue={"backend": "redis", "redis_url": store.url},
                         routing={"prefix_affinity": False, "migrations": migrations})  # fmt: skip
    cfg["auth"] = {"enabled": True, "admin_key_sha256": _h(ADMIN),
                   "keys": [{"name": NAME, "sha256": _h(KEY), "tpm": 100_000}]}  # fmt: skip
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "stream": True, "max_tokens": 40}  # fmt: skip
    with running(w, store):
        gw = gateway(cfg, tmp_path)
        with running(gw), redis.Redis.from_url(store.url) as r:
            text, events = "", []
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                              headers=AUTH, timeout=30) as resp:  # fmt: skip
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    choices = json.loads(line[6:]).get("choices") if line[6:7] == "{" else None
                    text += "".join(c["delta"].get("content") or "" for c in choices or [])
                    if text == "He" and w.proc is not None and w.proc.poll() is None:
                        reserved = _charged(r)  # the request's reservation, held now
                        w.kill()  # the worker dies mid-answer, the client holding "He"
            assert_nothing_held(gw.url, ADMIN_H)
            charged = _charged(r)

    assert text == "He" and '"error"' in events[-1] + events[-2], events
    assert reserved > 0
    assert charged == (USAGE["total_tokens"] if usage else reserved)


def test_a_stream_moved_and_completed_charges_the_usage_its_client_reads(tmp_path: Path) -> None:
    """The same cut with a second worker: the answer goes on there and ends, and the key is
    charged the usage the client reads (the continuation's, counted over the whole answer)."""
    rest = [_text(" world", False), f'data: {HEAD}"choices":[],"usage":{json.dumps(USAGE)}}}\n\n',
            "data: [DONE]\n\n"]  # fmt: skip
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"chat": [ROLE, _text("He", False), "SLEEP"], "rest": rest}))
    workers, store = [], redis_server(tmp_path)
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "tests.support.script_worker", "--port", str(port),
                "--model", MODEL, "--script", str(script)]  # fmt: skip
        workers.append(Proc(argv, f"http://127.0.0.1:{port}", tmp_path / f"script-{port}.log"))
    cfg = gateway_config([("a", workers[0], 4), ("b", workers[1], 4)],
                         queue={"backend": "redis", "redis_url": store.url},
                         routing={"prefix_affinity": False})  # fmt: skip
    cfg["auth"] = {"enabled": True, "admin_key_sha256": _h(ADMIN),
                   "keys": [{"name": NAME, "sha256": _h(KEY), "tpm": 100_000}]}  # fmt: skip
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                            "stream": True, "max_tokens": 40,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    with running(*workers, store):
        gw = gateway(cfg, tmp_path)
        with running(gw), redis.Redis.from_url(store.url) as r:
            text, usages = "", []
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body,
                              headers=AUTH, timeout=30) as resp:  # fmt: skip
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    text += "".join(c["delta"].get("content") or "" for c in obj["choices"])
                    usages += [obj["usage"]] if obj.get("usage") else []
                    if text == "He":
                        first = next(w for w in workers
                                     if httpx.get(w.url + "/stats").json()["seen"])  # fmt: skip
                        first.kill()
            assert_nothing_held(gw.url, ADMIN_H)
            charged = _charged(r)

    assert text == "He world"
    assert charged == usages[-1]["total_tokens"] > 0
