"""The usage chunk the gateway asked for on a client's behalf, taken out again: what is left is
the bytes vLLM writes without ``stream_options.include_usage`` (``transform/usage.py``)."""

from __future__ import annotations

from gpupool.gateway.transform.sse import EventBuffer
from gpupool.gateway.transform.usage import UsageStrip

HEAD = b'{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":['
ROLE = HEAD + b'{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
TOKEN = HEAD + b'{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
FINISH = HEAD + b'{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}'
FINISH_1 = HEAD + b'{"index":1,"delta":{"content":""},"finish_reason":"length"}]}'
TOKEN_1 = HEAD + b'{"index":1,"delta":{"content":"yo"},"finish_reason":null}]}'
USAGE = (
    HEAD
    + b'],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
    + (b'"system_fingerprint":"vllm-0.32.0-abc"}')
)
FP = b',"system_fingerprint":"vllm-0.32.0-abc"}'


def _frame(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def _strip(stream: bytes, read: int = 7, interleaved: bool = False) -> bytes:
    """``stream`` through a strip as the relay feeds it, in reads of ``read`` bytes (events
    split across reads), or one event a read (``read=0``: the fast path's reads)."""
    strip, buf, out = UsageStrip(1 << 20, interleaved), EventBuffer(), bytearray()
    if read:
        reads = [stream[i : i + read] for i in range(0, len(stream), read)]
    else:
        reads = [e + b"\n\n" for e in stream.split(b"\n\n") if e]
    for chunk in reads:
        if not len(buf) and strip.passes(chunk):
            out += chunk
            continue
        for payload in buf.events(chunk):
            out += strip.event(payload)
    return bytes(out + strip.end())


def test_the_usage_chunk_goes_and_its_fingerprint_moves_to_the_finishing_chunk() -> None:
    with_usage = _frame(ROLE, TOKEN, FINISH, USAGE, b"[DONE]")
    without = _frame(ROLE, TOKEN, FINISH[:-1] + FP, b"[DONE]")
    assert _strip(with_usage) == without
    assert _strip(with_usage, read=1 << 16) == without
    assert _strip(with_usage, read=0) == without


def test_every_choice_finishing_gets_the_fingerprint_in_order() -> None:
    with_usage = (
        _frame(ROLE, FINISH, TOKEN_1) + b": keep-alive\n\n" + _frame(FINISH_1, USAGE, b"[DONE]")
    )
    assert (
        _strip(with_usage)
        == _strip(with_usage, read=0)
        == (
            _frame(ROLE, FINISH[:-1] + FP, TOKEN_1)
            + b": keep-alive\n\n"
            + _frame(FINISH_1[:-1] + FP, b"[DONE]")
        )
    )


def test_several_choices_stream_on_while_a_finished_choice_waits_for_the_fingerprint() -> None:
    """n > 1: only finishing chunks wait for the usage chunk; the other choices' chunks go out
    as they come (a choice finishing early must not stall the rest of the answer)."""
    strip = UsageStrip(1 << 20, interleaved=True)
    assert strip.event(ROLE) == _frame(ROLE)
    assert strip.event(FINISH) == b""
    assert strip.event(TOKEN_1) == _frame(TOKEN_1)  # not held behind choice 0's finish
    assert strip.passes(_frame(TOKEN_1))
    assert strip.event(b": keep-alive") == b": keep-alive\n\n"
    assert strip.event(FINISH_1) == b""
    assert strip.event(USAGE) == _frame(FINISH[:-1] + FP, FINISH_1[:-1] + FP)
    assert strip.event(b"[DONE]") == _frame(b"[DONE]")
    for read in (7, 0):
        with_usage = _frame(ROLE, FINISH, TOKEN_1, FINISH_1, USAGE, b"[DONE]")
        assert _strip(with_usage, read, interleaved=True) == _frame(
            ROLE, TOKEN_1, FINISH[:-1] + FP, FINISH_1[:-1] + FP, b"[DONE]"
        )


def test_no_fingerprint_on_the_worker_none_added() -> None:
    usage = USAGE.replace(b',"system_fingerprint":"vllm-0.32.0-abc"', b"")
    assert _strip(_frame(TOKEN, FINISH, usage, b"[DONE]")) == _frame(TOKEN, FINISH, b"[DONE]")


def test_a_stream_cut_before_its_usage_gives_back_what_it_held() -> None:
    assert _strip(_frame(TOKEN, FINISH)) == _frame(TOKEN, FINISH)


def test_what_is_held_is_bounded() -> None:
    strip = UsageStrip(len(FINISH) + 10)
    assert strip.event(FINISH) == b""
    assert strip.event(TOKEN_1) == _frame(FINISH, TOKEN_1)  # past the bound: as they came
    assert strip.event(TOKEN_1) == _frame(TOKEN_1)
