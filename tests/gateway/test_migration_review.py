"""Adversarial checks of request migration (issue 36): paths a user takes through `gpupool
serve` that the main migration tests do not walk.

* A ``/v1/responses`` or ``/v1/messages`` stream whose model's reasoning the gateway splits
  (a worker without vLLM's parser) is never continued; when its worker dies mid-answer the
  client gets the error event, and the refusal is counted and logged as every other one is.
* A worker asked for its token ids that lies about them (``support/script_worker.py``): a list
  that is not ids (nested, strings) leaves every event the client reads valid JSON, and text
  sent with an empty id list makes the answer go on from its text, not from ids that miss it;
  ids split across reads beside escaped quotes and non-ASCII text are kept and taken out.
* A Responses stream cut between ``output_text.done`` and ``content_part.done`` gets both.
* A client that leaves during a continuation leaves nothing held.
* A prompt whose ids would outgrow the SSE event bound is answered (its ids are not asked).
* A worker whose connection breaks after ``data: [DONE]`` ends the stream there: one
  ``[DONE]``, no error, nothing moved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fault_tools import MODEL, gateway_config
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running
from tests.support.template_tools import asked, metric, survivor_of, template_worker

pytestmark = [pytest.mark.timeout(60)]

DIE_AFTER = 7


SPLIT_ROUTES = [
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 40}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40}),
]


@pytest.mark.parametrize(("path", "extra"), SPLIT_ROUTES, ids=["responses", "messages"])
def test_split_reasoning_stream_whose_worker_dies_is_counted_refused(
    tmp_path: Path, path: str, extra: dict[str, Any]
) -> None:
    a, b = template_worker(tmp_path), template_worker(tmp_path)
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing={"prefix_affinity": False})
    cfg["models"] = [{"name": MODEL, "reasoning": "qwen3"}]  # the gateway splits <think>
    gw = gateway(cfg, tmp_path)
    body = {"model": MODEL, "stream": True, **extra}
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = metric(gw, "gpupool_migrations_total", outcome="refused")
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    assert events and events[-1]["type"] == "error"  # the client's stream ends as before
    assert refused == 1  # counted, as a chat stream's refusal is
    assert "not continued: reasoning" in log


# ---- a worker that lies about its token ids (``support/script_worker.py``) -------------------


def _chat_event(content: str | None, ids: str, finish: str | None = None) -> str:
    """A chat chunk framed as vLLM 0.32 frames it, its ``token_ids`` member written raw."""
    delta = {} if content is None else {"content": content}
    choice = json.dumps({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish},
                        separators=(",", ":"), ensure_ascii=False)[:-1]  # fmt: skip
    head = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    return f'data: {head}"choices":[{choice},"token_ids":{ids}}}]}}\n\n'


ROLE = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    '"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}\n\n'
)
REST = [_chat_event(" world", "null"), _chat_event("", "null", "stop"), "data: [DONE]\n\n"]


def _scripted(
    tmp: Path, script: dict[str, list[str]], migrations: int = 2, **server: Any
) -> tuple[Proc, Proc, Proc]:
    path = tmp / "script.json"
    path.write_text(json.dumps(script))
    procs = []
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "tests.support.script_worker", "--port", str(port),
                "--model", MODEL, "--script", str(path)]  # fmt: skip
        procs.append(Proc(argv, f"http://127.0.0.1:{port}", tmp / f"script-{port}.log"))
    a, b = procs
    routing = {"prefix_affinity": False, "migrations": migrations}
    cfg = gateway_config([("a", a, 4), ("b", b, 4)], routing=routing, server=server)
    return gateway(cfg, tmp), a, b


def _stream(gw: Proc, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
        "max_tokens": 40}  # fmt: skip


@pytest.mark.parametrize("ids", ["[[108],108,111]", '["]",108]'], ids=["nested", "string"])
def test_ids_that_are_not_token_ids_never_break_the_clients_json(tmp_path: Path, ids: str) -> None:
    """A worker asked for its ids sends a list that holds a list or a string (valid JSON, not
    ids): the gateway distrusts the ids (the answer goes on from its text) and must not cut the
    list short in the client's bytes."""
    script = {"chat": [ROLE, _chat_event("He", "[72,101]"), _chat_event("llo", ids)],
              "rest": REST}  # fmt: skip
    gw, a, b = _scripted(tmp_path, script)
    with running(a, b, gw):
        events = _stream(gw, CHAT)
        seen = asked(survivor_of(a, b))
        assert_nothing_held(gw.url, {})

    objs = [json.loads(e) for e in events if e != "[DONE]"]  # every event is JSON
    text = "".join(o["choices"][0]["delta"].get("content") or "" for o in objs if o["choices"])
    assert text == "Hello world" and events[-1] == "[DONE]"
    assert seen[0]["path"] == "/v1/chat/completions"  # from the text: the ids distrusted


