"""The simulator streams ``/v1/responses`` as vLLM 0.32's simple path does: ``response.created``
and ``in_progress``, a message item and its text part, an ``output_text.delta`` a token, the done
events with the whole text, ``response.completed`` with the whole response; sequence numbers from
0 without gap; the stored response is the completed one."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gpupool.workers.sim.app import create_sim_app
from gpupool.workers.sim.config import SimConfig


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


@pytest.mark.parametrize("limit", [5, 400])
async def test_a_response_streams_as_vllm_frames_it(
    monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    app = create_sim_app(SimConfig(model="m", output_tokens=8))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        body = {"model": "m", "input": "hi", "stream": True, "request_id": "resp_1",
                "max_output_tokens": limit}  # fmt: skip
        r = await c.post("/v1/responses", json=body)
        stored = (await c.get("/v1/responses/resp_1")).json()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.content)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len(deltas) == min(limit, 8)
    text = "".join(d["delta"] for d in deltas)
    item_id = events[2]["item"]["id"]
    assert {d["item_id"] for d in deltas} == {item_id}
    assert events[-4]["text"] == events[-3]["part"]["text"] == text
    assert events[-2]["item"]["id"] == item_id
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] == "resp_1"
    assert final["status"] == ("incomplete" if limit < 8 else "completed")
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == len(deltas)
    assert stored == final
