"""A streamed ``/v1/messages`` answer whose worker dies goes on on another worker (issue 36).

A real `gpupool serve` in front of two fake workers (``support/template_worker.py``) that stream
Anthropic events as vLLM's adapter frames them; the first to take the stream sends part of the
answer and dies, and the other continues it as a completion of the adapter's rendering
(``pipeline/continue_events.py``). The official ``anthropic`` client reads one message: the
whole text, one id, no error, one ``message_stop``, usage counted once; nothing is held. A
request that offers tools is not continued: what the client read stays, then the error event.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running
from tests.support.template_tools import asked, metric, survivor_of, template_worker
from tests.support.template_worker import ANSWER, FULL, render

pytestmark = [pytest.mark.timeout(60)]

SYSTEM = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Be kind."}]
PARTS = [{"type": "text", "text": "What"}, {"type": "text", "text": "is it?"}]
MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
    {"role": "user", "content": PARTS},
]  # fmt: skip
# the chat messages vLLM's adapter makes of them: the system joined, first; text blocks as parts
CHAT = [
    {"role": "system", "content": "Be brief. Be kind."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": PARTS},
]  # fmt: skip
DIE_AFTER = 7


def test_messages_stream_goes_on_on_another_worker(tmp_path: Path) -> None:
    a, b = template_worker(tmp_path), template_worker(tmp_path)
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    gw = gateway(cfg, tmp_path)
    with running(a, b, gw):
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0, timeout=30)
        kinds: list[str] = []
        with client.messages.stream(
            model=MODEL, system=SYSTEM, messages=MESSAGES, max_tokens=40,  # type: ignore[arg-type]
            stop_sequences=["STOP"], extra_body={"temperature": 0.7, "top_k": 5},
        ) as stream:  # fmt: skip
            for ev in stream:
                kinds.append(ev.type)
            message = stream.get_final_message()
        survivor = survivor_of(a, b)
        seen = asked(survivor)
        continued = metric(gw, "gpupool_migrations_total", outcome="continued")
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    assert message.id == "msg-first"
    assert [blk.type for blk in message.content] == ["text"]
    assert message.content[0].text == FULL  # type: ignore[union-attr]  # nothing lost or repeated
    assert message.stop_reason == "end_turn"
    assert "error" not in kinds
    assert kinds.count("message_start") == 1 and kinds.count("message_stop") == 1
    assert kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    prompt = len(render(CHAT, True))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (prompt, len(ANSWER))
    assert continued == 1

    paths = [s["path"] for s in seen]
    assert paths == ["/tokenize", "/tokenize", "/v1/completions"], paths
    assert seen[0]["body"]["messages"] == CHAT
    assert seen[0]["body"]["add_generation_prompt"] is True
    sent = seen[2]["body"]
    partial = "".join(ANSWER[:DIE_AFTER])
    assert sent["prompt"] == [ord(c) for c in render(CHAT, True) + partial]
    assert sent["max_tokens"] == 40 - DIE_AFTER
    assert (sent["temperature"], sent["top_k"], sent["stop"]) == (0.7, 5, ["STOP"])
    assert sent["stream"] is True and "messages" not in sent
    assert "a /v1/messages answer" in log


def test_messages_stream_offering_tools_is_not_continued(tmp_path: Path) -> None:
    a, b = template_worker(tmp_path), template_worker(tmp_path)
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    gw = gateway(cfg, tmp_path)
    tool = {"name": "look", "description": "Look it up.", "input_schema": {"type": "object"}}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True,
            "tools": [tool]}  # fmt: skip
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = metric(gw, "gpupool_migrations_total", outcome="refused")
        survivor = survivor_of(a, b)
        seen = asked(survivor)
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    kinds = [e["type"] for e in events]
    assert kinds[-1] == "error" and "message_stop" not in kinds
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "".join(ANSWER[:DIE_AFTER])  # what the client read stays
    assert refused == 1 and seen == []
    assert "not continued: tools" in log
