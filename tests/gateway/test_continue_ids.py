"""Which streams ask for their token ids, and the completion that goes on from them
(``pipeline/continue_ids.py``), without HTTP."""

from __future__ import annotations

from typing import Any

import pytest

from gpupool.gateway.pipeline.continue_ids import NO_LIMIT_CAP, ids_body, ids_cap

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "stream": True, "max_tokens": 50, "temperature": 0, "seed": 3}  # fmt: skip
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "Once", "stream": True}


def test_a_stream_keeps_at_most_its_limit_of_ids() -> None:
    assert ids_cap(CHAT, chat=True) == 50
    assert ids_cap({**CHAT, "max_completion_tokens": 20}, chat=True) == 20
    assert ids_cap({**CHAT, "max_tokens": None}, chat=True) == NO_LIMIT_CAP  # the window
    assert ids_cap(COMPLETION, chat=False) == 16  # vLLM's completions default


@pytest.mark.parametrize(
    ("extra", "chat"),
    [
        ({"stop": ["\n\n"]}, True),  # vLLM holds back the text that may begin one
        ({"n": 2}, True),
        ({"logprobs": True}, True),
        ({"return_token_ids": True}, True),  # the client's own: passed as they come
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            True,
        ),
        ({"prompt": [1, 2, 3]}, False),
        ({"logprobs": 0}, False),
    ],
)
def test_streams_the_ids_cannot_continue_do_not_ask(extra: dict[str, Any], chat: bool) -> None:
    assert ids_cap({**(CHAT if chat else COMPLETION), **extra}, chat) == 0


def test_a_chat_goes_on_as_a_completion_of_its_ids() -> None:
    chat_only = {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True}
    origin = {**CHAT, **chat_only, "truncate_prompt_tokens": 8, "cache_salt": "t"}
    body = ids_body(origin, True, [1, 2, 3, 9, 9], sent=2, room=100)
    assert body == {"model": "m", "stream": True, "max_tokens": 48, "temperature": 0,
                    "seed": 3, "cache_salt": "t", "prompt": [1, 2, 3, 9, 9],
                    "return_token_ids": True}  # fmt: skip
    assert ids_body(origin, True, [1, 2], sent=50, room=100) is None  # every token went out
    assert ids_body({**CHAT, "max_tokens": None}, True, [1], sent=5, room=7)["max_tokens"] == 7


def test_a_completion_without_a_limit_keeps_vllms_default() -> None:
    body = ids_body(COMPLETION, False, [5, 6, 7], sent=4, room=1000)
    assert body is not None and (body["max_tokens"], body["prompt"]) == (12, [5, 6, 7])
