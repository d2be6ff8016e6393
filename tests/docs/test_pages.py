"""What keeps the README short and the guides free of measurement history."""

from __future__ import annotations

import re

import yaml

from tests.support.procs import ROOT

README_MAX_LINES = 150
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# pages whose measurements are allowed (none: a dated run belongs on Benchmarks or in the archive)
HISTORY_ALLOWED: set[str] = set()


def _nav_pages(section: str) -> list[str]:
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    (entries,) = [item[section] for item in nav if isinstance(item, dict) and section in item]
    return [page for entry in entries for page in entry.values()]


def test_the_readme_stays_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): put the detail in a page "
        "under docs/ and link it from the README's table"
    )


def test_guides_carry_no_measurement_history() -> None:
    """A dated run belongs on the Benchmarks page (with its commit) or in the archive."""
    for page in _nav_pages("Getting started") + _nav_pages("Guides"):
        if page in HISTORY_ALLOWED:
            continue
        dates = DATE.findall(_with_includes((ROOT / "docs" / page).read_text()))
        assert not dates, f"docs/{page} carries dated measurements {dates}: move them to Benchmarks"


def _with_includes(text: str) -> str:
    """A page's text with the files it includes (``--8<-- "path:start:end"``), as the site shows
    it: an included README is part of the guide."""
    out = []
    for line in text.splitlines():
        found = re.fullmatch(r'--8<-- "([^":]+)(?::(\d+):(\d+))?"', line.strip())
        if not found:
            out.append(line)
            continue
        lines = (ROOT / found.group(1)).read_text().splitlines()
        start, end = int(found.group(2) or 1), int(found.group(3) or len(lines))
        out.extend(lines[start - 1 : end])
    return "\n".join(out)
