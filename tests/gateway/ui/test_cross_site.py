"""Another web site, in a real Chromium, against a real `gpupool serve` with auth off (issue 35):
the pages of another origin fire what a browser lets any page send without asking (form posts,
``fetch(mode: "no-cors")`` with text/plain or a type-less body) at the admin API and the chat
route, and a page whose own name points at the gateway (DNS rebinding, simulated with
Chromium's host resolver rules) tries to read and drive the admin API. Nothing changes and no
request reaches a worker; the pool page itself, same-origin, still drains a worker.

The attacks' answers are opaque to the page, so the test reads the gateway: worker states, a
reload that would have changed a capacity, and the workers' own request counts."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.ui.browser import chromium, need_chromium, wait
from tests.gateway.ui.pool import Pool, pool
from tests.support.hostile_tools import assert_nothing_held

pytestmark = pytest.mark.timeout(180)

PAGE = b"<!doctype html><title>another site</title><p>nothing to see</p>"

# Runs in the other site's page: every kind of request a page may send to any address without
# a CORS preflight, then a form post into a frame; calls back once all were answered.
ATTACK = """
const gw = arguments[0], done = arguments[arguments.length - 1];
const chat = JSON.stringify({model: "m", messages: [{role: "user", content: "hi"}], max_tokens: 2});
const sent = [];
const post = (path, init) => fetch(gw + path, {method: "POST", mode: "no-cors", ...init})
  .then(() => sent.push(path), e => sent.push(path + " failed: " + e));
const form = (path, enctype, name, value) => new Promise(resolve => {
  const sink = document.createElement("iframe");
  sink.name = "sink" + sent.length;
  document.body.appendChild(sink);
  const f = document.createElement("form");
  Object.assign(f, {method: "POST", action: gw + path, enctype: enctype, target: sink.name});
  const input = document.createElement("input");
  Object.assign(input, {type: "hidden", name: name, value: value});
  f.appendChild(input);
  document.body.appendChild(f);
  sink.onload = () => { sent.push("form " + path); resolve(); };
  f.submit();
});
Promise.all([
  post("/admin/reload", {}),
  post("/admin/workers/w2/drain", {body: "x"}),
  post("/v1/chat/completions", {headers: {"content-type": "text/plain"}, body: chat}),
  post("/v1/chat/completions", {body: new Blob([chat])}),  // no content-type at all
])
  .then(() => form("/admin/workers/w1/drain", "application/x-www-form-urlencoded", "a", "b"))
  .then(() => form("/v1/chat/completions", "text/plain", chat.slice(0, -1) + ',"x":"', '"}'))
  .then(() => done(sent));
"""


@contextlib.contextmanager
def other_site() -> Iterator[int]:
    """A plain web server on its own port: the other site's page."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, Any, int, Path]]:
    need_chromium()
    tmp = tmp_path_factory.mktemp("cross-site")
    rules = "--host-resolver-rules=MAP rebind.test 127.0.0.1"
    with pool(tmp, auth=False) as p, other_site() as port, \
            chromium(tmp / "profile", flags=(rules,)) as driver:  # fmt: skip
        yield p, driver, port, tmp


def _states(p: Pool) -> dict[str, str]:
    return {w["name"]: w["state"] for w in httpx.get(p.url + "/admin/workers").json()["data"]}


def _capacities(p: Pool) -> dict[str, int]:
    return {w["name"]: w["capacity"] for w in httpx.get(p.url + "/admin/workers").json()["data"]}


def _served(p: Pool) -> int:
    stats = [httpx.get(w.url + "/sim/stats").json() for w in (p.w1, p.w2)]
    return sum(int(s["requests_total"]) for s in stats)


def _prime_a_reload(p: Pool, tmp: Path) -> None:
    """Edit the config so that a reload, if one ran, would show (w2's capacity 4 -> 3)."""
    path = next(tmp.glob("gpupool-*.yaml"))
    cfg = yaml.safe_load(path.read_text())
    cfg["workers"][1]["max_inflight"] = 3
    path.write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize("site", ["localhost", "127.0.0.1"])  # cross-site; same site, other port
def test_another_sites_page_changes_nothing(setup: tuple[Pool, Any, int, Path], site: str) -> None:
    p, driver, port, tmp = setup
    _prime_a_reload(p, tmp)
    before = _served(p)
    driver.get(f"http://{site}:{port}/")
    driver.set_script_timeout(60)
    sent = driver.execute_async_script(ATTACK, p.url)
    assert len(sent) == 6 and not any("failed" in s for s in sent), sent
    assert _states(p) == {"w1": "ready", "w2": "ready"}
    assert _capacities(p)["w2"] == 4, "the page triggered a reload"
    assert _served(p) == before, "a chat request from the page reached a worker"
    assert_nothing_held(p.url)


def test_a_rebound_name_can_neither_read_nor_drive_the_admin_api(
    setup: tuple[Pool, Any, int, Path],
) -> None:
    p, driver, _, _ = setup
    port = p.url.rsplit(":", 1)[1]
    rebound = f"http://rebind.test:{port}"
    driver.get(rebound + "/ui")
    assert "auth.allowed_hosts" in driver.page_source  # the page is refused, with the reason
    driver.get(rebound + "/health")  # any page of that origin: the attacker's own script
    driver.set_script_timeout(30)
    statuses = driver.execute_async_script("""
        const done = arguments[arguments.length - 1];
        Promise.all([fetch("/admin/workers"), fetch("/admin/events"),
                     fetch("/admin/workers/w1/drain", {method: "POST"})])
          .then(rs => done(rs.map(r => r.status)), e => done(String(e)));
    """)
    assert statuses == [403, 403, 403]
    assert _states(p) == {"w1": "ready", "w2": "ready"}


def test_the_pool_page_itself_still_drives_the_pool(setup: tuple[Pool, Any, int, Path]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    p, driver, _, _ = setup
    driver.get(p.url + "/ui")

    def w2_button(d: Any) -> Any:
        found = d.find_elements(By.CSS_SELECTOR, '[data-worker="w2"] button[data-action="drain"]')
        return found[0] if found else False

    wait(driver, w2_button, message="the page never showed w2's Drain button").click()
    wait(driver, ec.alert_is_present(), message="no confirmation").accept()
    wait(driver, lambda _d: _states(p)["w2"] != "ready", message="the page's drain did nothing")
    assert httpx.post(p.url + "/admin/workers/w2/undrain").json()["state"] == "ready"
