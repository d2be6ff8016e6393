"""API fidelity: what a client sees through gpupool equals what vLLM with the right parsers gives.

One gateway supervises two real vLLM (CPU) workers of the same tiny dense Qwen3 model:

* ``parsed`` serves model ``tiny-p`` (``reasoning: qwen3``, ``tool_call_parser: hermes``): gpupool
  launches it with ``--reasoning-parser qwen3 --tool-call-parser hermes
  --enable-auto-tool-choice`` by itself, so vLLM splits and the gateway only passes through.
* ``raw`` serves model ``tiny`` with ``reasoning-parser: false`` in its args: it returns raw
  ``<think>`` text and the gateway splits, as for a ``url:`` worker without a parser.

The reference is always the ``parsed`` worker asked directly. Same weights, greedy decoding or a
fixed seed: the tokens are the same, so content, reasoning, tool calls, finish reasons, usage,
the chunks of a stream and error statuses must be equal. Fields that name the request (ids,
``created``, the model name, fingerprints) are left out of the comparison.

``GPUPOOL_CONFORMANCE_GATEWAY=http://host:port`` runs the suite against a gateway already
running (serving ``tiny-p`` and ``tiny``) instead of starting one; the two workers' direct URLs
come from its ``/admin/workers`` or from ``GPUPOOL_CONFORMANCE_WORKERS="<parsed> <raw>"``. That is
how the suite was run against today's main: a main gateway in front of these same workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.support.procs import gateway, running
from tests.vllm.conftest import Shared, _paths, _worker, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PARSED, SPLIT = "tiny-p", "tiny"
WINDOW = 2048
# Issue 12's item 2 (a queued stream that times out is a real 429 the SDK retries) is tested in
# tests/e2e/test_queue_e2e with simulated workers: a tiny model on vLLM generates too fast to hold
# its slots long enough for a request to time out behind them.
ENV_GATEWAY = "GPUPOOL_CONFORMANCE_GATEWAY"
ENV_WORKERS = "GPUPOOL_CONFORMANCE_WORKERS"

Json = dict[str, Any]


@dataclass(frozen=True)
class Stack:
    gw: str  # the gateway
    parsed: str  # the `parsed` worker, direct
    raw: str  # the `raw` worker, direct

    def client(self, base: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)


def _config(py: Any, models: Any) -> Json:
    parsed = _worker("parsed", models / "qwen3-dense", WINDOW, py)
    parsed["model"] = PARSED
    del parsed["launch"]["args"]["reasoning-parser"]  # the model's parsers apply
    raw = _worker("raw", models / "qwen3-dense", WINDOW, py)  # reasoning-parser: false
    raw["model"] = SPLIT
    raw["launch"]["env"]["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"  # stored responses (issue 35)
    return {
        "server": {"expose_worker_header": True},
        "models": [
            {"name": PARSED, "reasoning": "qwen3", "tool_call_parser": "hermes"},
            {"name": SPLIT, "reasoning": "qwen3"},
        ],
        "workers": [parsed, raw],
        "routing": {"health_interval_s": 1.0, "fail_threshold": 2},
    }


def _stack(url: str) -> Stack:
    if os.environ.get(ENV_WORKERS):
        parsed, raw = os.environ[ENV_WORKERS].split()
        return Stack(url, parsed, raw)
    data = httpx.get(url + "/admin/workers", timeout=10).json()["data"]
    urls = {w["name"]: w["url"] for w in data}
    return Stack(url, urls["parsed"], urls["raw"])


def _whitespace_bias(py: Any, models: Any) -> dict[str, int]:
    """``logit_bias`` keeping the tiny random model from padding JSON with whitespace for ever
    (the grammar allows any whitespace; a random model takes it)."""
    code = ("import json,sys; from transformers import AutoTokenizer as A; "
            "t = A.from_pretrained(sys.argv[1]); "
            "print(json.dumps([i for i in range(len(t)) "
            "if not t.decode([i]).strip()]))")  # fmt: skip
    out = subprocess.run([str(py), "-c", code, str(models / "qwen3-dense")], check=True,
                         capture_output=True, text=True, timeout=300).stdout  # fmt: skip
    return {str(i): -100 for i in json.loads(out.strip().splitlines()[-1])}


@pytest.fixture(scope="module")
def bias() -> dict[str, int]:
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    return _whitespace_bias(py, models)


def start_stack(exit_stack: contextlib.ExitStack, tmp: pytest.TempPathFactory) -> Stack:
    """The gateway and its two workers, stopped when ``exit_stack`` closes; or the gateway named
    by ``GPUPOOL_CONFORMANCE_GATEWAY``."""
    if os.environ.get(ENV_GATEWAY):
        return _stack(os.environ[ENV_GATEWAY].rstrip("/"))
    py, models = _paths()
    if not py.exists() or not (models / "qwen3-dense" / "config.json").exists():
        pytest.skip("real vLLM not set up (run `make test`, which installs it and the models)")
    gw = gateway(_config(py, models), tmp.mktemp("conformance"))
    exit_stack.enter_context(running(gw))
    wait_ready(gw, timeout=420, names=("parsed", "raw"))
    return _stack(gw.url)


@pytest.fixture
def stack(conformance: Shared[Stack]) -> Stack:
    """One stack for this file, ``test_api_fidelity.py`` and ``test_usage_and_split.py``, which
    only read it (``tests/vllm/conftest.py``'s ``conformance``)."""
    return conformance.get()


# ---- what a client sees ---------------------------------------------------------------------


def _post(url: str, path: str, body: Json) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _tool_calls(calls: Any) -> Any:
    if not calls:
        return None
    return [(c.get("type"), c["function"]["name"], c["function"].get("arguments")) for c in calls]


def _logprobs(lp: Any) -> Any:
    if not lp:
        return lp
    content = lp.get("content") if isinstance(lp, dict) else None
    if content is None:
        return lp.get("tokens") if isinstance(lp, dict) else lp
    return [(t["token"], [x["token"] for x in t.get("top_logprobs") or []]) for t in content]


def _usage(usage: Any) -> Any:
    if not isinstance(usage, dict):
        return usage
    details = usage.get("completion_tokens_details") or {}
    return (usage.get("prompt_tokens"), usage.get("completion_tokens"),
            details.get("reasoning_tokens"))  # fmt: skip


def seen(body: Json) -> Json:
    """A chat or completion body as a client compares it."""
    choices = []
    for c in body.get("choices", []):
        msg = c.get("message") or {}
        choices.append({
            "index": c.get("index"), "text": c.get("text"),
            "content": msg.get("content"), "reasoning": msg.get("reasoning"),
            "tool_calls": _tool_calls(msg.get("tool_calls")),
            "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason"),
            "logprobs": _logprobs(c.get("logprobs")),
        })  # fmt: skip
    return {"choices": choices, "usage": _usage(body.get("usage"))}


