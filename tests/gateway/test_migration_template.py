"""A chat answer whose text the chat template rewrites is continued as a completion (issue 36).

A real `gpupool serve` in front of two fake workers (``support/template_worker.py``) whose
template rewrites every continued final message, and which return no token ids (as an older
vLLM; with them the answer goes on from its ids: ``test_migration_token_ids.py``): the first to
take the stream sends part of the answer and dies, and the other continues it through
``/tokenize`` and ``/v1/completions`` (``pipeline/continue_completion.py``). The client reads
one chat stream with the whole answer, nothing repeated or lost at the cut, one id, one
``[DONE]``, usage counted once; nothing is held. Once the partial answer holds ``</think>`` (the
gateway knows the template cuts it: no chat continuation is tried), once it does not (the
worker's refusal sends it the completion way), and once for a model whose reasoning the gateway
splits, cut mid-thought (its raw text holds ``<think>``: straight the completion way, and the
split goes on over it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import gateway, running
from tests.support.template_tools import asked, survivor_of, template_worker
from tests.support.template_worker import ANSWER, FULL, render

pytestmark = [pytest.mark.timeout(60)]

MESSAGES = [{"role": "user", "content": "What is it?"}]
USAGE = {"include_usage": True}
REASONING = "reasoning"


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    events: list[dict[str, Any] | str] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize(
    ("die_after", "split"),
    [(9, False), (3, False), (3, True)],
    ids=["think-in-text", "refused", "gateway-split"],
)
def test_rewritten_chat_answer_continues_as_completion(
    tmp_path: Path, die_after: int, split: bool
) -> None:
    a, b = (
        template_worker(tmp_path, "--no-token-ids", die_after=die_after),
        template_worker(tmp_path, "--no-token-ids", die_after=die_after),
    )
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    if split:  # the gateway splits the reasoning: the raw text holds <think>, cut inside it
        cfg["models"] = [{"name": MODEL, "reasoning": "qwen3"}]
    gw = gateway(cfg, tmp_path)
    with running(a, b, gw):
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 40,
                "temperature": 0.7, "seed": 11, "stream_options": USAGE}  # fmt: skip
        events = _stream(gw.url, body)
        survivor = survivor_of(a, b)
        seen = asked(survivor)
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    objs = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in o for o in objs), objs
    text = "".join(c["delta"].get("content") or "" for o in objs for c in o["choices"])
    if split:
        reasoning = "".join(c["delta"].get(REASONING) or "" for o in objs for c in o["choices"])
        assert (reasoning, text) == ("Let me see.", FULL.split("</think>")[1])
    else:
        assert text == FULL  # nothing lost or repeated at the cut
    assert {o["id"] for o in objs} == {"chatcmpl-first"}
    assert {o["object"] for o in objs} == {"chat.completion.chunk"}
    assert sum("role" in c["delta"] for o in objs for c in o["choices"]) == 1
    reasons = [c["finish_reason"] for o in objs for c in o["choices"] if c["finish_reason"]]
    assert reasons == ["stop"]
    usage = objs[-1]["usage"]
    if split:  # counted by the worker's /tokenize of the reasoning: one character a token
        assert usage.pop("completion_tokens_details") == {"reasoning_tokens": len("Let me see.")}
    prompt = len(render(MESSAGES, True))
    assert usage == {"prompt_tokens": prompt, "completion_tokens": len(ANSWER),
                     "total_tokens": prompt + len(ANSWER)}  # fmt: skip

    paths = [s["path"] for s in seen]
    chat_tried = ["/v1/chat/completions"] if die_after == 3 and not split else []  # the 400
    counted = ["/tokenize"] if split else []  # the reasoning's tokens, for usage
    assert paths == [*chat_tried, "/tokenize", "/tokenize", "/v1/completions", *counted], paths
    sent = seen[paths.index("/v1/completions")]["body"]
    partial = "".join(ANSWER[:die_after])
    assert sent["prompt"] == [ord(c) for c in render(MESSAGES, True) + partial]
    assert sent["max_tokens"] == 40 - die_after
    assert (sent["seed"], sent["temperature"], sent["stream"]) == (11, 0.7, True)
    assert "messages" not in sent and "continue_final_message" not in sent
    assert "as a completion" in log
    assert "returned no token ids" in log  # the gateway asked; this worker, as an older vLLM, not
