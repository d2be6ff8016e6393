"""The pool page's routes against hostile use, through a real `gpupool serve` (issue 30).

The page's files carry no data and are open; everything with data or effect is an admin route
that takes the key only from a header (a cookie or a link never carries it, so another site
cannot act with it: CSRF). Every reply of the page forbids framing, inline scripts and other
origins, and sniffing. Each case ends with nothing held.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpupool.gateway.api.ui_routes import MAX_STREAMS
from tests.gateway.ui.pool import ADMIN, ADMIN_H, CLIENT, Pool, pool
from tests.support.hostile_tools import assert_nothing_held

PAGE = ["/ui", "/ui/app.js", "/ui/app.css"]
UI = Path(__file__).resolve().parents[3] / "gpupool" / "gateway" / "ui"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with pool(tmp_path_factory.mktemp("ui-hostile")) as p:
        yield p


def _guarded(r: httpx.Response) -> None:
    csp = r.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["connect-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    assert directives["form-action"] == "'none'"  # the key form is never submitted, even sans JS
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", PAGE)
def test_page_files_forbid_framing_inline_scripts_and_sniffing(gw: Pool, path: str) -> None:
    r = httpx.get(gw.url + path)
    assert r.status_code == 200
    _guarded(r)
    assert_nothing_held(gw.url, ADMIN_H)


def test_event_stream_is_guarded_too(gw: Pool) -> None:
    with httpx.stream("GET", gw.url + "/admin/events", headers=ADMIN_H, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        _guarded(r)
    assert_nothing_held(gw.url, ADMIN_H)


def test_html_has_no_inline_script_style_or_outside_origin() -> None:
    html = (UI / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S):
        assert tag.strip() == "", "an inline script"
    assert all('src="/ui/' in t for t in re.findall(r"<script\b[^>]*>", html))
    assert not re.search(r"\sstyle\s*=", html) and "<style" not in html
    assert not re.search(r"\son[a-z]+\s*=", html), "an inline event handler"
    (key_input,) = re.findall(r"<input\b[^>]*>", html)  # no name: a form never sends the key
    assert 'type="password"' in key_input and "name=" not in key_input
    for name in ("index.html", "app.js", "app.css"):
        text = (UI / name).read_text().replace("http://www.w3.org/2000/svg", "")
        assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text), (
            f"{name}: an outside URL"
        )
    js = (UI / "app.js").read_text()
    assert ".innerHTML" not in js and "eval(" not in js and "document.cookie" not in js


@pytest.mark.parametrize(
    ("headers", "status"),
    [({}, 401), ({"authorization": f"Bearer {CLIENT}"}, 403),
     ({"authorization": "Bearer sk-wrong"}, 401), ({"cookie": f"key={ADMIN}"}, 401)],
)  # fmt: skip
def test_event_stream_needs_the_admin_key_in_a_header(
    gw: Pool, headers: dict[str, str], status: int
) -> None:
    r = httpx.get(gw.url + "/admin/events", headers=headers)
    assert r.status_code == status
    assert r.json()["error"]["code"] == status
    assert_nothing_held(gw.url, ADMIN_H)


def test_a_key_in_the_link_is_no_key(gw: Pool) -> None:
    assert httpx.get(f"{gw.url}/admin/events?key={ADMIN}").status_code == 401
    r = httpx.get(f"{gw.url}/admin/events?key={ADMIN}", headers=ADMIN_H)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert httpx.get(f"{gw.url}/ui?key={ADMIN}").status_code == 400
    assert_nothing_held(gw.url, ADMIN_H)


@pytest.mark.parametrize("action", ["drain", "restart", "sleep", "wake"])
def test_cross_site_actions_are_refused(gw: Pool, action: str) -> None:
    """What another site can make a browser send (a form post, with cookies and an Origin of
    its own) carries no key: refused, and the worker is untouched."""
    r = httpx.post(
        f"{gw.url}/admin/workers/w1/{action}",
        headers={"origin": "https://evil.example", "cookie": f"key={ADMIN}",
                 "content-type": "application/x-www-form-urlencoded"},
        content=f"key={ADMIN}",
    )  # fmt: skip
    assert r.status_code == 415  # a form body is refused before the key is even looked at
    forged = {"origin": "https://evil.example", "cookie": f"key={ADMIN}"}
    r = httpx.post(f"{gw.url}/admin/workers/w1/{action}", headers=forged)
    assert r.status_code == 401
    r = httpx.post(f"{gw.url}/admin/reload", headers={"origin": "https://evil.example"})
    assert r.status_code == 401
    assert httpx.get(gw.url + "/admin/workers/w1", headers=ADMIN_H).json()["state"] == "ready"
    assert_nothing_held(gw.url, ADMIN_H)


def test_open_streams_are_bounded_and_given_back(gw: Pool) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=gw.url, headers=ADMIN_H, timeout=10) as client:
            for _ in range(2):  # the second round proves the first gave every slot back
                streams = [client.stream("GET", "/admin/events") for _ in range(MAX_STREAMS)]
                opened = [await s.__aenter__() for s in streams]
                assert all(r.status_code == 200 for r in opened)
                extra = await client.get("/admin/events")
                assert extra.status_code == 429 and extra.json()["error"]["code"] == 429
                assert "retry-after" in extra.headers
                for s in streams:
                    await s.__aexit__(None, None, None)
                await _until_stream_opens(client)

    asyncio.run(main())
    assert_nothing_held(gw.url, ADMIN_H)


async def _until_stream_opens(client: httpx.AsyncClient) -> None:
    """The gateway sees the closed streams go a moment after the client closed them."""
    for _ in range(100):
        async with client.stream("GET", "/admin/events") as r:
            if r.status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("closed streams were never given back")


def test_open_admin_api_on_loopback_serves_the_page_without_a_key(tmp_path: Path) -> None:
    with pool(tmp_path, auth=False) as p:
        assert '<meta name="gpupool-admin" content="open">' in httpx.get(p.url + "/ui").text
        with httpx.stream("GET", p.url + "/admin/events", timeout=10) as r:
            assert r.status_code == 200


def test_page_asks_for_the_key_when_auth_is_on(gw: Pool) -> None:
    assert '<meta name="gpupool-admin" content="key">' in httpx.get(gw.url + "/ui").text
    r = httpx.get(gw.url + "/ui/", follow_redirects=True)  # a trailing slash finds it too
    assert r.status_code == 200 and r.url.path == "/ui"


def test_ui_slash_redirects_relatively_whatever_host_is_sent(gw: Pool) -> None:
    """Issue 35: the redirect named the client's `Host:`; a forged one was echoed back."""
    r = httpx.get(gw.url + "/ui/", headers={"host": "evil.example"})
    assert r.status_code == 307 and r.headers["location"] == "../ui"
    assert "evil" not in r.text
    # no other route redirects to a Host-built URL either
    r = httpx.get(gw.url + "/admin/workers/", headers={**ADMIN_H, "host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
