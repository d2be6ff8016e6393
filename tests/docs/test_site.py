"""The documentation site builds with ``mkdocs build --strict``, opens offline, and fails to build
when a link or an anchor is broken (shown on a copy with one planted)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT

MKDOCS = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir"]
# what mkdocs.yml's snippets include from outside docs/
INCLUDED = ["CHANGELOG.md", "DEVELOPING.md", "scripts/gpu_lane/README.md"]


def build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([*MKDOCS, str(site)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip


def copy_of_the_docs(tmp: Path) -> Path:
    root = tmp / "repo"
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.json"))
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    for name in INCLUDED:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    return root


def test_the_site_builds_strict_and_opens_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    r = build(ROOT, site)
    assert r.returncode == 0, r.stderr[-3000:]
    pages = list(site.rglob("*.html"))
    assert (site / "index.html").exists() and len(pages) > 20
    for page in pages:  # nothing fetched from elsewhere: no fonts, scripts or styles by URL
        html = page.read_text()
        assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(https?:)?//", html), page
    assert (site / "reference" / "config.html").exists()  # page.html links work from file://


@pytest.mark.parametrize(
    ("planted", "complaint"),
    [
        ("[the queue](guides/no-such-page.md)", "guides/no-such-page.md"),
        ("[a 429](guides/queueing.md#no-such-heading)", "no-such-heading"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, planted: str, complaint: str) -> None:
    root = copy_of_the_docs(tmp_path)
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee {planted}.\n")
    r = build(root, tmp_path / "site")
    assert r.returncode != 0
    assert complaint in r.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path: Path) -> None:
    """A new docs/*.md page must be placed in mkdocs.yml's nav, where readers find it."""
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "orphan.md").write_text("# A page nobody can find\n")
    r = build(root, tmp_path / "site")
    assert r.returncode != 0
    assert 'not included in the "nav"' in r.stderr and "orphan.md" in r.stderr
