"""A chat answer past ``</think>`` moves to a real vLLM worker and ends whole (issue 36).

The Qwen3 template of the tiny models keeps only what follows the last ``</think>`` of an
assistant message, so vLLM refuses to continue such a partial answer as a chat message (checked
here first). A fake first worker (``support/template_worker.py``) streams the start of an answer
holding ``</think>`` and dies; the gateway continues it on the real worker as a completion of
vLLM's own rendering (``pipeline/continue_completion.py``). The client's stream is the fake's
prefix followed by exactly the text the real worker gives, greedy, for the completion of the
rendered prompt and that prefix: nothing repeated or lost at the cut, no error, one ``[DONE]``.
A ``/v1/messages`` stream likewise (``pipeline/continue_events.py``), after checking that the
gateway's conversion of its messages renders the prompt vLLM's Anthropic adapter generates from;
and a ``/v1/responses`` stream, after the same check against vLLM's Responses server.

One real vLLM worker (about 3 GB): run it under the machine's heavy-test lock.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gpupool.gateway.transform.messages_continuation import chat_messages
from gpupool.gateway.transform.responses_continuation import (
    AsResponses,
    ResponsesProgress,
)
from gpupool.gateway.transform.responses_continuation import (
    chat_messages as responses_chat_messages,
)
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, free_port, gateway, running
from tests.support.template_worker import ANSWER
from tests.vllm.conftest import BIG_WINDOW, MODEL, _paths, _worker, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DIE_AFTER = 9  # the fake's pieces before it dies: "<think>Let me see.</think>The answer is"
MAX_TOKENS = 40
MESSAGES = [{"role": "user", "content": "What is the answer?"}]


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    tmp = tmp_path_factory.mktemp("think")
    port = free_port()  # the fake's window is the smaller: on equal load it is ranked first
    # its ids are not the real tokenizer's: it returns none, so the answer goes on from its text
    argv = [sys.executable, "-m", "tests.support.template_worker", "--port", str(port),
            "--model", MODEL, "--window", "1024", "--die-after", str(DIE_AFTER),
            "--no-token-ids"]  # fmt: skip
    fake = Proc(argv, f"http://127.0.0.1:{port}", tmp / "fake.log")
    cfg = {
        "server": {"expose_worker_header": True},
        "models": [{"name": MODEL}],
        "workers": [
            {"name": "fake", "model": MODEL, "url": fake.url, "max_inflight": 4},
            _worker("real", models / "qwen3-dense", BIG_WINDOW, py),
        ],
        "routing": {
            "prefix_affinity": False,
            "health_interval_s": 1.0,
            "fail_threshold": 2,
            "health_timeout_s": 30,
        },
    }
    gw = gateway(cfg, tmp)
    with running(fake, gw):
        wait_ready(gw, timeout=600, names=("fake", "real"))
        real = {w["name"]: w for w in httpx.get(gw.url + "/admin/workers").json()["data"]}
        yield {"gw": gw, "fake": fake, "real": real["real"]["url"]}


def _chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "temperature": 0, "seed": 5,
            "max_tokens": MAX_TOKENS, **extra}  # fmt: skip


def _stream(url: str) -> tuple[str | None, list[Any]]:
    events: list[Any] = []
    body = _chat(MESSAGES, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
        return r.headers.get("x-gpupool-worker"), events


def _ids(url: str, body: dict[str, Any]) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": MODEL, **body}, timeout=60)
    r.raise_for_status()
    return list(r.json()["tokens"])


def test_answer_past_think_continues_whole_on_real_vllm(pool: dict[str, Any]) -> None:
    gw, real = pool["gw"], pool["real"]
    prefix = "".join(ANSWER[:DIE_AFTER])
    assert "</think>" in prefix
    # the premise: vLLM refuses this partial answer as a continued chat message
    partial = [*MESSAGES, {"role": "assistant", "content": prefix}]
    r = httpx.post(real + "/v1/chat/completions", timeout=120, json=_chat(
        partial, continue_final_message=True, add_generation_prompt=False))  # fmt: skip
    assert r.status_code == 400 and "does not appear in the chat" in r.text, r.text

    # until the fake takes one (the real answers the others whole); 30: beside two CPU burners
    # at 53fdce4 routing sent 6 and 20 in a row to the real worker (its pace looked better)
    for _ in range(30):
        first, events = _stream(gw.url)
        if first == "fake":
            break
    assert first == "fake", "the fake worker never took a request"
    objs = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in o for o in objs), objs
    text = "".join(c["delta"].get("content") or "" for o in objs for c in o["choices"])
    assert len({o["id"] for o in objs}) == 1
    assert sum("role" in c["delta"] for o in objs for c in o["choices"]) == 1
    assert any(c.get("finish_reason") for o in objs for c in o["choices"])

    rendered = _ids(real, {"messages": MESSAGES, "add_generation_prompt": True})
    ids = rendered + _ids(real, {"prompt": prefix, "add_special_tokens": False})
    direct = httpx.post(real + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": ids, "temperature": 0, "seed": 5,
        "max_tokens": MAX_TOKENS - DIE_AFTER}).json()  # fmt: skip
    assert text == prefix + direct["choices"][0]["text"]  # nothing repeated or lost at the cut
    usage = objs[-1]["usage"]
    assert usage["prompt_tokens"] == len(rendered)
    assert usage["completion_tokens"] == DIE_AFTER + direct["usage"]["completion_tokens"]
    assert "as a completion" in gw.logs()
    assert_nothing_held(gw.url, within_s=5)


PARTS = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the answer?"}]
CONVERSATION = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
    {"role": "user", "content": PARTS},
]  # fmt: skip


def _messages(**extra: Any) -> dict[str, Any]:
    # no system prompt: the tiny model's template reads content as parts (vLLM's "openai"
    # format) and cannot add a system message's parts to a string, through the adapter too
    return {"model": MODEL, "messages": CONVERSATION, "temperature": 0, "max_tokens": MAX_TOKENS,
            **extra}  # fmt: skip


def _greedy(real: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "temperature": 0, "max_tokens": max_tokens}
    out: dict[str, Any] = httpx.post(real + "/v1/completions", json=body, timeout=300).json()
    return out


def _anthropic_stream(url: str) -> tuple[str | None, list[dict[str, Any]]]:
    with httpx.stream("POST", url + "/v1/messages", json=_messages(stream=True), timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        return r.headers.get("x-gpupool-worker"), events


def test_messages_stream_continues_on_real_vllm(pool: dict[str, Any]) -> None:
    """A ``/v1/messages`` stream cut mid-answer goes on on the real worker as a completion of
    the adapter's rendering: first, that rendering is the adapter's (its greedy answer is the
    completion's of the converted messages, token for token); then the client's text is the
    fake's prefix followed by exactly the real worker's greedy completion after it."""
    gw, real = pool["gw"], pool["real"]
    rendered = _ids(real, {"messages": chat_messages(_messages()), "add_generation_prompt": True})
    whole = httpx.post(real + "/v1/messages", json=_messages(), timeout=300).json()
    text = "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    assert text and text == _greedy(real, rendered, MAX_TOKENS)["choices"][0]["text"]

    fake = pool["fake"]
    if fake.proc is not None and fake.proc.poll() is not None:  # died in the chat test: again
        fake.start()
        wait_ready(gw, timeout=120, names=("fake", "real"))
    # until the fake takes one (the real answers the others whole); 30: beside two CPU burners
    # at 53fdce4 routing sent 6 and 20 in a row to the real worker (its pace looked better)
    for _ in range(30):
        first, events = _anthropic_stream(gw.url)
        if first == "fake":
            break
    assert first == "fake", "the fake worker never took a request"
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds.count("message_stop") == 1 and kinds[-1] == "message_stop"
    assert kinds.count("message_start") == 1 and {e["message"]["id"] for e in events[:1]}
    got = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    prefix = "".join(ANSWER[:DIE_AFTER])
    ids = rendered + _ids(real, {"prompt": prefix, "add_special_tokens": False})
    direct = _greedy(real, ids, MAX_TOKENS - DIE_AFTER)
    assert got == prefix + direct["choices"][0]["text"]  # nothing repeated or lost at the cut
    usage = next(e["usage"] for e in events if e["type"] == "message_delta")
    assert usage["input_tokens"] == len(rendered)
    assert usage["output_tokens"] == DIE_AFTER + direct["usage"]["completion_tokens"]
    assert "a /v1/messages answer" in gw.logs()
    assert_nothing_held(gw.url, within_s=5)


RESPONSES_INPUT = [
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": [{"type": "input_text", "text": "What is"},
                                 {"type": "input_text", "text": "the answer?"}]},
]  # fmt: skip


def _response(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": RESPONSES_INPUT, "temperature": 0,
            "max_output_tokens": MAX_TOKENS, **extra}  # fmt: skip


def _responses_stream(url: str) -> tuple[str | None, list[dict[str, Any]]]:
    with httpx.stream("POST", url + "/v1/responses", json=_response(stream=True), timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        return r.headers.get("x-gpupool-worker"), events


def test_responses_stream_continues_on_real_vllm(pool: dict[str, Any]) -> None:
    """A ``/v1/responses`` stream cut mid-answer goes on on the real worker as a completion of
    vLLM's rendering: first, the gateway's conversion of its input renders the prompt vLLM's
    Responses server generates from (its greedy answer is the completion's of the converted
    messages, token for token); then the client reads one valid stream whose text is the
    fake's prefix followed by exactly the real worker's greedy completion after it."""
    gw, real = pool["gw"], pool["real"]
    messages = responses_chat_messages(_response())
    rendered = _ids(real, {"messages": messages, "add_generation_prompt": True})
    whole = httpx.post(real + "/v1/responses", json=_response(), timeout=300).json()
    text = "".join(c["text"] for item in whole["output"] for c in item.get("content") or [])
    assert text and text == _greedy(real, rendered, MAX_TOKENS)["choices"][0]["text"]

    fake = pool["fake"]
    if fake.proc is not None and fake.proc.poll() is not None:  # died in a test before: again
        fake.start()
        wait_ready(gw, timeout=120, names=("fake", "real"))
    for _ in range(30):  # until the fake takes one (the real answers the others whole)
        first, events = _responses_stream(gw.url)
        if first == "fake":
            break
    assert first == "fake", "the fake worker never took a request"
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds[-1] == "response.completed"
    assert kinds.count("response.created") == kinds.count("response.completed") == 1
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert {e["item_id"] for e in deltas} == {"msg_first"}
    got = "".join(e["delta"] for e in deltas)
    prefix = "".join(ANSWER[:DIE_AFTER])
    ids = rendered + _ids(real, {"prompt": prefix, "add_special_tokens": False})
    direct = _greedy(real, ids, MAX_TOKENS - DIE_AFTER)
    assert got == prefix + direct["choices"][0]["text"]  # nothing repeated or lost at the cut
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"]
    assert final["output"][0]["content"][0]["text"] == got
    assert final["usage"]["input_tokens"] == len(rendered)
    assert final["usage"]["output_tokens"] == DIE_AFTER + direct["usage"]["completion_tokens"]
    assert "a /v1/responses answer" in gw.logs()
    assert_nothing_held(gw.url, within_s=5)


def _sse(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def _keys(events: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Each event type's fields, and those of the objects it carries, as one set per type."""
    out: dict[str, set[str]] = {}
    for e in events:
        keys = set(e)
        for inner in ("response", "item", "part"):
            if isinstance(e.get(inner), dict):
                keys |= {f"{inner}.{k}" for k in e[inner]}
        out.setdefault(e["type"], set()).update(keys)
    return out


def test_responses_events_are_framed_as_vllm_frames_them(pool: dict[str, Any]) -> None:
    """The gateway reads a real vLLM Responses stream as it went out (its text, last sequence
    number, end), and the events it frames itself after a cut carry the fields vLLM's carry:
    a stream cut after its third delta and ended by re-framed completion chunks has vLLM's
    event types in vLLM's order, the same fields each, and the same text and status."""
    real = pool["real"]
    with httpx.stream("POST", real + "/v1/responses", json=_response(stream=True),
                      timeout=300) as r:  # fmt: skip
        assert r.status_code == 200
        raw = r.read()
    theirs = _sse(raw)
    whole = ResponsesProgress()
    whole.feed(raw)
    deltas = [e["delta"] for e in theirs if e["type"] == "response.output_text.delta"]
    assert whole.text == "".join(deltas) and whole.tokens == len(deltas) >= 4
    assert whole.seq == theirs[-1]["sequence_number"] and whole.finished
    final = theirs[-1]["response"]

    cut = [i for i, e in enumerate(theirs) if e["type"] == "response.output_text.delta"][2]
    progress = ResponsesProgress()
    before = b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
                      for e in theirs[: cut + 1])  # fmt: skip
    progress.feed(before)
    reframe = AsResponses(progress, prompt=final["usage"]["input_tokens"])
    finish = "length" if final["status"] == "incomplete" else "stop"
    chunks = b""
    for i, text in enumerate(deltas[3:]):
        last = i == len(deltas) - 4
        choice = {"index": 0, "text": text, "finish_reason": finish if last else None}
        chunks += b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
    usage = {"prompt_tokens": 99, "completion_tokens": len(deltas) - 3, "total_tokens": 0}
    chunks += b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
    ours = theirs[: cut + 1] + _sse(reframe.rewrite(chunks + b"data: [DONE]\n\n"))

    assert [e["type"] for e in ours] == [e["type"] for e in theirs]
    assert [e["sequence_number"] for e in ours] == [e["sequence_number"] for e in theirs]
    assert _keys(ours[cut + 1 :]) == {t: k for t, k in _keys(theirs).items()
                                      if t in _keys(ours[cut + 1 :])}  # fmt: skip
    mine = ours[-1]["response"]
    assert (mine["id"], mine["status"], mine["incomplete_details"]) == (
        final["id"], final["status"], final["incomplete_details"])  # fmt: skip
    assert mine["output"][0]["content"][0]["text"] == final["output"][0]["content"][0]["text"]
    assert mine["usage"]["output_tokens"] == len(deltas)
