"""Response bodies and SSE events in vLLM 0.32's exact shapes.

Non-streaming bodies are ``model_dump()`` output (every null field present); streamed chunks are
``exclude_unset`` dumps, so only the fields vLLM sets appear; the usage chunk drops nulls.
Everything is compact JSON except the mid-stream error event, which vLLM writes with
``json.dumps`` and its default ``", "`` / ``": "`` separators.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from gpupool.workers.sim.errors import SimError

DONE = b"data: [DONE]\n\n"
_dumps = orjson.dumps
_END = b"]}\n\n"


def usage(prompt: int, completion: int, reasoning: int | None = None) -> dict[str, Any]:
    """The streamed usage object (``exclude_none``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def chat_running_usage(prompt: int, completion: int, reasoning: int | None) -> dict[str, Any]:
    """A chat chunk's continuous usage: vLLM sets ``completion_tokens_details`` explicitly, so
    it is there even when null (no reasoning parser)."""
    out = usage(prompt, completion)
    details = None if reasoning is None else {"reasoning_tokens": reasoning}
    out["completion_tokens_details"] = details
    return out


def full_usage(prompt: int, completion: int, reasoning: int | None) -> dict[str, Any]:
    """The non-streamed usage object (``model_dump``)."""
    details = None if reasoning is None else {"reasoning_tokens": reasoning}
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "completion_tokens_details": details,
    }


def error_event(error: SimError) -> bytes:
    """An error inside a stream that already answered 200 (spaced JSON, as vLLM writes it)."""
    return b"data: " + json.dumps(error.payload()).encode() + b"\n\n"


def chat_message(content: str | None, reasoning: str | None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": reasoning,
    }


def chat_choice(index: int, message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "routed_experts": None,
    }


def chat_body(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any],
    fingerprint: str,
) -> bytes:
    return _dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": use,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


def completion_choice(index: int, text: str, finish_reason: str) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
        "token_ids": None,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "routed_experts": None,
    }


def completion_body(
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    use: dict[str, Any],
    fingerprint: str,
) -> bytes:
    return _dumps(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fingerprint,
            "usage": use,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }
    )


class ChunkWriter:
    """SSE events of one stream; the constant head and tails of every chunk are serialized once.

    ``system_fingerprint`` is on the last JSON chunk only: the usage chunk when usage is
    included, else each choice's finishing chunk.
    """

    __slots__ = ("_finish_end", "_head", "_usage_end")

    def __init__(
        self, rid: str, obj: str, created: int, model: str, fingerprint: str, include_usage: bool
    ) -> None:
        self._head = b"".join(
            (
                b'data: {"id":',
                _dumps(rid),
                b',"object":',
                _dumps(obj),
                b',"created":',
                str(created).encode(),
                b',"model":',
                _dumps(model),
                b',"choices":[',
            )
        )
        self._usage_end = b',"system_fingerprint":' + _dumps(fingerprint) + b"}\n\n"
        self._finish_end = _END if include_usage else b"]" + self._usage_end

    def role(self, index: int, prompt_ids: list[int] | None = None) -> bytes:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        tail = b'],"prompt_token_ids":' + _dumps(prompt_ids) + b',"prompt_text":null}\n\n'
        return self._head + _dumps(choice) + tail

    def chat_delta(
        self,
        index: int,
        delta: dict[str, str],
        finish: str | None,
        use: dict[str, Any] | None,
        ids: list[int] | None = None,
    ) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = ids
        return self._choice(choice, finish is not None, use)

    def text_delta(
        self,
        index: int,
        text: str,
        finish: str | None,
        use: dict[str, Any] | None,
        ids: tuple[list[int] | None, list[int] | None] = (None, None),
    ) -> bytes:
        """``ids``: the prompt's (a choice's first chunk, when asked) and this step's."""
        choice = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "prompt_token_ids": ids[0],
            "token_ids": ids[1],
        }
        return self._choice(choice, finish is not None, use)

    def usage(self, use: dict[str, Any]) -> bytes:
        return self._head + b'],"usage":' + _dumps(use) + self._usage_end

    def _choice(self, choice: dict[str, Any], finishing: bool, use: dict[str, Any] | None) -> bytes:
        if use is not None:  # continuous usage: include_usage is on, the fingerprint comes later
            return self._head + _dumps(choice) + b'],"usage":' + _dumps(use) + b"}\n\n"
        return self._head + _dumps(choice) + (self._finish_end if finishing else _END)


def responses_body(
    rid: str,
    created: int,
    model: str,
    text: tuple[str | None, str | None],
    finish_reason: str,
    tokens: tuple[int, int, int],
) -> bytes:
    """A minimal, non-streamed Responses API object: a reasoning item and a message item."""
    reasoning, content = text
    prompt, completion, reasoning_tokens = tokens
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(
            {
                "id": "rs_" + rid[5:],
                "summary": [],
                "type": "reasoning",
                "content": [{"text": reasoning, "type": "reasoning_text"}],
                "encrypted_content": None,
                "status": None,
            }
        )
    output.append(
        {
            "id": "msg_" + rid[5:],
            "content": [
                {"annotations": [], "text": content or "", "type": "output_text", "logprobs": None}
            ],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        }
    )
    complete = finish_reason != "length"  # vLLM: an aborted one (a sleep's) is "completed"
    return _dumps(
        {
            "id": rid,
            "created_at": created,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "instructions": None,
            "metadata": None,
            "model": model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": None,
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": "completed" if complete else "incomplete",
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": prompt + completion,
            },
            "user": None,
        }
    )


def model_card(
    name: str, root: str, max_model_len: int, created: int, perm_id: str
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": perm_id,
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }
