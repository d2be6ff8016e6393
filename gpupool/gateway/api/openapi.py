"""The gateway's own OpenAPI document (what schemathesis fuzzes, and what clients may read)."""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}  # fmt: skip

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"type": "string"},
        "reasoning_content": {"type": "string"},
    },
}

_COMMON = {
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},  # server.max_n's default
    "priority": {"type": "integer"},
}


def _post(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": _responses(),
    }}  # fmt: skip


def _get(summary: str) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": _responses()}}


def _responses() -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": _ERROR}}}
    return {"200": {"description": "OK"}, "400": {"description": "Bad request", **err},
            "404": {"description": "Not found", **err}, "429": {"description": "Busy", **err},
            "503": {"description": "Unavailable", **err}}  # fmt: skip


def openapi_schema() -> dict[str, Any]:
    chat = {
        "type": "object",
        "required": ["messages"],
        "properties": {**_COMMON, "messages": {"type": "array", "items": _MESSAGE}},
    }
    completion = {"type": "object", "required": ["prompt"],
                  "properties": {**_COMMON, "prompt": {"type": "string"}}}  # fmt: skip
    return {
        "openapi": "3.0.3",
        "info": {"title": "gpupool", "version": "0.1.0"},
        "paths": {
            "/v1/chat/completions": _post("Chat completion (vLLM/OpenAI)", chat),
            "/v1/completions": _post("Completion (vLLM/OpenAI)", completion),
            "/v1/models": _get("Models served by ready workers"),
            "/health": _get("Process alive"),
            "/ready": _get("Every model has a ready worker"),
            **_stored_responses(),
        },
    }


def _stored_responses() -> dict[str, Any]:
    """A stored response's routes (``pipeline/stored.py``): its tenant only, on its worker."""
    rid = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]

    def op(summary: str) -> dict[str, Any]:
        return {"summary": summary, "parameters": rid, "responses": _responses()}

    return {
        "/v1/responses/{response_id}": {"get": op("A stored response"),
                                         "delete": op("Delete a stored response")},
        "/v1/responses/{response_id}/cancel": {"post": op("Cancel a background response")},
        "/v1/responses/{response_id}/input_items": {"get": op("A stored response's input")},
    }  # fmt: skip
