"""Fuzzing: schemathesis against the gateway's own `/openapi.json` (a real `gpupool serve` with
simulated workers behind it), and hypothesis against the body parsers.

The verdicts: no 5xx and no hang for any generated request, every error in the OpenAI envelope,
the gateway still serving (nothing left in flight) afterwards; the parsers raise nothing but
`GatewayError`s with a 4xx status, whatever bytes or JSON-like values they are given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from gpupool.gateway.errors import GatewayError
from gpupool.gateway.parse import load_json, parse_generate
from tests.support.fault_tools import MODEL, fresh_request, gateway_config, settled
from tests.support.procs import Proc, gateway, running, sim

REQUEST_TIMEOUT_S = 10.0  # a generated request answered later than this is a hang
MAX_EXAMPLES = 50  # per operation and generation mode (eight runs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("fuzz")
    small = sim(model=MODEL, tmp=tmp, max_model_len=512, max_num_seqs=8, mode="echo")
    big = sim(model=MODEL, tmp=tmp, max_model_len=4096, max_num_seqs=8, output_tokens=8)
    cfg = gateway_config(
        [("small", small, 4), ("big", big, 4)],
        queue={"max_queued": 64, "max_wait_s": 5},
        server={"upstream_read_timeout_s": 5.0, "upstream_total_timeout_s": 5.0},
    )
    gw = gateway(cfg, tmp)
    with running(small, big), running(gw, ready_path="/ready"):
        yield {"gw": gw, "small": small, "big": big}


@pytest.fixture(scope="module")
def gateway_schema(stack: dict[str, Proc]) -> Any:
    """The document the gateway serves. (Not `schemathesis.pytest.from_fixture`: with pytest 9
    it fails on `request.node._nodeid`; strategies under a plain `@given` do the same work.)"""
    schema = schemathesis.openapi.from_url(stack["gw"].url + "/openapi.json")
    schema.config.max_stream_events = 100_000  # read every stream to its end (default: 20 events)
    return schema


OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/v1/responses/{response_id}"),  # stored responses: any id, never a 5xx
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("GET", "/v1/responses/{response_id}/input_items"),
]


def test_the_fuzzed_operations_are_all_of_the_document(gateway_schema: Any) -> None:
    paths = gateway_schema.raw_schema["paths"]
    assert sorted((m.upper(), p) for p, ops in paths.items() for m in ops) == sorted(OPERATIONS)


def _prepare(case: Any) -> None:
    """Most generated model names are unknown (404 before anything else is looked at): send
    half of the bodies that name a model to the served one instead."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and len(body["model"]) % 2:
        body["model"] = MODEL


def _check(case: Any) -> None:
    response = case.call(timeout=REQUEST_TIMEOUT_S)  # raises on a hang
    sent = repr(case.body)[:1000] if case.body is not NOT_SET else ""
    shown = f"{case.method} {case.path} {sent}\n-> {response.status_code}: {response.text[-300:]}"
    assert response.status_code < 500, shown
    if response.status_code >= 400:
        err = json.loads(response.content)["error"]
        assert err["code"] == response.status_code and err["message"], shown
        assert "Traceback" not in response.text and "127.0.0.1" not in response.text, shown
    elif "text/event-stream" in str(response.headers.get("content-type")):
        assert not response.stream_cut_short, shown  # a stream silent for the whole timeout
        assert response.content.rstrip().endswith(b"data: [DONE]"), shown


# Negative cases need something to make invalid: a route without a body has nothing.
CASES = [
    (m, p, mode)
    for m, p in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if (m == "POST" and "{" not in p) or mode is GenerationMode.POSITIVE
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=str)
def test_generated_requests_get_no_5xx_and_no_hang(
    gateway_schema: Any, method: str, path: str, mode: GenerationMode
) -> None:
    strategy = gateway_schema[path][method].as_strategy(generation_mode=mode)

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def fuzz(case: Any) -> None:
        _prepare(case)
        _check(case)

    fuzz()


def test_n_above_the_documented_maximum_is_refused(stack: dict[str, Proc]) -> None:
    r = httpx.post(
        stack["gw"].url + "/v1/completions",
        timeout=REQUEST_TIMEOUT_S,
        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "n": 17},  # server.max_n is 16
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"


def test_gateway_still_serves_after_fuzzing(stack: dict[str, Proc]) -> None:
    gw = stack["gw"]
    settled([gw], [stack["small"], stack["big"]])
    assert fresh_request(gw).label == "200"
    assert fresh_request(gw, stream=True).label == "200"


# ---- the parsers --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
_FIELDS = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "priority",
    "n",
    "role",
    "content",
]
request_like = st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=8), json_values)


def _only_4xx(e: GatewayError) -> None:
    assert 400 <= e.status < 500, (type(e).__name__, e.status, e.message)
    assert e.message


def _parse_everything(raw: bytes, max_depth: int) -> None:
    for chat in (True, False):
        try:
            parse_generate(raw, chat=chat, max_depth=max_depth)
        except GatewayError as e:
            _only_4xx(e)
    try:
        load_json(raw, max_depth)
    except GatewayError as e:
        _only_4xx(e)


@settings(max_examples=400, deadline=None)
@given(raw=st.binary(max_size=512), max_depth=st.integers(1, 70))
def test_parsers_on_arbitrary_bytes(raw: bytes, max_depth: int) -> None:
    _parse_everything(raw, max_depth)


@settings(max_examples=400, deadline=None)
@given(value=request_like | json_values, max_depth=st.integers(1, 70))
def test_parsers_on_json_like_values(value: Any, max_depth: int) -> None:
    _parse_everything(json.dumps(value).encode(), max_depth)  # big ints and Infinity too


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(1, 3000), max_depth=st.integers(1, 100), kind=st.sampled_from("[{"))
def test_parsers_on_deep_nesting(depth: int, max_depth: int, kind: str) -> None:
    inner = b"[" * depth + b"]" * depth if kind == "[" else b'{"a":' * depth + b"1" + b"}" * depth
    _parse_everything(b'{"model": "m", "prompt": ' + inner + b"}", max_depth)
