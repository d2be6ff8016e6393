"""The pool page over a swap group (two launched simulated workers taking turns on GPU 0),
with the admin API open on loopback (auth off): the page opens without a key, lists GPU 0 with
both workers and its memory unknown (no NVML here), and its Wake, Sleep and Restart buttons
(confirmations accepted) move the workers as the admin routes do; each result line names the
state its action leads to, and a stopped worker shows Resume but no Sleep or Stop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.swap.tools import serving, two_model_config, wait_states
from tests.gateway.ui.browser import chromium, console_errors, need_chromium, wait
from tests.gateway.ui.test_pool_page import _changes, _press, _state, _text
from tests.support.hostile_tools import assert_nothing_held
from tests.support.procs import Proc

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
def swap_page(tmp_path: Path) -> Iterator[tuple[Proc, Any]]:
    need_chromium()
    with serving(two_model_config(tmp_path), tmp_path) as gw, chromium(tmp_path / "p") as driver:
        wait_states(gw, {"coder-w": "ready", "chat-w": "asleep"})
        yield gw, driver


def test_wake_sleep_and_restart_from_the_page(swap_page: tuple[Proc, Any]) -> None:
    gw, driver = swap_page
    driver.get(gw.url + "/ui")
    wait(driver, lambda d: _state(d, "chat-w") == "asleep", message="chat-w never shown asleep")
    assert not driver.find_element("id", "login").is_displayed()  # open admin API: no key asked
    assert "☾ asleep" in _text(driver, '[data-worker="chat-w"] .state-label')
    gpus = _text(driver, "#gpus")
    assert "GPU 0" in gpus and "unknown" in gpus and "coder-w, chat-w" in gpus
    assert "swap group gpu0: held by coder-w, 0 switches" in gpus
    assert "swap group gpu0" in _text(driver, '[data-worker="chat-w"] .model')

    _press(driver, "chat-w", "wake")
    wait(driver, lambda d: _state(d, "chat-w") == "ready" and _state(d, "coder-w") == "asleep",
         message="the page never showed chat-w awake and coder-w asleep")  # fmt: skip
    assert "chat-w (chat): ☀ waking → ✓ ready" in _changes(driver)
    assert "Wake chat-w: done" in _text(driver, "#result")
    wait(driver, lambda d: "held by chat-w, 1 switch, last" in _text(d, "#gpus"),
         message="the GPU row never named the new holder and its switch")  # fmt: skip

    _press(driver, "chat-w", "sleep")
    wait(driver, lambda d: _state(d, "chat-w") == "asleep", message="chat-w never asleep again")
    assert "Sleep chat-w: done" in _text(driver, "#result")

    _press(driver, "coder-w", "wake")
    wait(driver, lambda d: _state(d, "coder-w") == "ready", message="coder-w never woken")
    _press(driver, "coder-w", "restart")
    wait(driver, lambda d: "Restart coder-w: done" in _text(d, "#result"), timeout=60,
         message="no restart result")  # fmt: skip
    assert "(now starting; it takes requests once it answers)" in _text(driver, "#result")
    wait(driver, lambda d: _state(d, "coder-w") == "ready", timeout=60,
         message="coder-w never ready after its restart")  # fmt: skip
    changes = _changes(driver)  # newest first: the restart, after the wake
    restarted = changes.index("coder-w (coder): ■ stopped → ◔ starting")
    stopped = changes.index("coder-w (coder): ⇣ draining → ■ stopped")  # drained first
    assert stopped > restarted
    assert changes.index("coder-w (coder): ✓ ready → ⇣ draining") > stopped
    assert changes.index("coder-w (coder): ☀ waking → ✓ ready") > restarted

    _press(driver, "chat-w", "stop")  # asleep: stopped at once, its process ends
    wait(driver, lambda d: _state(d, "chat-w") == "stopped", message="chat-w never stopped")
    assert "Stop chat-w: done (now stopped: its process has ended)" in _text(driver, "#result")
    assert _hidden(driver, "chat-w", "sleep") and _hidden(driver, "chat-w", "stop")
    assert not _hidden(driver, "chat-w", "undrain")
    _press(driver, "chat-w", "undrain")
    wait(driver, lambda d: "Resume chat-w: done" in _text(d, "#result"), message="no resume")
    assert "(now starting; it takes requests once it answers)" in _text(driver, "#result")
    assert console_errors(driver) == []
    assert_nothing_held(gw.url)


def _hidden(driver: Any, worker: str, action: str) -> bool:
    button = driver.find_element(
        "css selector", f'[data-worker="{worker}"] button[data-action="{action}"]'
    )
    return not button.is_displayed()
