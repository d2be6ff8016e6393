"""Media sources are checked wherever a route's schema lets them hide, on every route.

Each case puts one URL at one place of one route's body, read from vLLM's request schemas:
chat's nested content (a tool message's parts, the string form of ``image_url``), Anthropic
``/v1/messages`` (top-level blocks, a ``tool_result``'s blocks, ``system`` blocks, ``document``
sources by URL or by content), Responses (``input_image``, ``input_file``, a bare input item,
a ``function_call_output``'s parts), embeddings, pooling and classify conversations, score and
rerank inputs, Cohere's ``/v2/embed``, ``/tokenize`` and ``count_tokens`` (vLLM renders, and so
fetches, their media too). A cloud metadata address, a private one and ``file://`` must each be
a 400 in the route's shape that names the place; the worker never hears of it and nothing stays
held. Before this, a URL in a ``tool_result``, a ``system`` block or a ``document`` reached
the worker, and vLLM's Anthropic adapter fetched the first.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.support.hostile_tools import Recorder, assert_nothing_held
from tests.support.procs import gateway, running

MODEL = "m"
ADMIN = "sk-admin-media"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
URLS = ["http://169.254.169.254/latest/meta-data/iam", "http://10.0.0.7/x.png",
        "file:///etc/passwd"]  # fmt: skip

Body = Callable[[str], dict[str, Any]]


def _img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _anthropic_img(url: str) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "url", "url": url}}


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


_TEXT = {"type": "text", "text": "look"}
CASES: dict[str, tuple[str, Body]] = {
    "chat.content": ("/v1/chat/completions", lambda u: {"messages": _user(_TEXT, _img(u))}),
    "chat.content.string_form": ("/v1/chat/completions", lambda u: {
        "messages": _user({"type": "image_url", "image_url": u})}),
    "chat.tool_message": ("/v1/chat/completions", lambda u: {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [_img(u)]}]}),
    "chat.video": ("/v1/chat/completions", lambda u: {"messages": _user(
        {"type": "video_url", "video_url": {"url": u}})}),
    "chat.audio": ("/v1/chat/completions", lambda u: {"messages": _user(
        {"type": "audio_url", "audio_url": {"url": u}})}),
    "chat.file": ("/v1/chat/completions", lambda u: {"messages": _user(
        {"type": "file", "file": {"file_url": u}})}),
    "messages.block": ("/v1/messages", lambda u: {"max_tokens": 4,
                                                  "messages": _user(_anthropic_img(u))}),
    "messages.tool_result": ("/v1/messages", lambda u: {"max_tokens": 4, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [_anthropic_img(u)]}]}]}),
    "messages.system": ("/v1/messages", lambda u: {"max_tokens": 4, "messages": _user(_TEXT),
                                                   "system": [_TEXT, _anthropic_img(u)]}),
    "messages.document": ("/v1/messages", lambda u: {"max_tokens": 4, "messages": _user(
        {"type": "document", "source": {"type": "url", "url": u}})}),
    "messages.document_content": ("/v1/messages", lambda u: {"max_tokens": 4, "messages": _user(
        {"type": "document", "source": {"type": "content",
                                        "content": [_anthropic_img(u)]}})}),
    "count_tokens.tool_result": ("/v1/messages/count_tokens", lambda u: {"messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [_anthropic_img(u)]}]}]}),
    "responses.input_image": ("/v1/responses", lambda u: {"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": u}]}]}),
    "responses.input_file": ("/v1/responses", lambda u: {"input": [
        {"role": "user", "content": [{"type": "input_file", "file_url": u}]}]}),
    "responses.bare_item": ("/v1/responses", lambda u: {"input": [
        {"type": "input_image", "image_url": u}]}),
    "responses.function_call_output": ("/v1/responses", lambda u: {"input": [
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_image", "image_url": u}]}]}),
    "embeddings.messages": ("/v1/embeddings", lambda u: {"messages": _user(_img(u))}),
    "pooling.messages": ("/pooling", lambda u: {"messages": _user(_img(u))}),
    "classify.messages": ("/classify", lambda u: {"messages": _user(_img(u))}),
    "tokenize.messages": ("/tokenize", lambda u: {"messages": _user(_img(u))}),
    "score.documents": ("/score", lambda u: {"queries": "q", "documents": {
        "content": [_img(u)]}}),
    "rerank.documents": ("/rerank", lambda u: {"query": "q", "documents": [
        "plain", {"content": [_img(u)]}]}),
    "v2_embed.images": ("/v2/embed", lambda u: {"images": [u], "input_type": "image"}),
    "v2_embed.inputs": ("/v2/embed", lambda u: {"inputs": [{"content": [_img(u)]}],
                                                "input_type": "image"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Recorder]]:
    tmp = tmp_path_factory.mktemp("media")
    rec = Recorder(model=MODEL)
    cfg = {
        "models": [{"name": MODEL, "remote_media": "allow"}],
        "workers": [{"name": "w", "model": MODEL, "url": rec.url}],
        "auth": {"enabled": True, "admin_key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()},
        "routing": {"health_interval_s": 0.5},
    }
    with rec.running():
        g = gateway(cfg, tmp)
        with running(g):
            deadline = time.monotonic() + 30
            while httpx.get(g.url + "/ready", headers=ADMIN_H).status_code != 200:
                assert time.monotonic() < deadline, "worker not ready"
                time.sleep(0.1)
            yield g.url, rec


@pytest.mark.parametrize("url", URLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hidden_media_url_is_refused_on_every_route(
    pool: tuple[str, Recorder], case: str, url: str
) -> None:
    gw, rec = pool
    path, body = CASES[case]
    before = len(rec.bodies)
    r = httpx.post(gw + path, headers=ADMIN_H, json={"model": MODEL, **body(url)}, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]  # OpenAI's envelope or Anthropic's: both say it
    assert "media" in message or "URL" in message or "file://" in message, message
    assert len(rec.bodies) == before  # the worker never saw it
    assert_nothing_held(gw, ADMIN_H)


def test_urls_outside_content_are_data_not_media(pool: tuple[str, Recorder]) -> None:
    """A tool's schema, a model's own tool call arguments and metadata are never fetched: a
    private URL there is not refused."""
    gw, rec = pool
    body = {
        "model": MODEL, "max_tokens": 4,
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
            "image_url": {"type": "string", "default": "http://10.0.0.7/"}}}}],
        "metadata": {"user_id": "http://10.0.0.7/"},
        "messages": [{"role": "user", "content": "go"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t",
                      "name": "f", "input": {"image_url": "http://10.0.0.7/x.png"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "content": "done"}]}],
    }  # fmt: skip
    r = httpx.post(gw + "/v1/messages", headers=ADMIN_H, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert rec.bodies[-1][0] == "/v1/messages"
