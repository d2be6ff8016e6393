"""Debian's headless Chromium, driven by Selenium through Debian's chromedriver."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]  # fmt: skip
T = TypeVar("T")


def need_chromium() -> None:
    """Skip, saying why, where Debian's chromium cannot be had (``make test`` installs it with
    ``scripts/install_ops_deps.sh browser``)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        reason = "bash scripts/install_ops_deps.sh browser could not install " + ", ".join(missing)
        if shutil.which("apt-get") is None:
            reason += " (no apt-get on this machine)"
        pytest.skip(reason)


@contextlib.contextmanager
def chromium(
    profile: Path, width: int = 1280, height: int = 900, flags: tuple[str, ...] = ()
) -> Iterator[Any]:
    need_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, *flags, f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=CHROMEDRIVER, log_output=str(profile.parent / "driver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, what: Callable[[Any], T], timeout: float = 30.0, message: str = "") -> T:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the page replaces parts of itself at every event: an element found may go before it is read
    waiter = WebDriverWait(driver, timeout, poll_frequency=0.1,
                           ignored_exceptions=(StaleElementReferenceException,))  # fmt: skip
    return waiter.until(what, message)  # type: ignore[no-any-return]


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """What the page logged at SEVERE since the last call (console errors, failed loads)."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver: Any, path: Path, width: int) -> Path:
    """The whole page at ``width`` px (the window grown to the page's height)."""
    driver.set_window_size(width, 900)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(width, max(600, min(int(height) + 120, 6000)))
    driver.save_screenshot(str(path))
    return path