def test_text_whose_ids_the_worker_left_out_is_not_lost_at_the_cut(tmp_path: Path) -> None:
    """A worker asked for its ids sends text with an empty id list: the ids no longer cover
    the text the client has, so the answer must go on from the text (going on from the ids
    would feed back a prompt without that text, and the client would read it twice)."""
    script = {"chat": [ROLE, _chat_event("A", "[65]"), _chat_event("B", "[]"),
                       _chat_event("C", "[]")], "rest": REST}  # fmt: skip
    gw, a, b = _scripted(tmp_path, script)
    with running(a, b, gw):
        events = _stream(gw, CHAT)
        seen = asked(survivor_of(a, b))
        assert_nothing_held(gw.url, {})

    assert events[-1] == "[DONE]"
    assert seen[0]["path"] == "/v1/chat/completions", seen
    assert seen[0]["body"]["messages"][-1] == {"role": "assistant", "content": "ABC"}


def _responses_event(seq: int, obj: dict[str, Any]) -> str:
    data = json.dumps({**obj, "sequence_number": seq}, separators=(",", ":"))
    return f"event: {obj['type']}\ndata: {data}\n\n"


def test_responses_cut_between_its_text_done_and_part_done_ends_every_open_event(
    tmp_path: Path,
) -> None:
    """vLLM ends a message as ``output_text.done``, ``content_part.done``,
    ``output_item.done``; a worker that dies after the first of them leaves the text whole, so
    the gateway ends the response itself, and must send the two the client did not get."""
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
                "output": [], "status": "in_progress", "usage": None}  # fmt: skip
    item = {"id": "msg_1", "content": [], "role": "assistant", "status": "in_progress",
            "type": "message"}  # fmt: skip
    part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "item": item, "output_index": 0},
        {"type": "response.content_part.added", **at, "part": part},
        {"type": "response.output_text.delta", **at, "delta": "Hel", "logprobs": []},
        {"type": "response.output_text.delta", **at, "delta": "lo", "logprobs": []},
        {"type": "response.output_text.done", **at, "text": "Hello", "logprobs": []},
    ]  # fmt: skip
    script = {"responses": [_responses_event(i, e) for i, e in enumerate(events)], "rest": []}
    gw, a, b = _scripted(tmp_path, script)
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 40, "stream": True}
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30) as r:
            assert r.status_code == 200
            got = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert_nothing_held(gw.url, {})

    kinds = [e["type"] for e in got]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"], kinds  # fmt: skip
    assert got[-1]["response"]["output"][0]["content"][0]["text"] == "Hello"


def test_a_client_that_leaves_during_the_continuation_frees_everything(tmp_path: Path) -> None:
    """The first worker dies, the other goes on from the ids, sends a token and goes silent;
    the client leaves then: the continuation's slot, lease and connection are given back."""
    script = {"chat": [ROLE, _chat_event("He", "[72,101]")],
              "rest": [_completion_event(" wor", "[32,119]"), "SLEEP"]}  # fmt: skip
    gw, a, b = _scripted(tmp_path, script)
    with running(a, b, gw):
        text = ""
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=CHAT, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    text += "".join(c["delta"].get("content") or "" for c in choices)
                if text == "He wor":
                    break  # the client leaves while the continuation is silent
        seen = asked(survivor_of(a, b))
        assert_nothing_held(gw.url, {}, within_s=5)

    assert text == "He wor"
    assert [s["path"] for s in seen] == ["/v1/completions"]  # it went on from the ids


