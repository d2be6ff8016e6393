"""Every figure on the Benchmarks page names the commit it measured, its date and its command.

A figure is a table; the paragraph before it (since the previous heading or table) must hold a
``**Measured:**`` line with a commit that exists in this repository, a date and a command in
backticks. A planted table without its commit fails.
"""

from __future__ import annotations

import re
import subprocess

from tests.support.procs import ROOT

PAGE = ROOT / "docs" / "benchmarks.md"
COMMIT = re.compile(r"commit `([0-9a-f]{7,40})`")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMAND = re.compile(r"`((make|scripts/|bench/|\.venv/|gpupool )[^`]*)`")


def _commit_exists(commit: str) -> bool:
    if not (ROOT / ".git").exists():  # not a checkout (an sdist): the format is all we can check
        return True
    r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                       capture_output=True)  # fmt: skip
    if r.returncode == 0:
        return True
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip()  # fmt: skip
    return shallow == "true"  # a shallow clone may not hold it: not the page's fault


def problems(text: str) -> list[str]:
    """Each table of ``text`` whose measurement line is missing or incomplete."""
    found: list[str] = []
    before: list[str] = []
    in_table = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("|"):
            if not in_table:
                found += _check("\n".join(before), number)
            in_table = True
            continue
        if in_table or line.startswith("#"):
            before = []
        in_table = False
        before.append(line)
    return found


def _check(paragraph: str, line: int) -> list[str]:
    measured = paragraph[paragraph.find("**Measured:**") :] if "**Measured:**" in paragraph else ""
    where = f"benchmarks.md:{line}: the table's **Measured:** line"
    if not measured:
        return [f"{where} is missing"]
    out = []
    commits = COMMIT.findall(measured)
    if not commits:
        out.append(f"{where} names no commit")
    out += [f"{where} names commit {c}, which this repository does not have"
            for c in commits if not _commit_exists(c)]  # fmt: skip
    if not DATE.search(measured):
        out.append(f"{where} has no date")
    if not COMMAND.search(measured):
        out.append(f"{where} has no command in backticks")
    return out


def test_every_figure_names_its_commit_date_and_command() -> None:
    text = PAGE.read_text()
    assert text.count("\n|---") >= 4  # the page has its figures
    assert problems(text) == []


def test_a_figure_without_its_commit_fails() -> None:
    text = PAGE.read_text()
    planted = text + "\n## A new figure\n\nMeasured yesterday.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert problems(planted) == [f"benchmarks.md:{len(text.splitlines()) + 6}: the table's "
                                 "**Measured:** line is missing"]  # fmt: skip
    no_commit = text.replace("commit `2c63dd4`", "commit 2c63dd4", 1)
    assert any("names no commit" in p for p in problems(no_commit))
    unknown = text.replace("commit `2c63dd4`", "commit `0123abc`", 1)
    assert any("0123abc" in p for p in problems(unknown))
