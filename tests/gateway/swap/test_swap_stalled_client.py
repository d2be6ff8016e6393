"""A client that stops reading no longer blocks a swap group's switch forever.

A worker falls asleep only once its running requests end. A stream whose client stopped
reading (socket open, nothing read) used to run forever, blocked writing, so the other model of
the group never woke. With ``server.write_timeout_s`` the stalled client is cut, its request
ends, and the switch goes through: the other model's request is answered.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.swap.tools import (
    launched,
    ledger_of,
    serving,
    sleeps_waited,
    two_model_config,
    workers,
)
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc

pytestmark = pytest.mark.timing  # a stalled client is cut by its write deadline

DEADLINE_S = 60.0


def _stalled_stream(gw: str, model: str) -> socket.socket:
    """A streamed request from a client with a small receive buffer that never reads."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 3000, "stream": True})
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: stalled-swap\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n")  # fmt: skip
    host, port = gw.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(head.encode() + body.encode())
    return s


def _cut_logged(gw: Proc) -> bool:
    return any("client=stalled-swap]" in line and "server.write_timeout_s" in line
               for line in gw.log_path.read_text().splitlines())  # fmt: skip


def test_a_stalled_client_does_not_block_a_switch_forever(tmp_path: Path) -> None:
    script = tmp_path / "script.txt"
    script.write_text(("x" + " " * 16384) * 1500)  # 16 KiB a token: buffers full in a second
    cfg = two_model_config(tmp_path, server={"write_timeout_s": 3.0})
    long = {"script-file": str(script), "itl-ms": 2, "max-model-len": 8192}
    cfg["workers"][0] = launched("coder-w", "coder", tmp_path / "gpu0-ledger.json", **long)
    with serving(cfg, tmp_path) as gw:
        deadline = time.monotonic() + DEADLINE_S
        while workers(gw)["chat-w"]["state"] != "asleep":
            assert time.monotonic() < deadline, "chat-w never asleep"
            time.sleep(0.05)
        s = _stalled_stream(gw.url, "coder")
        try:
            # the stalled stream runs; or, on a loaded machine, already ran and was cut (the
            # log line stays, an in-flight count of 1 may come and go between two looks)
            while workers(gw)["coder-w"]["inflight"] != 1 and not _cut_logged(gw):
                assert time.monotonic() < deadline, "the stalled stream never ran"
                time.sleep(0.02)
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0,
                                   timeout=DEADLINE_S)  # fmt: skip
            # the switch to chat waits for coder-w's running request: the stalled one
            answer = client.completions.create(model="chat", prompt="hi", max_tokens=4)
            assert answer.choices[0].text
        finally:
            s.close()
        deadline = time.monotonic() + DEADLINE_S
        while not _cut_logged(gw):  # logged as the cut request's task ends: no order promised
            assert time.monotonic() < deadline, "the cut never logged"
            time.sleep(0.05)
        states = {n: w["state"] for n, w in workers(gw).items()}
        assert states == {"coder-w": "asleep", "chat-w": "ready"}
        assert_nothing_held(gw.url, within_s=DEADLINE_S)
        with httpx.Client() as c:  # coder still served: woken again on demand
            r = c.post(gw.url + "/v1/completions", timeout=DEADLINE_S,
                       json={"model": "coder", "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200
    ledger = ledger_of(tmp_path)
    assert ledger["peak_awake"] <= 1.0  # never both awake, no request to a sleeping worker,
    assert ledger["violations"] == []  # no sleep aborted a generation
    # (the worker may see /sleep before the abort of the request the gateway let go of: a race
    # of any client that leaves during a switch, stalled or not. The gateway's mode=wait covers
    # it as vLLM's does: the sleep waits for that abort, a moment, and cuts nothing.)
    assert sum(sleeps_waited(ledger).values()) <= 1  # (that race's, if it came)