def seen_stream(r: httpx.Response) -> list[Any]:
    """Every event of a stream as a client compares it, in order: one entry per chunk."""
    assert r.status_code == 200, r.text
    out: list[Any] = []
    for line in r.text.split("\n\n"):
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            out.append("[DONE]")
            continue
        obj = httpx.Response(200, content=data).json()
        if "error" in obj:
            out.append(("error", obj["error"].get("type"), obj["error"].get("code")))
            continue
        for c in obj.get("choices", []):
            delta = c.get("delta") or {}
            delta = {k: v for k, v in delta.items() if v not in (None, "") or k == "content"}
            if "tool_calls" in delta:
                delta["tool_calls"] = [(t.get("index"), (t.get("function") or {}).get("name"),
                                        (t.get("function") or {}).get("arguments"))
                                       for t in delta["tool_calls"]]  # fmt: skip
            out.append((c.get("index"), delta, c.get("finish_reason"),
                        _logprobs(c.get("logprobs"))))  # fmt: skip
        if obj.get("usage") is not None:
            out.append(("usage", _usage(obj["usage"])))
    return out


def same_split(ours: Json, theirs: Json) -> None:
    """Equal, except that ``reasoning_tokens`` of a gateway split may differ by a token or two:
    vLLM counts the reasoning parser's token ids, the gateway counts text
    (docs/reference/vllm-differences.md)."""
    (p1, c1, r1), (p2, c2, r2) = ours.pop("usage"), theirs.pop("usage")
    assert (p1, c1) == (p2, c2)
    assert r1 is not None and r2 is not None and abs(r1 - r2) <= 2
    assert ours == theirs


def _error(r: httpx.Response) -> tuple[int, Any]:
    body = r.json()
    err = body.get("error") if isinstance(body, dict) else None
    return r.status_code, err.get("type") if isinstance(err, dict) else err


def _pair(stack: Stack, path: str, body: Json, model: str) -> tuple[httpx.Response, httpx.Response]:
    """The same request through gpupool (``model``) and to the parsed worker directly."""
    ours = _post(stack.gw, path, {**body, "model": model})
    theirs = _post(stack.parsed, path, {**body, "model": PARSED})
    return ours, theirs


