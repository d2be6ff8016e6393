"""The token ids a stream's worker returned (``transform/token_ids.py``), without HTTP: what
the client reads (vLLM's bytes without the flag), what is kept, and what is not trusted."""

from __future__ import annotations

from typing import Any

import orjson

from gpupool.gateway.transform.continuation import Progress
from gpupool.gateway.transform.token_ids import TokenIds, null_ids, strip

HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
ROLE = b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
ROLE_END = b'"finish_reason":null}],"prompt_token_ids":%s,"prompt_text":null}\n\n'
TOKEN = (
    b'"choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":null,"token_ids":%s}]}\n\n'
)
CMPL = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":%s,"logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":%s,"token_ids":%s}]}\n\n')  # fmt: skip


def _chat(with_ids: bool) -> bytes:
    """A chat stream as vLLM 0.32 writes it with ``return_token_ids`` and without: the role
    chunk, "Hi", a step whose text it holds back (a character split over two tokens: with the
    flag, a chunk of its ids alone), then the character with the second token's id."""

    def ids(v: bytes) -> bytes:
        return v if with_ids else b"null"

    out = HEAD + ROLE + ROLE_END % ids(b"[1,2,3]")
    out += HEAD + TOKEN % (b'{"content":"Hi"}', ids(b"[40]"))
    if with_ids:
        out += HEAD + TOKEN % (b"{}", b"[226]")
    out += HEAD + TOKEN % ('{"content":"\u00e9"}'.encode(), ids(b"[130]"))
    return out


def test_a_chat_stream_loses_its_ids_byte_for_byte() -> None:
    assert strip(_chat(True)) == _chat(False)


def test_a_completion_stream_loses_its_ids_byte_for_byte() -> None:
    flagged = CMPL % (b'" a"', b"[5,6]", b"[7]") + CMPL % (b'" b"', b"null", b"[8,9]")
    plain = CMPL % (b'" a"', b"null", b"null") + CMPL % (b'" b"', b"null", b"null")
    assert strip(flagged) == plain
    assert strip(plain) == plain  # nothing to take out: the same bytes


def test_text_that_looks_like_a_key_is_left_alone() -> None:
    """A JSON string cannot hold an unescaped quote: an answer that writes the key is text."""
    text = orjson.dumps('say "token_ids":[1] and "prompt_token_ids":[2]')
    event = CMPL % (text, b"null", b"[3]")
    assert strip(event) == CMPL % (text, b"null", b"null")


def test_the_ids_are_kept_in_order_with_the_prompt_once() -> None:
    p = Progress(chat=True)
    p.token_ids = TokenIds(100)
    out = p.feed(_chat(True))
    assert out == _chat(False)
    assert p.token_ids.usable
    assert list(p.token_ids.ids()) == [1, 2, 3, 40, 226, 130]
    assert (p.sent, p.tokens, p.text) == (3, 2, "Hi\u00e9")  # ids, not events


def test_a_continuation_keeps_its_ids_but_not_its_prompt() -> None:
    ids = TokenIds(100)
    ids.read(orjson.loads(CMPL.split(b"data: ")[1] % (b'"a"', b"[1,2]", b"[3]")))
    chunk: dict[str, Any] = orjson.loads(CMPL[6:] % (b'"b"', b"[1,2,3]", b"[4]"))
    ids.read(chunk)
    null_ids(chunk)
    assert ids.ids() == [1, 2, 3, 4]
    assert (chunk["choices"][0]["prompt_token_ids"], chunk["choices"][0]["token_ids"]) == (
        None,
        None,
    )


def test_a_worker_without_ids_leaves_the_text_path() -> None:
    """An older vLLM ignores the flag: its chunks carry text without ids."""
    p = Progress(chat=True)
    p.token_ids = TokenIds(100)
    p.feed(_chat(False))
    assert not p.token_ids.usable
    assert p.sent == p.tokens == 2


def test_ids_past_the_limit_or_not_ids_are_not_trusted() -> None:
    for bad in (b"[1,2,3,4,5]", b'["x"]', b"[-1]", b"[true]", b"[1.5]", b"[4611686018427387904]"):
        ids = TokenIds(4)
        ids.read(orjson.loads(CMPL[6:] % (b'"a"', b"[9]", bad)))
        assert not ids.usable, bad
    many = TokenIds(3)
    for _ in range(4):  # one at a time: the fourth is over the request's limit
        many.read(orjson.loads(CMPL[6:] % (b'"a"', b"[9]", b"[1]")))
    assert not many.usable
