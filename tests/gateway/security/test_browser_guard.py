"""What a web page may make a browser send (issue 35): the rules of ``security/browser.py``
on their own, then through a real `gpupool serve` with auth off, where the official SDK, curl's
usual requests and the page's own same-origin calls still pass. The real cross-site page is
in tests/gateway/ui/test_cross_site.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gpupool.gateway.errors import Forbidden, UnsupportedMediaType
from gpupool.gateway.security.browser import BrowserGuard
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc, gateway, running, sim

PAGE = frozenset({"/ui", "/ui/app.js"})
OFF = BrowserGuard.of(True, ["gpupool.lan."], PAGE)
ON = BrowserGuard.of(False, [], PAGE)
H = "127.0.0.1:8000"


def _headers(**named: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in named.items()]


JSONS = ["application/json", "application/json; charset=utf-8", "Application/JSON",
         "application/vnd.api+json", None]  # fmt: skip
SIMPLE = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
          "multipart/form-data; boundary=x", "application/jsonx"]  # fmt: skip


@pytest.mark.parametrize("ctype", JSONS)
def test_json_or_no_content_type_passes(ctype: str | None) -> None:
    named = {"host": H} | ({"content_type": ctype} if ctype else {})
    for guard in (OFF, ON):
        guard.check("POST", "/v1/chat/completions", _headers(**named))


@pytest.mark.parametrize("ctype", SIMPLE)
def test_simple_content_types_are_refused_whatever_auth_says(ctype: str) -> None:
    for guard in (OFF, ON):
        with pytest.raises(UnsupportedMediaType):
            guard.check("POST", "/admin/reload", _headers(host=H, content_type=ctype))
        guard.check("GET", "/admin/workers", _headers(host=H, content_type=ctype))


@pytest.mark.parametrize("named", [
    {"sec_fetch_site": "cross-site"},
    {"sec_fetch_site": "same-site"},
    {"origin": "http://evil.example"},
    {"origin": "http://127.0.0.1:9999"},  # another port of the same host: another origin
    {"origin": "null"},
    {"origin": "http://127.0.0.1:8000", "sec_fetch_site": "cross-site"},
])  # fmt: skip
def test_a_state_change_from_another_site_is_refused_when_auth_is_off(
    named: dict[str, str],
) -> None:
    for path in ("/admin/workers/w/drain", "/v1/chat/completions"):
        with pytest.raises(Forbidden):
            OFF.check("POST", path, _headers(host=H, **named))
        ON.check("POST", path, _headers(host=H, **named))  # the key is the guard then


@pytest.mark.parametrize("named", [
    {"origin": "http://127.0.0.1:8000", "sec_fetch_site": "same-origin"},
    {"sec_fetch_site": "none"},
    {},
])  # fmt: skip
def test_own_origin_and_non_browsers_pass(named: dict[str, str]) -> None:
    OFF.check("POST", "/admin/workers/w/drain", _headers(host=H, **named))
    OFF.check("DELETE", "/v1/responses/x", _headers(host=H, **named))


@pytest.mark.parametrize(("host", "ok"), [
    ("127.0.0.1:8000", True), ("[::1]:8000", True), ("10.1.2.3", True), ("localhost:8000", True),
    ("app.localhost", True), ("GPUPOOL.lan:8000", True), ("gpupool.lan.", True),
    ("rebind.example:8000", False), ("127.0.0.1.nip.io", False), ("lan", False),
])  # fmt: skip
def test_admin_and_page_answer_only_known_host_names_when_auth_is_off(host: str, ok: bool) -> None:
    for path in ("/admin/workers", "/admin/events", "/ui", "/ui/app.js"):
        if ok:
            OFF.check("GET", path, _headers(host=host))
        else:
            with pytest.raises(Forbidden):
                OFF.check("GET", path, _headers(host=host))
        ON.check("GET", path, _headers(host=host))
        OFF.check("GET", "/v1/models", _headers(host=host))  # the client API is not affected
        OFF.check("GET", "/health", _headers(host=host))


# ---- through a real gateway ------------------------------------------------------------------


@pytest.fixture(scope="module")
def open_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("browser-guard")
    worker = sim(tmp=tmp)
    cfg = {"models": [{"name": "m"}], "workers": [{"name": "w", "model": "m", "url": worker.url}],
           "auth": {"allowed_hosts": ["gpupool.lan"]}}  # fmt: skip
    gw = gateway(cfg, tmp)
    with running(worker), running(gw, ready_path="/ready"):
        yield gw, worker


def _served(worker: Proc) -> int:
    return int(httpx.get(worker.url + "/sim/stats").json()["requests_total"])


CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


def test_sdk_and_curl_requests_still_pass(open_gw: tuple[Proc, Proc]) -> None:
    gw, _ = open_gw
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=2)  # fmt: skip
    assert out.choices[0].message.content
    for headers in ({"content-type": "application/json"}, {}):  # curl -H ..., curl -X POST
        r = httpx.post(gw.url + "/v1/chat/completions", content=CHAT, headers=headers)
        assert r.status_code == 200, r.text
    r = httpx.post(gw.url + "/admin/workers/w/drain", headers={"origin": gw.url,
                   "sec-fetch-site": "same-origin"})  # the page's own call  # fmt: skip
    assert r.status_code == 200 and r.json()["state"] == "stopped"
    assert httpx.post(gw.url + "/admin/workers/w/undrain").json()["state"] == "ready"
    assert_nothing_held(gw.url)


@pytest.mark.parametrize(("path", "headers", "status"), [
    ("/v1/chat/completions", {"content-type": "text/plain"}, 415),
    ("/v1/chat/completions", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("/v1/chat/completions", {"origin": "http://evil.example"}, 403),
    ("/v1/chat/completions", {"sec-fetch-site": "cross-site"}, 403),
    ("/v1/completions", {"origin": "null"}, 403),
    ("/admin/workers/w/drain", {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("/admin/workers/w/drain", {"origin": "http://evil.example"}, 403),
    ("/admin/reload", {"sec-fetch-site": "same-site"}, 403),
])  # fmt: skip
def test_cross_site_shaped_requests_are_refused_in_the_routes_shape(
    open_gw: tuple[Proc, Proc], path: str, headers: dict[str, str], status: int
) -> None:
    gw, worker = open_gw
    before = _served(worker)
    r = httpx.post(gw.url + path, content=CHAT, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("UnsupportedMediaTypeError",
                                                  "PermissionDeniedError")  # fmt: skip
    assert _served(worker) == before
    workers = httpx.get(gw.url + "/admin/workers").json()["data"]
    assert [w["state"] for w in workers] == ["ready"]
    assert_nothing_held(gw.url)


def test_anthropic_route_refuses_text_plain_in_its_own_shape(open_gw: tuple[Proc, Proc]) -> None:
    gw, _ = open_gw
    r = httpx.post(gw.url + "/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert r.json()["type"] == "error" and r.json()["error"]["message"]


def test_a_rebinding_host_cannot_read_the_admin_api_or_the_page(open_gw: tuple[Proc, Proc]) -> None:
    gw, _ = open_gw
    port = gw.url.rsplit(":", 1)[1]
    for path in ("/admin/workers", "/admin/queue", "/ui", "/ui/app.js"):
        r = httpx.get(gw.url + path, headers={"host": f"rebind.example:{port}"})
        assert r.status_code == 403 and "auth.allowed_hosts" in r.text, path
        for host in (f"localhost:{port}", f"gpupool.lan:{port}", f"127.0.0.1:{port}"):
            assert httpx.get(gw.url + path, headers={"host": host}).status_code == 200
    r = httpx.get(gw.url + "/v1/models", headers={"host": f"rebind.example:{port}"})
    assert r.status_code == 200  # the client API is not in the allowlist's scope
