"""The reference pages are what ``scripts/gen_reference.py`` makes of the code, and a config
field without its entry fails (shown with a planted field)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

import pytest
from pydantic import Field, create_model

from gpupool.config import GpupoolConfig
from tests.support.procs import ROOT


def _generator() -> ModuleType:
    path = ROOT / "scripts" / "gen_reference.py"
    spec = importlib.util.spec_from_file_location("gen_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_the_reference_pages_are_the_code() -> None:
    """In a fresh interpreter, as `make docs-ref` runs: click caches a command's help option at
    its first use, so a test that invoked `plan` or `sim` alone earlier in this process would
    leave them without `-h` (the root group's setting) and the pages would seem stale."""
    check = [sys.executable, str(ROOT / "scripts" / "gen_reference.py"), "--check"]
    r = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{r.stderr.strip()}: run `make docs-ref` and commit"


def test_a_new_config_field_without_its_entry_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = create_model(
        "Planted", __base__=GpupoolConfig,
        planted_field=(int, Field(1, description="A field the reference does not list yet.")),
    )  # fmt: skip
    config_page = gen.REFERENCE / "config.md"
    monkeypatch.setattr(gen, "pages", lambda: {config_page: lambda: gen.render_config(planted)})
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/reference/config.md differs from the code: run `make docs-ref`" in err
    assert "planted_field" in gen.render_config(planted)  # what `make docs-ref` would write


def test_a_config_field_without_a_description_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    planted = create_model("Planted", __base__=GpupoolConfig, undescribed=(int, Field(1)))
    config_page = gen.REFERENCE / "config.md"
    monkeypatch.setattr(gen, "pages", lambda: {config_page: lambda: gen.render_config(planted)})
    assert gen.main(["--check"]) == 1
    assert "undescribed" in capsys.readouterr().err


def test_every_metric_and_admin_route_is_listed() -> None:
    metrics = (gen.REFERENCE / "metrics.md").read_text()
    names = ("gpupool_requests_total", "gpupool_queue_wait_seconds", "gpupool_swap_switches_total")
    for name in names:
        assert f"`{name}`" in metrics
    endpoints = (gen.REFERENCE / "endpoints.md").read_text()
    for path in ("/admin/workers/{name}/drain", "/admin/reload", "/v1/chat/completions", "/ready"):
        assert f"`{path}`" in endpoints
