"""The simulator keeps stored ``/v1/responses`` responses as vLLM does (with
``VLLM_ENABLE_RESPONSES_API_STORE=1``): under the body's ``request_id``, served by
``GET /v1/responses/{id}`` and ``POST …/cancel``, and a ``previous_response_id`` it does not
hold is vLLM's 404. While asleep it records any such request as a violation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from gpupool.workers.sim.app import create_sim_app
from gpupool.workers.sim.config import SimConfig
from gpupool.workers.sim.sleep import SleepSettings


async def _client(sleep: SleepSettings | None = None) -> httpx.AsyncClient:
    app = create_sim_app(SimConfig(model="m", mode="echo"), sleep)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    async with await _client(SleepSettings(sleep_s=0, wake_s=0)) as client:
        yield client


def _not_found(rid: str) -> dict[str, object]:
    message = f"Response with id '{rid}' not found."
    return {"error": {"message": message, "type": "invalid_request_error",
                      "param": "response_id", "code": 404}}  # fmt: skip


async def test_a_response_is_stored_under_the_request_id(sim: httpx.AsyncClient) -> None:
    made = await sim.post("/v1/responses", json={"input": "hi", "request_id": "resp_1"})
    assert made.status_code == 200 and made.json()["id"] == "resp_1"
    got = await sim.get("/v1/responses/resp_1")
    assert got.status_code == 200 and got.json() == made.json()
    r = await sim.post("/v1/responses", json={"input": "more", "previous_response_id": "resp_1"})
    assert r.status_code == 200
    r = await sim.post("/v1/responses/resp_1/cancel")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    r = await sim.delete("/v1/responses/resp_1")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


async def test_what_it_does_not_hold_is_vllms_404(sim: httpx.AsyncClient) -> None:
    r = await sim.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_no"})
    assert (r.status_code, r.json()) == (404, _not_found("resp_no"))
    r = await sim.post("/v1/responses", json={"input": "x", "request_id": "resp_2", "store": False})
    assert r.status_code == 200
    r = await sim.get("/v1/responses/resp_2")
    assert (r.status_code, r.json()) == (404, _not_found("resp_2"))
    r = await sim.get("/v1/responses/resp_2/input_items")
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})


async def test_without_the_store_setting_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    async with await _client() as sim:
        r = await sim.post("/v1/responses", json={"input": "x", "request_id": "resp_3"})
        assert r.status_code == 200
        assert (await sim.get("/v1/responses/resp_3")).status_code == 404


async def test_a_stored_response_route_while_asleep_is_a_violation(sim: httpx.AsyncClient) -> None:
    await sim.post("/v1/responses", json={"input": "x", "request_id": "resp_4"})
    assert (await sim.post("/sleep?level=1")).status_code == 200
    r = await sim.get("/v1/responses/resp_4")
    assert r.status_code == 503
    violations = (await sim.get("/sim/sleep")).json()["violations"]
    assert violations == ["/v1/responses/resp_4 while asleep"]
    assert (await sim.post("/wake_up")).status_code == 200
    assert (await sim.get("/v1/responses/resp_4")).status_code == 200  # kept through the sleep
