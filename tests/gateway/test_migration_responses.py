"""A streamed ``/v1/responses`` answer whose worker dies goes on on another worker (issue 36).

A real `gpupool serve` in front of two fake workers (``support/template_worker.py``) that stream
Responses events as vLLM's Responses server frames them; the first to take the stream sends part
of the answer and dies, and the other continues it as a completion of vLLM's rendering
(``pipeline/continue_events.py``, ``transform/responses_continuation.py``). The official
``openai`` client reads one valid stream: sequence numbers 0, 1, 2, ... without gap or repeat,
one response id and one message item, the whole text in the deltas and the done events, one
``response.completed`` with the whole output and usage counted once; nothing is held. Requests
the gateway cannot continue exactly keep what they read, then get the error event (``refused``
counted with its reason). A whole answer whose worker dies is sent again from the start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, running
from tests.support.template_tools import alive, asked, metric, survivor_of, template_worker
from tests.support.template_worker import ANSWER, FULL, render

pytestmark = [pytest.mark.timeout(60)]

PARTS = [{"type": "input_text", "text": "What"}, {"type": "input_text", "text": "is it?"}]
INPUT: list[dict[str, Any]] = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": PARTS},
]  # fmt: skip
# the chat messages vLLM's Responses server makes of them: the instructions first
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "What"},
                                 {"type": "text", "text": "is it?"}]},
]  # fmt: skip
DIE_AFTER = 7


def _config(a: Proc, b: Proc) -> dict[str, Any]:
    return gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})


def test_responses_stream_goes_on_on_another_worker(tmp_path: Path) -> None:
    a, b = template_worker(tmp_path), template_worker(tmp_path)
    gw = gateway(_config(a, b), tmp_path)
    with running(a, b, gw):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.responses.create(
            model=MODEL, instructions="Be brief.", input=INPUT,  # type: ignore[arg-type]
            max_output_tokens=40, temperature=0.7, top_p=0.9, stream=True,
            extra_body={"top_k": 5, "stop": ["STOP"]},
        )  # fmt: skip
        events = list(stream)
        survivor = survivor_of(a, b)
        seen = asked(survivor)
        continued = metric(gw, "gpupool_migrations_total", outcome="continued")
        assert_nothing_held(gw.url, {})  # the request is accounted: its tokens below
        counted = {k: metric(gw, "gpupool_tokens_total", kind=k) for k in ("prompt", "completion")}
        log = gw.logs()

    kinds = [e.type for e in events]
    assert "error" not in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))  # no gap or repeat
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert kinds.count("response.created") == kinds.count("response.completed") == 1
    assert kinds.count("response.output_item.added") == 1
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == FULL  # nothing lost or repeated
    assert {(d.item_id, d.output_index, d.content_index) for d in deltas} == {("msg_first", 0, 0)}
    by_kind = {e.type: e for e in events}
    assert by_kind["response.output_text.done"].text == FULL  # type: ignore[union-attr]
    assert by_kind["response.content_part.done"].part.text == FULL  # type: ignore[union-attr]
    done_item = by_kind["response.output_item.done"].item  # type: ignore[union-attr]
    assert done_item.id == "msg_first" and done_item.content[0].text == FULL  # type: ignore[union-attr]

    created = by_kind["response.created"].response  # type: ignore[union-attr]
    final = by_kind["response.completed"].response  # type: ignore[union-attr]
    assert final.id == created.id and final.id.startswith("resp_")
    assert final.status == "completed" and final.output_text == FULL
    assert [item.id for item in final.output] == ["msg_first"]
    prompt = len(render(CHAT, True))
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, len(ANSWER))
    assert final.usage.total_tokens == prompt + len(ANSWER)
    assert counted == {"prompt": prompt, "completion": len(ANSWER)}  # the gateway's own count
    assert continued == 1

    paths = [s["path"] for s in seen]
    assert paths == ["/tokenize", "/tokenize", "/v1/completions"], paths
    assert seen[0]["body"]["messages"] == CHAT
    assert seen[0]["body"]["add_generation_prompt"] is True
    sent = seen[2]["body"]
    partial = "".join(ANSWER[:DIE_AFTER])
    assert sent["prompt"] == [ord(c) for c in render(CHAT, True) + partial]
    assert sent["max_tokens"] == 40 - DIE_AFTER
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["stop"]) == (
        0.7, 0.9, 5, ["STOP"])  # fmt: skip
    assert sent["stream"] is True and "input" not in sent
    assert "a /v1/responses answer" in log


REFUSED = [
    ("tools", {"tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}}]}),
    ("reasoning", {"reasoning": {"effort": "low"}}),
    ("structured_outputs", {"text": {"format": {"type": "json_object"}}}),
    ("media", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}),
]  # fmt: skip


@pytest.mark.parametrize(("why", "extra"), REFUSED, ids=[r[0] for r in REFUSED])
def test_responses_stream_that_cannot_go_on_exactly_is_not_continued(
    tmp_path: Path, why: str, extra: dict[str, Any]
) -> None:
    a, b = template_worker(tmp_path), template_worker(tmp_path)
    gw = gateway(_config(a, b), tmp_path)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 40, "stream": True, **extra}
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = metric(gw, "gpupool_migrations_total", outcome="refused")
        survivor = survivor_of(a, b)
        seen = asked(survivor)
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    kinds = [e["type"] for e in events]
    assert kinds[-1] == "error" and "response.completed" not in kinds
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(ANSWER[:DIE_AFTER])  # what the client read stays
    assert refused == 1 and seen == []
    assert f"not continued: {why}" in log


def test_whole_responses_answer_is_sent_again(tmp_path: Path) -> None:
    a, b = (
        template_worker(tmp_path),
        template_worker(tmp_path, die_after=0),
    )  # a cuts its body, b answers whole
    gw = gateway(_config(a, b), tmp_path)
    with running(a, b, gw):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        answers = []
        for _ in range(20):  # until a took one (routing balances the two)
            answers.append(client.responses.create(model=MODEL, input="Hi"))
            if not alive(a):
                break
        restarted = metric(gw, "gpupool_migrations_total", outcome="restarted")
        assert_nothing_held(gw.url, {})

    assert not alive(a)
    assert all(r.output_text == FULL and r.status == "completed" for r in answers)
    assert restarted == 1


def test_follow_up_stays_on_its_worker(tmp_path: Path) -> None:
    """A ``previous_response_id`` follow-up runs only where its conversation is stored: when
    that worker dies mid-answer, the stream ends with the error event (``refused`` counted)."""
    a, b = (
        template_worker(tmp_path),
        template_worker(tmp_path, die_after=0),
    )  # b answers whole, cuts streams
    gw = gateway(_config(a, b), tmp_path)
    with running(a, b, gw):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        first = client.responses.create(model=MODEL, input="Hi")  # stored on b (a cuts it)
        body = {"model": MODEL, "input": "More", "stream": True,
                "previous_response_id": first.id}  # fmt: skip
        key = {"Authorization": "Bearer x"}  # the same tenant as the first
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, headers=key,
                          timeout=30) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = metric(gw, "gpupool_migrations_total", outcome="refused")
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    assert [e["type"] for e in events][-1] == "error"
    assert refused == 1
    assert "not continued: previous_response_id" in log
