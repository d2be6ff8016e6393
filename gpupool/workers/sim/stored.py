"""Stored ``/v1/responses`` responses, kept as vLLM keeps them.

vLLM stores a response only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (the simulator reads the
same variable), in its process's memory, under the body's ``request_id`` (the response's
``id``). It then serves ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``, and a
``previous_response_id`` it does not hold is a 404, all in vLLM's words. Like vLLM, nothing is
ever forgotten; the simulator bounds the store (oldest first) so a long run cannot grow it.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import orjson

from gpupool.workers.sim.errors import BadRequest, SimError

PREFIX = "/v1/responses/"
_LIMIT = 10_000


class InvalidRequest(SimError):
    """vLLM's ``create_error_response(err_type="invalid_request_error", …)``."""

    status = 400
    type = "invalid_request_error"


class ResponseNotFound(InvalidRequest):
    status = 404

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


class ResponseStore:
    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE") == "1"
        self.enabled = enabled
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def check_previous(self, response_id: str | None) -> None:
        """A follow-up's ``previous_response_id`` must be held here (vLLM's 404 otherwise)."""
        if response_id is not None and response_id not in self._items:
            raise ResponseNotFound(response_id)

    def keep(self, response_id: str, body: bytes, store: bool) -> None:
        if not (self.enabled and store):
            return
        self._items[response_id] = body
        while len(self._items) > _LIMIT:
            self._items.popitem(last=False)

    def answer(self, method: str, path: str, query: bytes) -> tuple[int, bytes, str | None]:
        """A stored response's route: ``(status, body, allow)`` (FastAPI's ``allow`` on a 405)."""
        rest = path.removeprefix(PREFIX)
        response_id, _, suffix = rest.partition("/")
        allowed = _METHODS.get(suffix)
        if allowed is None:
            return 404, _NOT_FOUND, None
        if method != allowed:
            return 405, _NOT_ALLOWED, allowed
        try:
            body = self._items.get(response_id)
            if body is None:
                raise ResponseNotFound(response_id)
            if suffix == "cancel":  # only a background response can be: none is, here
                raise InvalidRequest("Cannot cancel a synchronous response.", param="response_id")
            if b"stream=true" in query.lower():
                raise BadRequest(
                    "The simulator replays stored responses without streaming only.",
                    param="stream",
                )
        except SimError as e:
            return e.status, orjson.dumps(e.payload()), None
        return 200, body, None


_METHODS = {"": "GET", "cancel": "POST"}  # what follows the id → its one method
_NOT_FOUND = b'{"detail":"Not Found"}'
_NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