# ---- the matrix -------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hello there, tell me something"}]
CHAT = {"messages": MSG, "max_tokens": 24, "temperature": 0}
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}]  # fmt: skip
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size"],
          "properties": {"ok": {"type": "boolean"},
                         "size": {"enum": ["small", "large"]}}}  # fmt: skip
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                      "strict": True}}  # fmt: skip

CASES: list[tuple[str, Json]] = [
    ("plain", CHAT),
    ("n=2 seeded", {**CHAT, "n": 2, "temperature": 1.0, "seed": 7}),
    ("logprobs", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    ("stop", {**CHAT, "stop": ["e", "a"]}),
    ("seed", {**CHAT, "temperature": 1.0, "seed": 1234}),
    ("thinking off", {**CHAT, **NO_THINK}),
    ("include_reasoning false", {**CHAT, "include_reasoning": False}),
    ("tools auto", {**CHAT, "tools": TOOLS, "tool_choice": "auto"}),
    ("tools none", {**CHAT, "tools": TOOLS, "tool_choice": "none"}),
    ("tools required", {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 48}),
    ("tools named", {**CHAT, "tools": TOOLS, "max_tokens": 48,
                     "tool_choice": {"type": "function", "function": {"name": "lookup"}}}),
    ("json_object", {**CHAT, **NO_THINK, "response_format": {"type": "json_object"}}),
    ("json_schema", {**CHAT, **NO_THINK, "response_format": JSON_SCHEMA, "max_tokens": 48}),
]  # fmt: skip
CASE_IDS = [c[0] for c in CASES]
ERRORS: list[tuple[str, str, Json]] = [
    ("max_tokens too big", "/v1/chat/completions", {**CHAT, "max_tokens": WINDOW + 1}),
    ("messages not a list", "/v1/chat/completions", {"messages": "x"}),
    ("stream_options without stream", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}),
    ("named tool not given", "/v1/chat/completions",
     {**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("bad response_format", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "xml"}}),
    ("completion max_tokens too big", "/v1/completions",
     {"prompt": "hello", "max_tokens": WINDOW + 1}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body"), CASES, ids=CASE_IDS)
def test_passthrough_worker_side_parser(stack: Stack, name: str, body: Json) -> None:
    """gpupool in front of a worker it launched with vLLM's parsers changes nothing a client
    sees; on today's main the worker has no parser and the gateway splits (item 1)."""
    ours, theirs = _pair(stack, "/v1/chat/completions", body, PARSED)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert seen(ours.json()) == seen(theirs.json())


SPLIT_CASES = [c for c in CASES if c[0] not in ("tools auto", "tools required", "tools named")]


@pytest.mark.parametrize(("name", "body"), SPLIT_CASES, ids=[c[0] for c in SPLIT_CASES])
def test_gateway_split_equals_vllm_parser(stack: Stack, name: str, body: Json) -> None:
    """The gateway's split of a raw worker's text equals vLLM's own parser on the same tokens.
    A grammar-bound request is not split: its whole output is content, as from vLLM."""
    ours, theirs = _pair(stack, "/v1/chat/completions", body, SPLIT)
    assert ours.status_code == theirs.status_code == 200, ours.text
    same_split(seen(ours.json()), seen(theirs.json()))


STREAMED = ("plain", "n=2 seeded", "logprobs", "thinking off", "include_reasoning false",
            "json_object")  # fmt: skip
STREAM_CASES = [c for c in CASES if c[0] in STREAMED]


def coalesced(events: list[Any]) -> dict[Any, list[Any]]:
    """Each choice's chunks (and the usage and end events) on their own, adjacent chunks carrying
    the same fields merged: vLLM merges tokens into one chunk when its reader lags and
    interleaves choices as its steps go, so chunk boundaries and the order between choices
    differ between two runs; what each field of a choice carries, in which order, does not."""
    out: dict[Any, list[Any]] = {}
    for e in events:
        key = e[0] if isinstance(e, tuple) and len(e) == 4 else "end"
        run = out.setdefault(key, [])
        prev = run[-1] if run else None
        if (key != "end" and prev is not None and prev[2] is None and set(e[1]) == set(prev[1])
                and "role" not in e[1] and "tool_calls" not in e[1]):  # fmt: skip
            delta = {k: prev[1][k] + e[1][k] for k in e[1]}
            lps = (prev[3] or []) + (e[3] or []) if (prev[3] or e[3]) else None
            run[-1] = (e[0], delta, e[2], lps)
        else:
            run.append(e)
    return out


@pytest.mark.parametrize("model", [PARSED, SPLIT])
@pytest.mark.parametrize(("name", "body"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_stream_matches_vllm(stack: Stack, name: str, body: Json, model: str) -> None:
    """Streams: the same fields in the same order, the same finish reasons and final usage
    with ``reasoning_tokens``, whether vLLM or the gateway splits (items 1 and 4)."""
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    ours, theirs = _pair(stack, "/v1/chat/completions", streamed, model)
    mine, vllm = coalesced(seen_stream(ours)), coalesced(seen_stream(theirs))
    # vLLM's own streamed reasoning_tokens for n > 1 varied by one between two runs of the same
    # seeded request with the same text (a CI run under load): compared as a split's are
    if model == SPLIT or body.get("n", 1) > 1:
        (_, u1), (_, u2) = mine["end"][0], vllm["end"][0]
        same_split({"usage": u1}, {"usage": u2})
        mine["end"], vllm["end"] = mine["end"][1:], vllm["end"][1:]
    assert mine == vllm


@pytest.mark.parametrize("extra", [{}, NO_THINK, {"n": 2, "temperature": 1.0, "seed": 3}],
                         ids=["thinking", "thinking off", "n=2"])  # fmt: skip
def test_gateway_split_streams_token_for_token(stack: Stack, extra: Json) -> None:
    """Item 3: each chunk the gateway sends carries the text of its own tokens (logprobs), so
    no whitespace or other text waits for a later chunk; only a possible tag may."""
    body = {**CHAT, **extra, "model": SPLIT, "stream": True, "logprobs": True}
    for index, delta, _, lps in [e for e in seen_stream(_post(stack.gw, "/v1/chat/completions",
                                                              body)) if len(e) == 4]:  # fmt: skip
        text = (delta.get("reasoning") or "") + (delta.get("content") or "")
        tokens = "".join(t for t, _ in lps or [])
        text, tokens = text.replace("\ufffd", ""), tokens.replace("\ufffd", "")  # split UTF-8
        assert len(text) <= len(tokens) or "<" in text, (index, delta, lps)


@pytest.mark.parametrize("model", [PARSED, SPLIT])
def test_stream_and_body_agree_on_usage(stack: Stack, model: str) -> None:
    for extra in ({}, {"include_reasoning": False}):
        body = {**CHAT, **extra, "model": model}
        whole = _post(stack.gw, "/v1/chat/completions", body).json()
        stream = seen_stream(_post(stack.gw, "/v1/chat/completions",
                                   {**body, "stream": True,
                                    "stream_options": {"include_usage": True}}))  # fmt: skip
        assert ("usage", _usage(whole["usage"])) in stream


@pytest.mark.parametrize(("name", "path", "body"), ERRORS, ids=[e[0] for e in ERRORS])
@pytest.mark.parametrize("model", [PARSED, SPLIT])
def test_errors_have_vllm_status_and_type(
    stack: Stack, name: str, path: str, body: Json, model: str
) -> None:
    ours, theirs = _pair(stack, path, body, model)
    assert theirs.status_code >= 400
    assert _error(ours) == _error(theirs)


def test_completions_match(stack: Stack) -> None:
    body = {"prompt": "once upon a time", "max_tokens": 16, "temperature": 0, "logprobs": 2,
            "echo": True}  # fmt: skip
    for model in (PARSED, SPLIT):
        ours, theirs = _pair(stack, "/v1/completions", body, model)
        assert seen(ours.json()) == seen(theirs.json())


# ---- client libraries -----------------------------------------------------------------------


class Answer(BaseModel):
    ok: bool
    size: Literal["small", "large"]  # no free text: a nudged `</think>` cannot fill it


def _parse(stack: Stack, base: str, model: str, bias: dict[str, int], **extra: Any) -> Any:
    return stack.client(base).chat.completions.parse(
        model=model, messages=MSG, response_format=Answer, max_tokens=48, temperature=0,
        logit_bias=bias, **extra,
    )  # fmt: skip


def test_sdk_parse_through_gateway_split(stack: Stack, bias: dict[str, int]) -> None:
    """Item 1: ``reasoning: qwen3`` on a worker without a parser and a json_schema request:
    the JSON is content, ``.parse()`` gives the object, as the same worker answers directly."""
    ours = _parse(stack, stack.gw, SPLIT, bias).choices[0].message
    direct = _parse(stack, stack.raw, SPLIT, bias).choices[0].message
    assert ours.content == direct.content and ours.content is not None
    assert ours.parsed == direct.parsed and isinstance(ours.parsed, Answer)
    assert not (ours.model_extra or {}).get("reasoning")


@pytest.mark.parametrize("thinking", [True, False])
def test_sdk_parse_with_worker_side_parser(
    stack: Stack, bias: dict[str, int], thinking: bool
) -> None:
    """The launched worker splits with vLLM's parser and applies the grammar after the
    reasoning: thinking on (the tiny model is nudged to close its thought at once) or off."""
    think_end = _token_id(stack, "</think>")
    nudged = {**bias, think_end: 30} if thinking else bias
    extra = {} if thinking else {"extra_body": NO_THINK}
    ours = _parse(stack, stack.gw, PARSED, nudged, **extra).choices[0].message
    direct = _parse(stack, stack.parsed, PARSED, nudged, **extra).choices[0].message
    assert isinstance(ours.parsed, Answer) and ours.parsed == direct.parsed
    assert ours.content == direct.content


def _token_id(stack: Stack, text: str) -> str:
    r = _post(stack.parsed, "/tokenize", {"model": PARSED, "prompt": text,
                                           "add_special_tokens": False})  # fmt: skip
    tokens = r.json()["tokens"]
    assert len(tokens) == 1
    return str(tokens[0])


def test_langchain_with_structured_output(stack: Stack, bias: dict[str, int]) -> None:
    from langchain_openai import ChatOpenAI

    def ask(base: str, model: str) -> Any:
        llm = ChatOpenAI(base_url=base + "/v1", api_key="x",  # type: ignore[arg-type]
                         model=model, temperature=0, max_tokens=48,  # type: ignore[call-arg]
                         max_retries=0, logit_bias=bias)  # fmt: skip
        return llm.with_structured_output(Answer, method="json_schema").invoke("hello")

    ours = ask(stack.gw, SPLIT)
    assert isinstance(ours, Answer) and ours == ask(stack.raw, SPLIT)


# ---- Responses and Messages APIs ------------------------------------------------------------

RESPONSES = {"input": "hello there, tell me something", "max_output_tokens": 24,
             "temperature": 0}  # fmt: skip


def _items(body: Json) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for item in body.get("output", []):
        texts = [c.get("text") for c in item.get("content") or []]
        out.append((item["type"], texts))
    return out


def test_responses_passthrough_worker_side_parser(stack: Stack) -> None:
    ours, theirs = _pair(stack, "/v1/responses", RESPONSES, PARSED)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert _items(ours.json()) == _items(theirs.json())
    assert _items(ours.json())[0][0] == "reasoning"


def test_responses_gateway_split_gives_reasoning_items(stack: Stack) -> None:
    ours, theirs = _pair(stack, "/v1/responses", RESPONSES, SPLIT)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert _items(ours.json()) == _items(theirs.json())


def test_responses_stream_gateway_split_gives_reasoning_events(stack: Stack) -> None:
    body = {**RESPONSES, "stream": True}
    ours, theirs = _pair(stack, "/v1/responses", body, SPLIT)

    def events(r: httpx.Response) -> list[tuple[str, Any]]:
        """(event, delta) in order; consecutive deltas of one kind joined, since vLLM merges
        tokens into one event when its reader lags (boundaries differ between two runs)."""
        out: list[tuple[str, Any]] = []
        for block in r.text.split("\n\n"):
            lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
            if "event" in lines:
                obj = httpx.Response(200, content=lines["data"]).json()
                kind, delta = lines["event"], obj.get("delta")
                if out and kind.endswith(".delta") and out[-1][0] == kind:
                    out[-1] = (kind, out[-1][1] + delta)
                else:
                    out.append((kind, delta))
        return out

    assert events(ours) == events(theirs)


def test_anthropic_messages_and_count_tokens(stack: Stack) -> None:
    import anthropic

    def ask(base: str, model: str) -> tuple[Any, int]:
        client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
        msgs: Any = [{"role": "user", "content": "hello there"}]
        reply = client.messages.create(model=model, max_tokens=16, messages=msgs,
                                       extra_body={"temperature": 0})  # fmt: skip
        count = client.messages.count_tokens(model=model, messages=msgs).input_tokens
        return [(b.type, getattr(b, "text", None)) for b in reply.content], count

    assert ask(stack.gw, PARSED) == ask(stack.parsed, PARSED)
