"""The pool page in a real browser (Debian's headless Chromium through Selenium) against a real
`gpupool serve` with two simulated workers: it loads with no console error, takes the admin key
from its form, shows a worker going ready -> draining -> ready when its buttons are pressed
(confirmations accepted), follows a worker that is killed, and refuses actions without the key.
Screenshots at 1280 and 375 px are left in the test's tmp dir."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.ui.browser import chromium, console_errors, need_chromium, screenshot, wait
from tests.gateway.ui.pool import ADMIN, ADMIN_H, CLIENT, OTHER, Pool, pool
from tests.support.hostile_tools import assert_nothing_held

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, Any, Path]]:
    need_chromium()
    tmp = tmp_path_factory.mktemp("pool-page")
    with pool(tmp) as p, chromium(tmp / "profile") as driver:
        yield p, driver, tmp


def _css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def _state(driver: Any, worker: str) -> str | None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    for _ in range(50):  # the badge is replaced at every event: read it again if it just went
        try:
            label = _css(driver, f'[data-worker="{worker}"] .state-label')
            return str(label.get_attribute("data-state"))
        except NoSuchElementException:
            return None
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{worker}'s state never held still long enough to read")


def _text(driver: Any, selector: str) -> str:
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return str(_css(driver, selector).text)
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{selector} never held still long enough to read")


def _log_in(p: Pool, driver: Any, key: str = ADMIN) -> None:
    driver.get(p.url + "/ui")
    driver.execute_script("sessionStorage.clear()")
    driver.get(p.url + "/ui")
    form = wait(driver, lambda d: _css(d, "#login").is_displayed() and _css(d, "#key"))
    form.send_keys(key)
    _css(driver, "#login-form button[type=submit]").click()
    wait(driver, lambda d: _state(d, "w1") == "ready", message="w1 never shown ready")


def _press(driver: Any, worker: str, action: str) -> None:
    from selenium.webdriver.support import expected_conditions as ec

    _css(driver, f'[data-worker="{worker}"] button[data-action="{action}"]').click()
    alert = wait(driver, ec.alert_is_present(), message=f"no confirmation for {action}")
    alert.accept()


def _changes(driver: Any) -> str:
    return _text(driver, "#changes")


def test_page_loads_asks_for_the_key_and_shows_the_pool(page: tuple[Pool, Any, Path]) -> None:
    p, driver, tmp = page
    driver.get(p.url + "/ui")
    wait(driver, lambda d: _css(d, "#login").is_displayed(), message="no login form")
    assert not _css(driver, "#pool").is_displayed()
    _log_in(p, driver)
    assert _state(driver, "w2") == "ready"
    assert "✓ ready" in _text(driver, '[data-worker="w1"] .state-label')  # a symbol and text
    assert "4,096 tokens" in _css(driver, '[data-worker="w1"]').text
    assert "m" in _css(driver, "#queues").text and "0 requests" in _css(driver, "#queues").text
    assert driver.execute_script("return sessionStorage.getItem('gpupool-admin-key')") == ADMIN
    assert ADMIN not in driver.current_url and not driver.get_cookies()
    assert console_errors(driver) == []
    wide = screenshot(driver, tmp / "pool-1280.png", 1280)
    narrow = screenshot(driver, tmp / "pool-375.png", 375)
    width = driver.execute_script("return document.documentElement.scrollWidth")
    assert width <= 375, f"the page scrolls sideways at 375 px ({width} px wide)"
    assert wide.stat().st_size > 10_000 and narrow.stat().st_size > 10_000
    if os.environ.get("GPUPOOL_UI_SCREENSHOT"):  # docs/pool-page.png is made this way
        shutil.copy(wide, os.environ["GPUPOOL_UI_SCREENSHOT"])
    driver.set_window_size(1280, 900)
    assert console_errors(driver) == []


def test_drain_then_resume_from_the_buttons(page: tuple[Pool, Any, Path]) -> None:
    p, driver, _ = page
    _log_in(p, driver)
    _press(driver, "w1", "drain")
    wait(driver, lambda d: "w1 (m): ✓ ready → ⇣ draining" in _changes(d),
         message="the page never showed w1 ready -> draining")  # fmt: skip
    wait(driver, lambda d: "Drain w1: done" in _css(d, "#result").text, message="no drain result")
    shown = _state(driver, "w1")
    assert shown in ("draining", "stopped"), (shown, _changes(driver))
    assert httpx.get(p.url + "/admin/workers/w1", headers=ADMIN_H).json()["state"] != "ready"
    _press(driver, "w1", "undrain")
    wait(driver, lambda d: _state(d, "w1") == "ready", message="w1 never ready again")
    assert "Resume w1: done" in _css(driver, "#result").text
    assert httpx.get(p.url + "/admin/workers/w1", headers=ADMIN_H).json()["state"] == "ready"
    assert console_errors(driver) == []
    assert_nothing_held(p.url, ADMIN_H)


def test_actions_without_the_key_are_refused(page: tuple[Pool, Any, Path]) -> None:
    p, driver, _ = page
    _log_in(p, driver)
    driver.execute_script("sessionStorage.removeItem('gpupool-admin-key')")
    _press(driver, "w1", "drain")
    wait(driver, lambda d: "refused (401)" in _css(d, "#result").text,
         message="a drain without the key was not refused")  # fmt: skip
    wait(driver, lambda d: _css(d, "#login").is_displayed(), message="no login form after a 401")
    assert httpx.get(p.url + "/admin/workers/w1", headers=ADMIN_H).json()["state"] == "ready"
    _css(driver, "#key").send_keys("sk-not-the-admin-key")  # a wrong key: the form again
    _css(driver, "#login-form button[type=submit]").click()
    wait(driver, lambda d: "refused that key" in _css(d, "#login-why").text,
         message="a wrong key was not refused")  # fmt: skip
    assert not _css(driver, "#pool").is_displayed()
    refused = console_errors(driver)  # the browser logs each refused request: only those
    assert refused and all("status of 401" in e["message"] for e in refused), refused


def test_the_page_follows_a_killed_worker(page: tuple[Pool, Any, Path]) -> None:
    p, driver, _ = page
    _log_in(p, driver)
    p.w2.kill()
    wait(driver, lambda d: _state(d, "w2") == "failed", message="w2 never shown failed")
    assert "✕ failed" in _text(driver, '[data-worker="w2"] .state-label')
    assert "w2 (other): ✓ ready → ✕ failed" in _changes(driver)
    assert _state(driver, "w1") == "ready"
    # a request for w2's model now fails: the page lists it with the id the client got
    chat = {"model": OTHER, "messages": [{"role": "user", "content": "hi"}]}
    client = {"authorization": f"Bearer {CLIENT}"}
    r = httpx.post(p.url + "/v1/chat/completions", headers=client, json=chat, timeout=30)
    assert r.status_code >= 500, r.text
    rid = r.headers["x-request-id"]
    wait(driver, lambda d: rid in _css(d, "#errors").text, message="the failure is not listed")
    assert f"answered {r.status_code}" in _text(driver, "#errors")
    assert_nothing_held(p.url, ADMIN_H)


def test_keyboard_reaches_the_buttons_and_a_cancelled_confirmation_does_nothing(
    page: tuple[Pool, Any, Path],
) -> None:
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec

    p, driver, _ = page
    _log_in(p, driver)
    body = _css(driver, "body")
    for _ in range(10):  # Tab from the top until the first worker's Drain button has focus
        body = driver.switch_to.active_element
        if body.get_attribute("data-action") == "drain":
            break
        body.send_keys(Keys.TAB)
    focused = driver.switch_to.active_element
    assert focused.get_attribute("data-action") == "drain", "Tab never reached a Drain button"
    outline = driver.execute_script("return getComputedStyle(document.activeElement).outlineStyle")
    assert outline not in ("", "none"), "the focused button shows no outline"
    focused.send_keys(Keys.ENTER)
    wait(driver, ec.alert_is_present(), message="Enter did not ask for a confirmation").dismiss()
    assert _state(driver, "w1") == "ready"  # the first card's button: w1's
    assert httpx.get(p.url + "/admin/workers/w1", headers=ADMIN_H).json()["state"] == "ready"
    assert console_errors(driver) == []