def _completion_event(text: str, ids: str) -> str:
    choice = json.dumps({"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                         "stop_reason": None, "prompt_token_ids": None},
                        separators=(",", ":"))[:-1]  # fmt: skip
    head = '{"id":"cmpl-2","object":"text_completion","created":2,"model":"m",'
    return f'data: {head}"choices":[{choice},"token_ids":{ids}}}]}}\n\n'


def test_ids_split_across_reads_beside_quotes_and_unicode_are_kept_and_taken_out(
    tmp_path: Path,
) -> None:
    """An event whose text holds the member's own spelling (escaped quotes) and non-ASCII
    text, written in two reads that cut its id list: the client reads the event as the worker
    writes it without the flag (the list ``null``), and the move goes on from its ids."""
    event = _chat_event('he said \\"token_ids\\":[9] — é"', "[72,101]")
    cut = event.index("[72,") + 4
    script = {"chat": [ROLE, event[:cut], event[cut:]], "rest": REST}
    gw, a, b = _scripted(tmp_path, script)
    with running(a, b, gw):
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=CHAT, timeout=30) as r:
            raw = b"".join(r.iter_raw())
        seen = asked(survivor_of(a, b))
        assert_nothing_held(gw.url, {})

    events = raw.split(b"\n\n")
    assert events[1] + b"\n\n" == event.replace("[72,101]", "null").encode()
    assert seen[0]["path"] == "/v1/completions"
    assert seen[0]["body"]["prompt"] == [1, 2, 3, 72, 101]


@pytest.mark.parametrize("migrations", [0, 2])
def test_a_long_prompt_whose_ids_outgrow_an_event_is_answered(
    tmp_path: Path, migrations: int
) -> None:
    """A prompt within ``max_body_bytes`` (the event bound's default) is answered whether or
    not its stream may move: the ids the gateway asks for (six bytes a token, here one token
    a character) must not make the worker's first event too large for the gateway to read."""
    content = "x" * 200_000
    prompt = ",".join(str(10_000 + i % 90_000) for i in range(len(content) + 8))
    role = ROLE.replace('"prompt_token_ids":[1,2,3]', f'"prompt_token_ids":[{prompt}]')
    rest = [_chat_event("", "[2]", "stop"), "data: [DONE]\n\n", "END"]
    script = {"chat_ids": [role, _chat_event("Hello", "[72]"), *rest],
              "chat": [ROLE.replace("[1,2,3]", "null"), _chat_event("Hello", "null"), *rest],
              "rest": []}  # fmt: skip
    gw, a, b = _scripted(tmp_path, script, migrations, max_body_bytes=256 * 1024)
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    with running(a, b, gw):
        events = _stream(gw, body)
        assert_nothing_held(gw.url, {})

    assert events[-1] == "[DONE]" and '"error"' not in "".join(events)
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1])  # fmt: skip
    assert text == "Hello"


@pytest.mark.parametrize("migrations", [0, 2])
def test_a_worker_that_dies_after_its_done_line_ends_the_stream_once(
    tmp_path: Path, migrations: int
) -> None:
    """The worker wrote its whole answer and ``data: [DONE]``, then its connection broke
    before the body's end (``kill -9``, a drain's deadline): the client reads the answer and
    one ``[DONE]``, nothing after it."""
    script = {"chat": [ROLE, _chat_event("Hi", "[72,105]"), _chat_event("", "[2]", "stop"),
                       "data: [DONE]\n\n"], "rest": []}  # fmt: skip
    gw, a, b = _scripted(tmp_path, script, migrations)
    with running(a, b, gw):
        events = _stream(gw, CHAT)
        moved = metric(gw, "gpupool_migrations_total")
        assert_nothing_held(gw.url, {})
        log = gw.logs()

    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events
    assert '"error"' not in "".join(events)
    assert moved == 0 and "failed mid-answer" not in log  # nothing was left to move
